"""Load a safetensors checkpoint (one file or sharded with an index) into a tessera model.

Each parameter's `weight_loader` narrows the lazy checkpoint tensor to its own slice, so a rank
reads only the bytes it keeps. Parameters are poisoned with NaN first, so a tensor missing from
the checkpoint is found and named instead of silently serving garbage.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from runtime.layers.weights import LazyWeight

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


class CheckpointError(RuntimeError):
    """The checkpoint folder cannot be loaded into the model."""


def resolve_dtype(name: str, checkpoint_dtype: str, device: str) -> torch.dtype:
    """ "auto" takes the checkpoint's dtype on GPU and float32 on CPU."""
    if name == "auto":
        name = checkpoint_dtype if device.startswith("cuda") else "float32"
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)} or auto")
    return DTYPES[name]


def safetensors_files(model_path: str | Path) -> list[Path]:
    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / s for s in shards]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors files in {root}")
    return files


def iterate_weights(
    model_path: str | Path, show_progress: bool = False
) -> Iterator[tuple[str, LazyWeight]]:
    """Yield (name, LazyWeight) for every tensor of the checkpoint, reading nothing yet."""
    files = safetensors_files(model_path)
    for path in tqdm(files, desc="loading shards", disable=not show_progress):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                yield name, LazyWeight(sl, tuple(sl.get_shape()))


def load_checkpoint(model: nn.Module, model_path: str | Path, show_progress: bool = False) -> None:
    """Fill every parameter of `model` (which must have a `load_weights`) from the checkpoint."""
    _poison(model)
    model.load_weights(iterate_weights(model_path, show_progress))
    missing = _unloaded(model)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise CheckpointError(f"checkpoint {model_path} lacks tensors for: {shown}")


@torch.no_grad()
def _poison(model: nn.Module) -> None:
    for p in model.parameters():
        if p.is_floating_point():
            p.fill_(float("nan"))


@torch.no_grad()
def _unloaded(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.is_floating_point() and p.isnan().any()]
