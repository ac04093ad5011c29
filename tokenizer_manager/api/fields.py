"""Nothing silently ignored: refused fields get a 400 naming them, fields in no vocabulary a
warning (once per name), engine fields pass to SamplingParams only where it has them."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

from pydantic import BaseModel

from runtime.logging_utils import get_logger
from runtime.sampling_params import SamplingParams
from tokenizer_manager.dispatcher import Route
from tokenizer_manager.protocol import INFORMATIONAL, APIError

logger = get_logger(__name__)

Refusals = dict[str, tuple[tuple[Any, ...], str]]


def field_value(req: BaseModel, name: str) -> Any:
    if name in type(req).model_fields:
        return getattr(req, name)
    return (req.model_extra or {}).get(name)


def asks_nothing(value: Any, inert: tuple[Any, ...]) -> bool:
    """None, false, an empty string/list/object, or one of the field's own inert values."""
    if value is None or value is False or value in inert:
        return True
    return isinstance(value, (str, list, dict)) and not value


def refuse_fields(req: BaseModel, table: Refusals) -> None:
    """A 400 naming the first field of `table` the request sets to something that asks
    (invariant 16: honoured or refused, never ignored)."""
    for name, (inert, reason) in table.items():
        if not asks_nothing(field_value(req, name), inert):
            raise unsupported(name, reason)


def unsupported(name: str, reason: str) -> APIError:
    return APIError(f"{name} is not supported: {reason}", param=name, code="unsupported_parameter")


class UnknownFields:
    """Logs one warning per field name that no vocabulary tessera knows defines."""

    def __init__(self) -> None:
        self.warned: set[str] = set()

    def check(self, req: BaseModel, known: Collection[str], prefix: str = "") -> None:
        for name in req.model_extra or {}:
            if name in known or name in INFORMATIONAL:
                continue
            path = prefix + name
            if path not in self.warned:
                self.warned.add(path)
                logger.warning("ignoring the unknown request field %r", path)


def sampler_has(attribute: str) -> bool:
    """Whether SamplingParams has `attribute` (engine fields land there one by one)."""
    return attribute in {f.name for f in dataclasses.fields(SamplingParams)}


def engine_value(name: str, attribute: str, value: Any) -> dict[str, Any]:
    """{attribute: value} for SamplingParams, or a 400 naming `name` while it lacks one."""
    if not sampler_has(attribute):
        raise unsupported(name, "not built yet")
    return {attribute: value}


def route_of(req: BaseModel, session: str | None, replicas: int) -> Route:
    """Where the request asks to run: `data_parallel_rank` (a 400 naming it when there is no
    such replica), and its session: the `X-Session-Id` header, else the `user` field."""
    rank = field_value(req, "data_parallel_rank")
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < replicas):
        raise APIError(
            f"data_parallel_rank {rank!r}: this server has {replicas} replica"
            f"{'s' if replicas > 1 else ''} (0 to {replicas - 1})",
            param="data_parallel_rank",
            code="invalid_data_parallel_rank",
        )
    user = field_value(req, "user")
    return Route(rank, session or (user if isinstance(user, str) and user else None))
