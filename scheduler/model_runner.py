"""The TP worker: owns this rank's model shard and KV pools, turns sequences into ForwardBatches.

Every rank builds the same batches from the same decisions, so each rank's collectives line up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runtime.forward_batch import ForwardBatch, ForwardMode
from runtime.memory_pool import KVPool, ReqToTokenPool
from runtime.multimodal import MultimodalInputs


class OutOfKVError(RuntimeError):
    """Not enough free KV slots for the requested forward."""


@dataclass(eq=False)
class Sequence:
    """What the runner needs of one request: its tokens so far and how many sit in the KV pool.

    Identity semantics (eq=False): two requests are the same only if they are the same object, so
    `in`, `remove` and `index` over lists of them never compare fields (tensors among them)."""

    token_ids: list[int]
    mm: MultimodalInputs | None = None
    req_pool_index: int = -1
    kv_len: int = 0

    def positions(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] MRoPE positions for sequence indices [start, end)."""
        prompt_len = 0 if self.mm is None else self.mm.mrope_positions.shape[1]
        delta = 0 if self.mm is None else self.mm.mrope_position_delta
        parts = []
        if start < prompt_len:
            parts.append(self.mm.mrope_positions[:, start : min(end, prompt_len)])
        if end > max(start, prompt_len):
            tail = torch.arange(max(start, prompt_len), end, dtype=torch.long) + delta
            parts.append(tail.expand(3, -1))
        return torch.cat(parts, dim=1)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        *,
        max_total_tokens: int,
        max_running_requests: int,
        max_context_len: int,
        device: str = "cpu",
    ):
        self.model = model
        self.device = device
        text = model.config.text
        local_kv_heads = model.language_model.model.layers[0].self_attn.layer.num_kv_heads
        dtype = next(model.language_model.parameters()).dtype
        self.req_pool = ReqToTokenPool(max_running_requests, max_context_len, device)
        self.kv_pool = KVPool(
            max_total_tokens, text.num_hidden_layers, local_kv_heads, text.head_dim, dtype, device
        )

    def admit(self, seq: Sequence) -> None:
        index = self.req_pool.alloc()
        if index is None:
            raise OutOfKVError("no free request slot")
        seq.req_pool_index = index

    def release(self, seq: Sequence) -> None:
        """Free every KV slot and the request slot the sequence holds."""
        if seq.req_pool_index < 0:
            return
        self.kv_pool.free(self.req_pool.req_to_token[seq.req_pool_index, : seq.kv_len].cpu())
        self.req_pool.free(seq.req_pool_index)
        seq.req_pool_index, seq.kv_len = -1, 0

    def _alloc(self, n: int) -> torch.Tensor:
        slots = self.kv_pool.alloc(n)
        if slots is None:
            raise OutOfKVError(f"need {n} KV slots, {self.kv_pool.available_size} free")
        return slots

    def extend(
        self, seqs: list[Sequence], extend_lens: list[int], return_all_logits: bool = False
    ) -> torch.Tensor:
        """Prefill the next extend_lens[i] tokens of each sequence over what its KV holds."""
        return self._run(ForwardMode.EXTEND, seqs, extend_lens, return_all_logits)

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One step: each sequence's last token (not yet in KV) goes through the model."""
        return self._run(ForwardMode.DECODE, seqs, [1] * len(seqs), False)

    def mixed(
        self, seqs: list[Sequence], extend_lens: list[int], decodes: list[Sequence]
    ) -> torch.Tensor:
        """One forward for an extend of `seqs` plus one decode token of each of `decodes`;
        returns the last-token logits of seqs, then of decodes."""
        lens = [*extend_lens, *[1] * len(decodes)]
        return self._run(ForwardMode.EXTEND, [*seqs, *decodes], lens, False, len(decodes))

    def _run(
        self,
        mode: ForwardMode,
        seqs: list[Sequence],
        lens: list[int],
        all_logits: bool,
        decode_tail: int = 0,
    ) -> torch.Tensor:
        slots = self._alloc(sum(lens))
        ids, positions, offset = [], [], 0
        for seq, n in zip(seqs, lens):
            start = seq.kv_len
            self.req_pool.write(seq.req_pool_index, start, slots[offset : offset + n])
            ids.extend(seq.token_ids[start : start + n])
            positions.append(seq.positions(start, start + n))
            offset += n
        batch = ForwardBatch(
            mode=mode,
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.cat(positions, dim=1).to(self.device),
            out_cache_loc=slots.to(self.device),
            req_pool_indices_list=[s.req_pool_index for s in seqs],
            prefix_lens_list=[s.kv_len for s in seqs],
            extend_lens_list=list(lens),
            req_pool=self.req_pool,
            kv_pool=self.kv_pool,
            mm_inputs=[s.mm for s in seqs],
            return_all_logits=all_logits,
            decode_tail=decode_tail,
        )
        logits = self.model(batch)
        for seq, n in zip(seqs, lens):
            seq.kv_len += n
        return logits


def greedy_generate(
    runner: ModelRunner, seq: Sequence, max_new_tokens: int, chunk_size: int | None = None
) -> list[int]:
    """Prefill (optionally in chunks), then decode greedily; frees the sequence at the end."""
    runner.admit(seq)
    try:
        prompt_len = len(seq.token_ids)
        step = chunk_size or prompt_len
        while seq.kv_len < prompt_len:
            logits = runner.extend([seq], [min(step, prompt_len - seq.kv_len)])
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(logits[-1].argmax())
            out.append(token)
            seq.token_ids.append(token)
            if len(out) < max_new_tokens:
                logits = runner.decode([seq])
        return out
    finally:
        runner.release(seq)
