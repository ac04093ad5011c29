"""Every spelling of a structured-output request, read into one `GrammarSpec` (or a 400 naming
the field): OpenAI's `response_format`, vLLM's `structured_outputs` and older `guided_*` fields,
SGLang's `json_schema` / `regex` / `ebnf` / `structural_tag` (top level on chat and completions,
in `sampling_params` on /generate). A request gives at most one constraint."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel

from runtime.grammar import GrammarError, GrammarSpec
from tokenizer_manager.api.fields import asks_nothing, field_value
from tokenizer_manager.protocol import APIError

Reader = Callable[[Any, str], "GrammarSpec | None"]


def _schema(value: Any, param: str) -> GrammarSpec:
    return GrammarSpec.json_schema(value, param)


def _text(kind: str) -> Reader:
    def read(value: Any, param: str) -> GrammarSpec:
        if not isinstance(value, str) or not value:
            raise GrammarError(f"{param} must be a non-empty string", param)
        return GrammarSpec(kind, value, param)  # type: ignore[arg-type]

    return read


def _choice(value: Any, param: str) -> GrammarSpec:
    if not isinstance(value, list):
        raise GrammarError(f"{param} must be a list of strings", param)
    return GrammarSpec.choice(value, param)


def _structural_tag(value: Any, param: str) -> GrammarSpec:
    if isinstance(value, Mapping) and value.get("type") == "structural_tag":
        value = {k: v for k, v in value.items() if k != "type"}
    return GrammarSpec.structural_tag(value, param)


def _json_object(value: Any, param: str) -> GrammarSpec | None:
    if value is not True:
        raise GrammarError(f"{param} must be true when given", param)
    return GrammarSpec("json_object", "", param)


def _response_format(value: Any, param: str) -> GrammarSpec | None:
    if not isinstance(value, Mapping):
        raise GrammarError("response_format must be an object", param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", param)
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, Mapping) or "schema" not in inner:
            raise GrammarError("response_format.json_schema.schema is required", param)
        return _schema(inner["schema"], param)  # strict or not, the schema is enforced
    if kind == "structural_tag":
        return _structural_tag(value, param)
    raise GrammarError(
        f"response_format.type must be text, json_object, json_schema or structural_tag, "
        f"got {kind!r}",
        param,
    )


# vLLM's StructuredOutputsParams: key -> reader; its options that change nothing here are inert
STRUCTURED_KEYS: dict[str, Reader] = {
    "json": _schema,
    "regex": _text("regex"),
    "choice": _choice,
    "grammar": _text("ebnf"),
    "structural_tag": _structural_tag,
    "json_object": _json_object,
}
STRUCTURED_INERT = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties"}


def _structured_outputs(value: Any, param: str) -> GrammarSpec | None:
    if not isinstance(value, Mapping):
        raise GrammarError("structured_outputs must be an object", param)
    unknown = set(value) - STRUCTURED_KEYS.keys() - STRUCTURED_INERT
    asking = sorted(k for k in unknown if not asks_nothing(value[k], ()))
    if asking:
        raise GrammarError(f"structured_outputs.{asking[0]} is not supported", param)
    given = {k: v for k, v in value.items() if k in STRUCTURED_KEYS and v is not None}
    return one_of(
        [STRUCTURED_KEYS[k](v, f"{param}.{k}") for k, v in given.items() if v is not False]
    )


# request field -> reader, for chat and completions (vLLM's and SGLang's spellings)
OPENAI_READERS: dict[str, Reader] = {
    "response_format": _response_format,
    "structured_outputs": _structured_outputs,
    "guided_json": _schema,
    "guided_regex": _text("regex"),
    "guided_choice": _choice,
    "guided_grammar": _text("ebnf"),
    "json_schema": _schema,
    "regex": _text("regex"),
    "ebnf": _text("ebnf"),
    "structural_tag": _structural_tag,
}
# /generate's sampling_params (SGLang's spelling: schemas come as JSON strings)
NATIVE_READERS: dict[str, Reader] = {
    name: OPENAI_READERS[name] for name in ("json_schema", "regex", "ebnf", "structural_tag")
}


def one_of(specs: list[GrammarSpec | None]) -> GrammarSpec | None:
    given = [s for s in specs if s is not None]
    if len(given) > 1:
        names = ", ".join(str(s.param) for s in given)
        raise GrammarError(f"give one structured-output constraint, not {names}", given[1].param)
    return given[0] if given else None


def read_constraint(
    values: Mapping[str, Any], readers: Mapping[str, Reader], prefix: str = ""
) -> GrammarSpec | None:
    """The one constraint among `values` (field name -> value), or None; a 400 naming the
    field when it is malformed or when two are given."""
    try:
        return one_of(
            [
                reader(values[name], prefix + name)
                for name, reader in readers.items()
                if not asks_nothing(values.get(name), ())
            ]
        )
    except GrammarError as exc:
        raise APIError(str(exc), param=exc.param) from None


def openai_constraint(req: BaseModel) -> GrammarSpec | None:
    """A chat or completions request's constraint (fields declared or extra)."""
    return read_constraint({n: field_value(req, n) for n in OPENAI_READERS}, OPENAI_READERS)
