"""POST /tokenize and /detokenize in vLLM's shapes: a prompt or chat messages (rendered by the
chat template, every image and video counted as the tokens it takes) to token ids, and back."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from tokenizer_manager.api.base import ApiContext, check_model
from tokenizer_manager.api.chat import check_template_inputs, hf_message, template_kwargs
from tokenizer_manager.api.fields import refuse_fields
from tokenizer_manager.protocol import (
    TOKENIZE_REFUSED,
    APIError,
    DetokenizeRequest,
    TokenizeRequest,
    new_id,
)
from tokenizer_manager.tokenizer_manager import GenerateInput, TokenizerManager


def no_sampling(room: int) -> Any:
    raise AssertionError("tokenizing samples nothing")


class TokenizeServing:
    def __init__(self, tm: TokenizerManager, ctx: ApiContext) -> None:
        self.tm = tm
        self.ctx = ctx

    async def handle(
        self, req: TokenizeRequest, arrival: float, scope: str = "", session: str | None = None
    ) -> JSONResponse:
        """`session` (a routing header) does not apply: nothing runs on a replica."""
        ids = await self.ids(req, scope)
        body = {
            "count": len(ids),
            "max_model_len": self.tm.context_length,
            "tokens": ids,
            "token_strs": self.tm.tokenizer.convert_ids_to_tokens(ids)
            if req.return_token_strs
            else None,
        }
        return JSONResponse(body)

    async def ids(self, req: TokenizeRequest, scope: str = "") -> list[int]:
        check_model(self.tm, req.model)
        self.ctx.unknown.check(req, TOKENIZE_REFUSED)
        refuse_fields(req, TOKENIZE_REFUSED)
        inp = self.to_input(req)
        inp.media_scope = scope
        ids, _ = await self.tm.prompt_ids(inp)
        return ids

    def to_input(self, req: TokenizeRequest) -> GenerateInput:
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if req.prompt is not None:
            return GenerateInput(
                new_id("tok"),
                False,
                no_sampling,
                text=req.prompt,
                mm_processor_kwargs=req.mm_processor_kwargs,
            )
        check_template_inputs(self.tm, req.tools, req.documents)
        return GenerateInput(
            new_id("tok"),
            False,
            no_sampling,
            messages=[hf_message(i, m) for i, m in enumerate(req.messages)],
            template_kwargs=template_kwargs(req),
            mm_processor_kwargs=req.mm_processor_kwargs,
        )


class DetokenizeServing:
    def __init__(self, tm: TokenizerManager, ctx: ApiContext) -> None:
        self.tm = tm
        self.ctx = ctx

    async def handle(
        self, req: DetokenizeRequest, arrival: float, scope: str = "", session: str | None = None
    ) -> JSONResponse:
        check_model(self.tm, req.model)
        self.ctx.unknown.check(req, ())
        vocab = self.tm.config.text.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(f"token ids must be in [0, {vocab})", param="tokens")
        text = await self.tm.in_thread(self.tm.tokenizer.decode, req.tokens)
        return JSONResponse({"prompt": text})
