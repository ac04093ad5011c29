"""Driving a ModelRunner directly, without a scheduler: for parity tests against HF."""

from __future__ import annotations

from scheduler.model_runner import ModelRunner
from scheduler.req import Req


def release(runner: ModelRunner, req: Req) -> None:
    """Free every KV slot and the request slot `req` holds (no radix cache here)."""
    if req.req_pool_index < 0:
        return
    runner.kv_pool.free(runner.req_pool.req_to_token[req.req_pool_index, : req.kv_len].cpu())
    runner.req_pool.free(req.req_pool_index)
    req.req_pool_index, req.kv_len = -1, 0


def greedy_generate(
    runner: ModelRunner, req: Req, max_new_tokens: int, chunk_size: int | None = None
) -> list[int]:
    """Prefill (optionally in chunks), then decode greedily; frees the request at the end."""
    runner.admit(req)
    try:
        prompt_len = len(req.token_ids)
        step = chunk_size or prompt_len
        while req.kv_len < prompt_len:
            logits = runner.extend([req], [min(step, prompt_len - req.kv_len)])
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(logits[-1].argmax())
            out.append(token)
            req.token_ids.append(token)
            if len(out) < max_new_tokens:
                logits = runner.decode([req])
        return out
    finally:
        release(runner, req)
