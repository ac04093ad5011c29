"""Reference attention in plain torch: one request at a time, causal over prefix + extend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels.attention.base import AttentionLayer

if TYPE_CHECKING:
    from runtime.forward_batch import ForwardBatch


class TorchAttentionBackend:
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        kv = batch.kv_pool
        kv.set_kv(
            layer.layer_id,
            batch.out_cache_loc,
            k.view(-1, layer.num_kv_heads, layer.head_dim),
            v.view(-1, layer.num_kv_heads, layer.head_dim),
        )
        q = q.view(-1, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        start = 0
        for i, (seq_len, ext_len) in enumerate(zip(batch.seq_lens_list, batch.extend_lens_list)):
            slots = batch.req_to_token[batch.req_pool_indices_list[i], :seq_len]
            k_all, v_all = kv.get_kv(layer.layer_id, slots)
            out[start : start + ext_len] = _attend(q[start : start + ext_len], k_all, v_all, layer)
            start += ext_len
        return out.view(-1, layer.num_heads * layer.head_dim)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer
) -> torch.Tensor:
    """q: [n, H, D] are the last n of the k/v rows [s, Hkv, D]; causal."""
    n, s = q.shape[0], k.shape[0]
    group = layer.num_heads // layer.num_kv_heads
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    q_pos = torch.arange(s - n, s, device=q.device)[:, None]
    mask = q_pos >= torch.arange(s, device=q.device)[None, :]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.float(), v.float(), attn_mask=mask, scale=layer.scaling
    )
    return out.transpose(0, 1).to(q.dtype)
