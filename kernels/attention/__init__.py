"""Attention backends over tessera's token-indexed KV pool.

A backend is chosen once at start-up by name and imported lazily, so CPU machines never import
GPU-only packages.
"""

from __future__ import annotations

from kernels.attention.base import AttentionBackend, AttentionLayer


def create_attention_backend(name: str) -> AttentionBackend:
    if name in ("torch", "auto"):
        from kernels.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from kernels.triton.attention import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "flashinfer":
        from kernels.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = ["AttentionBackend", "AttentionLayer", "create_attention_backend"]
