"""The front end's check of a request's constraint before it reaches the scheduler: compiled on
the grammar compiler's own threads (never on the event loop), under its size and time limits, so
an invalid or explosive schema, regex or grammar is a 400 naming its field while other requests
keep their speed (invariant 18). Results are cached by the constraint's text (failures too)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from runtime.grammar import GrammarCompiler, GrammarError, GrammarSpec, checkpoint_compiler
from tokenizer_manager.protocol import APIError


class GrammarCheck:
    def __init__(self, model_path: str, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.model_path, self.vocab_size = model_path, vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._building = asyncio.Lock()

    async def compiler(self) -> GrammarCompiler:
        """Built once, on a thread (it reads and indexes the tokenizer)."""
        async with self._building:
            if self._compiler is None:
                self._compiler = await asyncio.to_thread(
                    checkpoint_compiler, self.model_path, self.vocab_size, self.stop_token_ids
                )
        return self._compiler

    async def check(self, spec: GrammarSpec) -> None:
        """A 400 naming `spec.param` when the constraint does not compile within the limits."""
        compiler = await self.compiler()
        timeout = compiler.limits.timeout_s
        try:
            future = asyncio.wrap_future(compiler.submit(spec))
            await asyncio.wait_for(asyncio.shield(future), timeout)  # the cached compile lives on
        except TimeoutError:
            message = f"{spec.kind} did not compile within {timeout:g} s"
            raise APIError(message, param=spec.param) from None
        except GrammarError as exc:
            raise APIError(str(exc), param=spec.param or exc.param) from None

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()
