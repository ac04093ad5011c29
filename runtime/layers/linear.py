"""Tensor-parallel linear layers; each parameter loads its own slice of a checkpoint tensor.

Column-parallel layers split the output features over the ranks (no communication); row-parallel
layers split the input features and sum the partial products with one all-reduce.

A layer built with a one-rank group holds full weights and can still run one call tensor-parallel:
`forward(x, shard=group)` computes with `group.rank`'s slice of those weights and, for
row-parallel layers, all-reduces over `group`. This is how the vision tower in auto encoder mode
runs either way per call (vision/auto_encoder.py). The slice is copied into one contiguous
weight at its first use and kept (`_shard_weight`): a matmul over a strided column slice, or one
matmul per part of a split row slice (q, k, v), measured 7-14% slower on CPU. The copies cost
1/size of the layer's weights more memory, once per shard a layer runs; the weights must be
loaded before the first sharded call.

On a CPU, `use_onednn_linears(model)` (called once the weights are loaded and sharded) replaces
each layer's float32 or bfloat16 weight by a copy reordered once into oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`) and frees the plain one; the layers then compute with
oneDNN's matmul instead of aten's (MKL's sgemm, which takes a generic code path on AMD CPUs).
Measured per shape (docs/log/, "CPU linear layers"): 10-20% faster on prefill and
vision shapes, 20-60% on decode shapes of 4 to 16 rows; slower only on single-row calls to the
smaller layers (a few microseconds each), which cannot keep MKL without a second copy of the
weight. A packed weight is still the layer's `weight` parameter (shape, dtype and device as
before); `dense_weight` gives the plain tensor back where one is needed (a shard's slice).

`pad_hidden_features(up, down, size)` zero-pads the hidden features between a column-parallel
layer and the row-parallel layer that reads its output, once the weights are loaded, so that a
GPU's GEMMs get aligned shapes (`aligned_hidden_size`); the outputs stay exactly the same.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.distributed import TPGroup
from runtime.layers.weights import LazyWeight, as_lazy, copy_checked, divide, set_weight_loader

ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
ROW_ALIGN_BYTES = 16  # cuBLAS's TMA GEMMs on Hopper need every row to start on 16 bytes
HIDDEN_ALIGN = 64  # elements: what a padded hidden size (per rank, per shard) is a multiple of


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, through oneDNN when `weight` was packed for it."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def dense_weight(weight: torch.Tensor) -> torch.Tensor:
    """The plain (strided) tensor of a weight, packed or not."""
    return weight.to_dense() if weight.is_mkldnn else weight


def onednn_packable(weight: torch.Tensor) -> bool:
    """Whether oneDNN's matmul can take this weight: a CPU float32/bf16 matrix, oneDNN built in
    (and, for bfloat16, supported by the CPU)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in ONEDNN_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` reordered once for oneDNN's matmul (a new tensor; the caller drops the old)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def _full_weights_only(layer: nn.Module, shard: TPGroup) -> None:
    if layer.tp.size != 1:
        raise RuntimeError("a per-call shard needs a layer built with full weights (1-rank group)")
    if shard.rank >= shard.size:
        raise ValueError(f"shard rank {shard.rank} outside a group of {shard.size}")


def _shard_weight(
    layer: nn.Module, name: str, shard: TPGroup, make: Callable[[], torch.Tensor | None]
) -> torch.Tensor | None:
    """`make()` (a shard's slice of a full parameter) as one contiguous tensor, made once per
    (parameter, group size, rank) and kept on the layer (not in its state dict)."""
    cache: dict[tuple[str, int, int], torch.Tensor | None] = layer.__dict__.setdefault(
        "_shard_cache", {}
    )
    key = (name, shard.size, shard.rank)
    if key not in cache:
        made = make()
        if made is not None:
            made = made.contiguous()
            if name == "weight" and layer.weight.is_mkldnn:  # the copy computes like the layer
                made = pack_weight(made)
        cache[key] = made
    return cache[key]


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class _Linear(nn.Module):
    """What every linear layer here shares: a `weight` [out, in] that can be packed for oneDNN."""

    weight: nn.Parameter

    def pack_for_onednn(self) -> bool:
        """Swap the weight for its oneDNN-packed copy; False (unchanged) where it cannot be."""
        if self.weight.is_mkldnn or not onednn_packable(self.weight):
            return False
        self.weight = nn.Parameter(pack_weight(self.weight), requires_grad=False)
        return True


class ReplicatedLinear(_Linear):
    """A plain linear layer, identical on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **_: object):
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None
        for p in self.parameters():
            set_weight_loader(p, lambda param, w: copy_checked(param.data, as_lazy(w).load()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ColumnParallelLinear(_Linear):
    """Output features are the concatenation of `output_sizes`; each part is split over ranks.

    A merged layer (gate/up) loads part i from checkpoint tensor shard i.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        tp: TPGroup,
        bias: bool = True,
        gather_output: bool = False,
    ):
        super().__init__()
        self.tp = tp
        self.gather_output = gather_output
        self.local_sizes = [divide(n, tp.size, "output features") for n in output_sizes]
        out = sum(self.local_sizes)
        self.weight = set_weight_loader(_param(out, in_features), self.weight_loader)
        self.bias = set_weight_loader(_param(out), self.weight_loader) if bias else None

    def _shard_rows(self, shard_id: int) -> tuple[int, int, int]:
        """(offset in the local param, start in the checkpoint tensor, length)."""
        size = self.local_sizes[shard_id]
        return sum(self.local_sizes[:shard_id]), self.tp.rank * size, size

    def weight_loader(
        self, param: nn.Parameter, weight: LazyWeight | torch.Tensor, shard_id: int | None = None
    ) -> None:
        weight = as_lazy(weight)
        if shard_id is None:
            parts = weight.chunk([n * self.tp.size for n in self.local_sizes])
            for i, part in enumerate(parts):
                self.weight_loader(param, part, i)
            return
        offset, start, size = self._shard_rows(shard_id)
        copy_checked(param.data.narrow(0, offset, size), weight.narrow(0, start, size).load())

    def shard_parts(self, shard: TPGroup) -> list[tuple[int, int]]:
        """(start, length) rows of the full weight that `shard.rank` owns, one per output part."""
        parts, offset = [], 0
        for n in self.local_sizes:
            size = divide(n, shard.size, "output features")
            parts.append((offset + shard.rank * size, size))
            offset += n
        return parts

    def forward(self, x: torch.Tensor, shard: TPGroup | None = None) -> torch.Tensor:
        if shard is not None:
            return self._forward_shard(x, shard)
        out = linear(x, self.weight, self.bias)
        return self.tp.all_gather(out, dim=-1) if self.gather_output else out

    def _forward_shard(self, x: torch.Tensor, shard: TPGroup) -> torch.Tensor:
        weight, bias = self.shard_weights(shard)
        out = linear(x, weight, bias)
        return shard.all_gather(out, dim=-1) if self.gather_output else out

    def shard_weights(self, shard: TPGroup) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This shard's (weight, bias): its rows of every output part, contiguous, kept."""
        _full_weights_only(self, shard)
        parts = self.shard_parts(shard)

        def rows(full: torch.Tensor | None) -> torch.Tensor | None:
            return None if full is None else torch.cat([full.narrow(0, s, n) for s, n in parts])

        weight = _shard_weight(self, "weight", shard, lambda: rows(dense_weight(self.weight)))
        assert weight is not None
        return weight, _shard_weight(self, "bias", shard, lambda: rows(self.bias))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Gate and up projections side by side: shards 0 and 1."""


class QKVParallelLinear(ColumnParallelLinear):
    """Merged Q, K, V projection. Query heads are split over ranks; KV heads too, or replicated
    when there are fewer KV heads than ranks (rank r then keeps KV head r * kv_heads // tp)."""

    SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        tp: TPGroup,
        bias: bool = True,
    ):
        if num_heads % tp.size:
            raise ValueError(f"{num_heads} attention heads are not divisible by TP size {tp.size}")
        if num_kv_heads % tp.size and tp.size % num_kv_heads:
            raise ValueError(
                f"{num_kv_heads} KV heads and TP size {tp.size}: one must divide the other"
            )
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.total_kv_heads = num_kv_heads
        nn.Module.__init__(self)
        self.tp = tp
        self.gather_output = False
        self.local_sizes = [
            self.num_heads * head_dim,
            self.num_kv_heads * head_dim,
            self.num_kv_heads * head_dim,
        ]
        out = sum(self.local_sizes)
        self.weight = set_weight_loader(_param(out, hidden_size), self.weight_loader)
        self.bias = set_weight_loader(_param(out), self.weight_loader) if bias else None

    def _kv_head_start(self) -> int:
        if self.total_kv_heads >= self.tp.size:
            return self.tp.rank * self.num_kv_heads
        return self.tp.rank * self.total_kv_heads // self.tp.size

    def _shard_rows(self, shard_id: int) -> tuple[int, int, int]:
        size = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        if shard_id == 0:
            return offset, self.tp.rank * size, size
        return offset, self._kv_head_start() * self.head_dim, size

    def shard_parts(self, shard: TPGroup) -> list[tuple[int, int]]:
        q_full, kv_full = self.local_sizes[0], self.local_sizes[1]
        heads = divide(self.num_heads, shard.size, "attention heads")
        kv_heads = max(1, self.total_kv_heads // shard.size)
        if self.total_kv_heads >= shard.size:
            kv_start = shard.rank * kv_heads
        else:
            kv_start = shard.rank * self.total_kv_heads // shard.size
        d = self.head_dim
        q = (shard.rank * heads * d, heads * d)
        k = (q_full + kv_start * d, kv_heads * d)
        return [q, k, (k[0] + kv_full, kv_heads * d)]

    def weight_loader(
        self,
        param: nn.Parameter,
        weight: LazyWeight | torch.Tensor,
        shard_id: int | str | None = None,
    ) -> None:
        if isinstance(shard_id, str):
            shard_id = self.SHARDS[shard_id]
        if shard_id is not None:
            super().weight_loader(param, weight, shard_id)
            return
        weight = as_lazy(weight)
        full = [self.num_heads * self.tp.size * self.head_dim]
        full += [self.total_kv_heads * self.head_dim] * 2
        for i, part in enumerate(weight.chunk(full)):
            super().weight_loader(param, part, i)


class RowParallelLinear(_Linear):
    """Input features split over ranks; partial products summed by one all-reduce."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TPGroup,
        bias: bool = True,
        reduce_results: bool = True,
    ):
        super().__init__()
        self.tp = tp
        self.reduce_results = reduce_results
        self.local_in = divide(in_features, tp.size, "input features")
        self.weight = set_weight_loader(_param(out_features, self.local_in), self._load_weight)
        self.bias = set_weight_loader(_param(out_features), self._load_bias) if bias else None

    def _load_weight(self, param: nn.Parameter, weight: LazyWeight | torch.Tensor) -> None:
        start = self.tp.rank * self.local_in
        copy_checked(param.data, as_lazy(weight).narrow(1, start, self.local_in).load())

    def _load_bias(self, param: nn.Parameter, weight: LazyWeight | torch.Tensor) -> None:
        copy_checked(param.data, as_lazy(weight).load())

    def shard_weights(self, shard: TPGroup) -> torch.Tensor:
        """This shard's weight: its columns (input features), contiguous, kept."""
        _full_weights_only(self, shard)
        local = divide(self.weight.shape[1], shard.size, "input features")
        weight = _shard_weight(
            self,
            "weight",
            shard,
            lambda: dense_weight(self.weight).narrow(1, shard.rank * local, local),
        )
        assert weight is not None
        return weight

    def forward(self, x: torch.Tensor, shard: TPGroup | None = None) -> torch.Tensor:
        if shard is None:
            out = linear(x, self.weight, None)
            group = self.tp
        else:
            out = linear(x, self.shard_weights(shard), None)
            group = shard
        if self.reduce_results:
            out = group.all_reduce(out)
        return out + self.bias if self.bias is not None else out


def aligned_hidden_size(size: int, itemsize: int, shard_size: int = 1) -> int:
    """The hidden size (one rank's) that a column -> row-parallel pair should compute with:
    `size` itself where it and its 1/`shard_size` slices (a per-call shard's) are rows of whole
    16-byte units, else `size` rounded up to 64 * `shard_size` elements. Pure.

    Qwen2.5-VL-7B's tower MLP (3420 in bfloat16: 6840-byte rows) gets 3456, or 3584 for shards
    of 4 or 8. Qwen3-VL-8B's (4304: 8608-byte rows) keeps its size at tp 1 and 2: on an H200 its
    MLP measured 11% slower padded to 4352 at 16k rows (2% faster at 4k)."""
    if size % shard_size == 0 and size // shard_size * itemsize % ROW_ALIGN_BYTES == 0:
        return size
    step = HIDDEN_ALIGN * shard_size
    return -(-size // step) * step


@torch.no_grad()
def pad_hidden_features(up: ColumnParallelLinear, down: RowParallelLinear, size: int) -> None:
    """Zero-pad the hidden features between `up` and the `down` that reads its output to `size`
    on this rank: zero rows (weight and bias) at the end of each of up's output parts, zero
    columns at the end of down's input features (down's bias unchanged). Exact: whatever the
    extra features hold (act(0) * 0 = 0 for a gated pair), down's zero columns add nothing.

    Call it once the weights are loaded (the loaders expect the checkpoint's sizes) and before
    they are packed for oneDNN. On a full-weight layer every `shard=` slice stays consistent:
    each part's padded rows and down's padded columns split over a shard group alike."""
    hidden = down.local_in
    if isinstance(up, QKVParallelLinear) or any(n != hidden for n in up.local_sizes):
        raise ValueError(f"output parts {up.local_sizes} are not the {hidden} hidden features")
    if size < hidden or up.gather_output:
        raise ValueError(f"cannot pad {hidden} hidden features to {size}")
    if up.weight.is_mkldnn or down.weight.is_mkldnn:
        raise RuntimeError("pad the hidden features before packing the weights for oneDNN")
    up.weight = _padded_parts(up.weight, up.local_sizes, size)
    if up.bias is not None:
        up.bias = _padded_parts(up.bias, up.local_sizes, size)
    down.weight = nn.Parameter(F.pad(down.weight, (0, size - hidden)), requires_grad=False)
    up.local_sizes = [size] * len(up.local_sizes)
    down.local_in = size
    for layer in (up, down):  # shard copies made before were cut from the unpadded weights
        layer.__dict__.pop("_shard_cache", None)


def _padded_parts(full: torch.Tensor, sizes: list[int], size: int) -> nn.Parameter:
    """`full` with zero rows appended to each of its consecutive parts (dim 0) up to `size`."""
    pieces = []
    for part in full.split(sizes):
        pieces += [part, part.new_zeros(size - len(part), *part.shape[1:])]
    return nn.Parameter(torch.cat(pieces), requires_grad=False)


def prepare_shard_weights(module: nn.Module, shard: TPGroup) -> None:
    """Make every full-weight parallel layer's copy for `shard` now (at start-up, so that a
    device's memory plan sees them), not at the first sharded call."""
    for layer in module.modules():
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)) and layer.tp.size == 1:
            layer.shard_weights(shard)


def use_onednn_linears(module: nn.Module) -> int:
    """Pack every linear layer's weight in `module` for oneDNN where it can be (CPU, float32 or
    bfloat16), once the weights are loaded and sharded, an untied LM head's included
    (runtime/layers/embedding.py); returns how many were packed."""
    layers = [m for m in module.modules() if callable(getattr(m, "pack_for_onednn", None))]
    return sum(layer.pack_for_onednn() for layer in layers)
