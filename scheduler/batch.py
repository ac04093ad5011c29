"""One prefill step as one object: the requests, the prompt tokens each computes this step, and,
in a mixed step, the running requests that decode one token in the same forward."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from scheduler.req import Req


@dataclass
class PrefillBatch:
    reqs: list[Req] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)  # lens[i]: prompt tokens reqs[i] computes now
    decodes: list[Req] = field(default_factory=list)  # mixed steps: one decode token each
    patches: int = 0  # vision patches the chunks give the encoder (media items they enter)

    def add(self, req: Req, n: int) -> None:
        self.reqs.append(req)
        self.lens.append(n)

    def __bool__(self) -> bool:
        return bool(self.reqs)

    def chunks(self) -> Iterator[tuple[Req, int]]:
        return zip(self.reqs, self.lens)

    @property
    def everyone(self) -> list[Req]:
        """Every request in the forward: the chunks, then the decodes (the logits' row order)."""
        return [*self.reqs, *self.decodes]

    @property
    def new_tokens(self) -> int:
        """KV slots the forward writes."""
        return sum(self.lens) + len(self.decodes)

    def keep(self, kept: list[Req]) -> PrefillBatch:
        """The batch without the requests missing from `kept` (requests have identity:
        invariant 12)."""
        alive = set(kept)
        chunks = [(r, n) for r, n in self.chunks() if r in alive]
        decodes = [r for r in self.decodes if r in alive]
        return PrefillBatch([r for r, _ in chunks], [n for _, n in chunks], decodes)

    def sampled(self) -> tuple[list[Req], list[int]]:
        """After the forward: the requests that sample a token (prompt done, or decoding) and
        their rows of the logits."""
        done = [i for i, r in enumerate(self.reqs) if r.extend_len == 0]
        rows = [*done, *range(len(self.reqs), len(self.reqs) + len(self.decodes))]
        return [*(self.reqs[i] for i in done), *self.decodes], rows

    def prompts_done(self) -> list[Req]:
        return [r for r in self.reqs if r.extend_len == 0]

    def cut(self) -> list[Req]:
        """Requests whose prompt this step did not finish (chunked prefill)."""
        return [r for r in self.reqs if r.extend_len != 0]
