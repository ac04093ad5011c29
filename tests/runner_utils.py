"""Driving a ModelRunner directly, without a scheduler: for parity tests against HF."""

from __future__ import annotations

import torch

from scheduler.model_runner import ModelRunner
from scheduler.req import Req


def extend(runner: ModelRunner, seqs: list[Req], lens: list[int]) -> torch.Tensor:
    """Prefill the next lens[i] tokens of each sequence: a step with no decode tail; the logits
    of each sequence's last new token."""
    return runner.mixed(seqs, lens, [])


def extend_all_logits(runner: ModelRunner, seq: Req, n: int) -> torch.Tensor:
    """Prefill the next `n` tokens of `seq` and return the logits of every one of them."""
    return extend_all_logits_batch(runner, [seq], [n])[0]


def extend_all_logits_batch(runner: ModelRunner, seqs: list[Req], lens: list[int]) -> list:
    """Prefill the next lens[i] tokens of each sequence in one step; each one's logits of every
    new token: the decoder's hidden states, read by a forward hook, through the model's own LM
    head."""
    lm = runner.model.language_model
    hidden: list[torch.Tensor] = []
    hook = lm.model.register_forward_hook(lambda _m, _args, out: hidden.append(out))
    try:
        runner.mixed(seqs, lens, [])
    finally:
        hook.remove()
    return list(lm.lm_head(hidden[0]).split(lens))


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
    return greedy_generate_batch(runner, [req], max_new_tokens, chunk_size)[0]


def greedy_generate_batch(
    runner: ModelRunner, reqs: list[Req], max_new_tokens: int, chunk_size: int | None = None
) -> list[list[int]]:
    """Prefill every request together (optionally in chunks of `chunk_size` tokens each), then
    decode greedily over the whole batch; frees them at the end."""
    for req in reqs:
        runner.admit(req)
    try:
        logits: list = [None] * len(reqs)  # each request's logits after its last prompt token
        while active := [i for i, r in enumerate(reqs) if r.kv_len < len(r.token_ids)]:
            left = [len(reqs[i].token_ids) - reqs[i].kv_len for i in active]
            lens = [min(chunk_size or n, n) for n in left]
            for i, row in zip(active, extend(runner, [reqs[i] for i in active], lens)):
                logits[i] = row
        outs: list[list[int]] = [[] for _ in reqs]
        for step in range(max_new_tokens):
            for req, out, row in zip(reqs, outs, logits):
                out.append(int(row.argmax()))
                req.token_ids.append(out[-1])
            if step + 1 < max_new_tokens:
                logits = runner.decode(reqs)
        return outs
    finally:
        for req in reqs:
            release(runner, req)
