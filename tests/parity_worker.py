"""Runs inside each spawned rank: tessera's model on the shared cases, results to the parent."""

from __future__ import annotations

from typing import Any

import torch
from runner_utils import (
    extend_all_logits,
    extend_all_logits_batch,
    greedy_generate_batch,
    release,
)

from runtime.distributed import TPGroup
from scheduler.encoder_cache import EncoderCache
from scheduler.model_runner import ModelRunner
from scheduler.req import Req
from vision.encoder_plan import EncoderCosts
from vision.vlm import build_model

CHUNK = 7  # small enough that chunks cut through every image and video
# Auto encoder mode with fixed costs (no calibration noise): TP does 3/4 of the full tower's
# per-patch work, so one item runs TP, and items of similar size run DP.
AUTO_COSTS = EncoderCosts(0.0, 1e-6, 0.0, 0.0, 0.75e-6, 0.0, 1e-6, 0.0, 1e-6, 0.0)


def all_logits(runner: ModelRunner, ids: list[int], mm: Any, chunk: int | None) -> torch.Tensor:
    seq = Req(list(ids), mm)
    runner.admit(seq)
    try:
        parts, step = [], chunk or len(ids)
        while seq.kv_len < len(ids):
            parts.append(extend_all_logits(runner, seq, min(step, len(ids) - seq.kv_len)))
        return torch.cat(parts)
    finally:
        release(runner, seq)


def cut_points(mm: Any) -> list[int]:
    """Chunk ends in the middle of every placeholder run of two tokens or more."""
    if mm is None:
        return []
    runs = [(s, e) for item in mm.items for s, e in item.offsets if e - s > 1]
    return sorted({s + (e - s) // 2 for s, e in runs})


def safe_chunk(runner: ModelRunner, seq: Req, n: int) -> int:
    """A chunk of n tokens as the scheduler cuts it: off the inside of an item where the
    family's items attend both ways (`Req.item_safe_chunk`)."""
    return seq.item_safe_chunk(n) if runner.bidirectional_items else n


def cut_logits(runner: ModelRunner, ids: list[int], mm: Any) -> torch.Tensor:
    """Prefill in chunks that end inside every image and every video frame run (at its start
    instead, for a family whose items attend both ways)."""
    seq = Req(list(ids), mm)
    runner.admit(seq)
    try:
        parts = []
        for end in [*cut_points(mm), len(ids)]:
            n = safe_chunk(runner, seq, end - seq.kv_len)
            parts += [extend_all_logits(runner, seq, n)] if n > 0 else []
        return torch.cat(parts)
    finally:
        release(runner, seq)


def run_cut_cases(tp: TPGroup, model: Any, cases: list[tuple[str, list[int], Any]]) -> dict:
    """Cut prefills with the encoder cache in front of the encoder, as the scheduler has it:
    later chunks of an item read its cached rows (every DeepStack level with them)."""
    cache = EncoderCache(64 * 2**20)
    runner = ModelRunner(
        model, max_total_tokens=1024, max_running_requests=4, max_context_len=256,
        item_encoder=cache.wrap(model.encode_items, tp),
    )  # fmt: skip
    out = {name: cut_logits(runner, ids, mm) for name, ids, mm in cases}
    out["_cache"] = dict(vars(cache.counters))
    out["_kv_free"] = runner.kv_pool.available_size == runner.kv_pool.size
    return out if tp.rank == 0 else {k: out[k] for k in ("_cache", "_kv_free")}


def chunked_logits(runner: ModelRunner, cases: list[tuple[str, list[int], Any]]) -> list:
    """Every case prefilled at once in chunks of CHUNK tokens each: one step carries the next
    chunk of every case not yet done (so a step holds chunks of several images); each case's
    logits of every prompt token."""
    seqs = [Req(list(ids), mm) for _, ids, mm in cases]
    for seq in seqs:
        runner.admit(seq)
    try:
        parts: list[list[torch.Tensor]] = [[] for _ in seqs]
        while any(seq.kv_len < len(seq.token_ids) for seq in seqs):
            active = [i for i, seq in enumerate(seqs) if seq.kv_len < len(seq.token_ids)]
            lens = [safe_chunk(runner, seqs[i], min(CHUNK, len(seqs[i].token_ids) - seqs[i].kv_len))
                    for i in active]  # fmt: skip
            rows = extend_all_logits_batch(runner, [seqs[i] for i in active], lens)
            for i, logits in zip(active, rows):
                parts[i].append(logits)
        return [torch.cat(p) for p in parts]
    finally:
        for seq in seqs:
            release(runner, seq)


def run_cases(
    tp: TPGroup, folder: str, mode: str, cases: list[tuple[str, list[int], Any]], new_tokens: int
) -> dict:
    costs = AUTO_COSTS if mode == "auto" else None
    model = build_model(folder, tp, encoder_mode=mode, encoder_costs=costs, dtype="float32")
    runner = ModelRunner(
        model, max_total_tokens=1024, max_running_requests=len(cases), max_context_len=256
    )
    keep = tp.rank == 0
    # each case alone in full, then all of them in chunks together, then all decoded together
    full = [all_logits(runner, ids, mm, None) for _, ids, mm in cases]  # every rank runs it
    chunked = chunked_logits(runner, cases)
    tokens = greedy_generate_batch(runner, [Req(list(ids), mm) for _, ids, mm in cases], new_tokens)
    out = {
        name: {"logits": f if keep else None, "chunked": c if keep else None, "tokens": t}
        for (name, _, _), f, c, t in zip(cases, full, chunked, tokens)
    }
    out["_plans"] = dict(model.plan_counts)
    out["_cut"] = run_cut_cases(tp, model, cases)
    out["_kv_free"] = runner.kv_pool.available_size == runner.kv_pool.size
    return out


def parity_worker(tp: TPGroup, jobs: list[tuple[str, str, bool, list]], new_tokens: int) -> dict:
    """jobs: (arch, folder, encoder mode, cases); returns {(arch, mode): {case: results}}, each
    case decoded greedily for `new_tokens`."""
    return {(arch, mode): run_cases(tp, folder, mode, cases, new_tokens)
            for arch, folder, mode, cases in jobs}
