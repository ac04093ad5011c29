"""The model-family registry: one entry per family, each declared by its own module.

A new family is one module beside these (its `FAMILY`) and one line in `_BUILT_IN`; shared code
looks a family up here (`family_for` a config.json, `get_family` by name) and never names one.
"""

from __future__ import annotations

from runtime.families import gemma3, glm4v, internvl, qwen2_5_vl, qwen2_vl, qwen3_vl
from runtime.families.base import Family, ModelConfigError

_BUILT_IN = (
    qwen2_vl.FAMILY, qwen2_5_vl.FAMILY, qwen3_vl.FAMILY, internvl.FAMILY, glm4v.FAMILY,
    gemma3.FAMILY,
)  # fmt: skip

FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add `family` to the registry; a name or architecture already taken is a ValueError."""
    taken = {name for known in FAMILIES.values() for name in known.architectures}
    clash = sorted(taken & set(family.architectures))
    if family.name in FAMILIES or clash:
        raise ValueError(f"family {family.name!r} is registered already ({clash or family.name})")
    FAMILIES[family.name] = family
    return family


def supported_architectures() -> list[str]:
    return sorted(name for family in FAMILIES.values() for name in family.architectures)


def get_family(name: str) -> Family:
    """The family registered under `name` (a ModelConfigError naming the known ones if none)."""
    if name not in FAMILIES:
        raise ModelConfigError(f"unknown model family {name!r}; tessera serves: {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_for(cfg: dict) -> Family:
    """The family of a config.json: by its `architectures`, else by its `model_type`."""
    for name in cfg.get("architectures") or []:
        for family in FAMILIES.values():
            if name in family.architectures:
                return family
    model_type = cfg.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    raise ModelConfigError(
        f"unsupported architecture {cfg.get('architectures')} (model_type {model_type!r}); "
        f"tessera serves: {', '.join(supported_architectures())}"
    )


for _family in _BUILT_IN:
    register(_family)
