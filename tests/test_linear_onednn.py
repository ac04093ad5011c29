"""CPU linear layers with weights packed once for oneDNN's matmul (runtime/layers/linear.py):
the same results as aten's path, one copy of each weight, shard copies from packed weights,
and build_model's switch."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from numerics import assert_within_rounding, kernel_bound, vision_terms
from torch import nn

from runtime.distributed import TPGroup
from runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runtime.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    dense_weight,
    onednn_packable,
    prepare_shard_weights,
    use_onednn_linears,
)
from runtime.server_args import ServerArgs
from runtime.tiny_checkpoint import make_checkpoint
from scheduler.process import load_model
from vision.vit_common import VisionPatchEmbed
from vision.vlm import build_model

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


def assert_same_sums(actual: torch.Tensor, expected: torch.Tensor, in_features: int) -> None:
    """Both paths sum the same float32 products (plus the bias) in their own blocked orders."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if expected.numel():
        assert_within_rounding(actual, expected, in_features + 1)


class SumGroup(TPGroup):
    """A shard's rank/size whose collectives are the identity (each rank's partial result)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _filled(layer: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen))
    return layer


def _layers() -> list[nn.Module]:
    return [
        _filled(ReplicatedLinear(24, 40, bias=True)),
        _filled(ColumnParallelLinear(24, [16, 16], TPGroup(), bias=False)),
        _filled(QKVParallelLinear(32, 8, 4, 2, TPGroup(), bias=True)),
        _filled(RowParallelLinear(48, 24, TPGroup(), bias=True)),
    ]


def _twins(layer: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(plain, packed) copies of one layer with the same weights."""
    packed = copy.deepcopy(layer)
    assert use_onednn_linears(packed) == 1
    return layer, packed


@pytest.mark.parametrize("rows", [(0,), (1,), (4,), (17,), (3, 5)])
def test_packed_layers_compute_what_plain_ones_do(rows: tuple[int, ...]) -> None:
    for plain, packed in map(_twins, _layers()):
        x = torch.randn(*rows, plain.weight.shape[1])
        with torch.inference_mode():
            assert_same_sums(packed(x), plain(x), x.shape[-1])


def test_a_packed_layer_holds_one_copy_of_its_weight() -> None:
    for plain, packed in map(_twins, _layers()):
        weights = [p for p in packed.parameters() if p.dim() == 2]
        assert len(weights) == 1 and weights[0] is packed.weight and packed.weight.is_mkldnn
        assert packed.weight.shape == plain.weight.shape
        assert packed.weight.dtype == torch.float32 and packed.weight.device.type == "cpu"
        assert torch.equal(dense_weight(packed.weight), plain.weight)
        if plain.bias is not None:
            assert not packed.bias.is_mkldnn and torch.equal(packed.bias, plain.bias)
        assert use_onednn_linears(packed) == 0  # packing twice does nothing


def test_a_strided_input_gives_the_same_result() -> None:
    plain, packed = _twins(_layers()[0])
    x = torch.randn(24, 9).t()  # 9 rows, not contiguous
    assert_same_sums(packed(x), plain(x), 24)


def test_shards_of_a_packed_full_weight_layer_match_the_plain_layer() -> None:
    """Auto encoder mode: a full-weight layer runs one call as a shard; its shard copy is made
    from the packed weight and packed itself, and computes what the plain layer's shard does."""
    qkv_plain, qkv = _twins(_layers()[2])
    row_plain, row = _twins(_layers()[3])
    x, h = torch.randn(5, 32), torch.randn(5, 24)
    for rank in range(2):
        shard = SumGroup(rank=rank, size=2)
        assert_same_sums(qkv(x, shard), qkv_plain(x, shard), 32)
        assert_same_sums(row(h, shard), row_plain(h, shard), 12)
        assert qkv._shard_cache["weight", 2, rank].is_mkldnn
        assert not qkv._shard_cache["bias", 2, rank].is_mkldnn
    prepare_shard_weights(row, SumGroup(rank=1, size=2))  # made already: kept, not remade
    assert row._shard_cache["weight", 2, 1].is_mkldnn


def test_patch_embedding_of_row_blocks_with_a_packed_weight() -> None:
    plain = _filled(VisionPatchEmbed(30, 12, bias=True))
    packed = copy.deepcopy(plain)
    assert use_onednn_linears(packed) == 1
    blocks = [torch.randn(4, 30), torch.randn(0, 30), torch.randn(7, 30)]
    assert_same_sums(packed(blocks), plain(blocks), 30)
    assert_same_sums(packed(torch.cat(blocks)), plain(blocks), 30)


def test_bfloat16_weights_are_packed_where_the_cpu_supports_them() -> None:
    layer = _filled(ReplicatedLinear(64, 32)).to(torch.bfloat16)
    if not onednn_packable(layer.weight):
        pytest.skip("this CPU has no oneDNN bfloat16 matmul")
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    want = layer(x)
    assert use_onednn_linears(layer) == 1 and layer.weight.dtype == torch.bfloat16
    got, want = layer(x).float(), want.float()  # both: float32 sums, outputs rounded to bf16
    assert (got - want).norm() <= kernel_bound(torch.bfloat16, 65, 2) * want.norm()


def test_an_untied_lm_head_is_packed_and_a_tied_one_is_not() -> None:
    """The untied head computes its logits through oneDNN, as aten's path does; a head tied to
    the embedding keeps sharing the plain weight the lookup reads."""
    head = _filled(ParallelLMHead(300, 24, TPGroup()))
    plain = copy.deepcopy(head)
    assert use_onednn_linears(head) == 1 and head.weight.is_mkldnn
    for rows in (1, 5):
        x = torch.randn(rows, 24)
        assert_same_sums(head(x), plain(x), 24)
    embedding = _filled(VocabParallelEmbedding(300, 24, TPGroup()))
    tied = ParallelLMHead(300, 24, TPGroup())
    tied.tie_to(embedding)
    assert use_onednn_linears(nn.ModuleList([embedding, tied])) == 0
    assert tied.weight is embedding.weight and not embedding.weight.is_mkldnn


def test_only_cpu_float_matrices_are_packable() -> None:
    assert onednn_packable(torch.zeros(4, 4))
    assert not onednn_packable(torch.zeros(4, 4, dtype=torch.float64))
    assert not onednn_packable(torch.zeros(4))
    assert not onednn_packable(torch.zeros(4, 4, device="meta"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("onednn") / "ck")


def _linears(model: nn.Module) -> list[nn.Module]:
    types = (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear)
    return [m for m in model.modules() if isinstance(m, types)]


def test_build_model_packs_every_cpu_linear_layer_unless_told_not_to(folder: Path) -> None:
    packed = build_model(str(folder), TPGroup(), dtype="float32")
    plain = build_model(str(folder), TPGroup(), dtype="float32", cpu_linear="aten")
    assert _linears(packed) and all(m.weight.is_mkldnn for m in _linears(packed))
    assert not any(m.weight.is_mkldnn for m in _linears(plain))
    grid, cfg = torch.tensor([[1, 4, 6]]), packed.config.vision
    pixels = torch.randn(24, cfg.patch_dim)
    with torch.inference_mode():
        want = plain.visual([pixels], grid)
        assert_within_rounding(packed.visual([pixels], grid), want, vision_terms(cfg, 24))
    with pytest.raises(ValueError, match="cpu_linear"):
        build_model(str(folder), TPGroup(), dtype="float32", cpu_linear="mkl")


def test_the_server_flag_selects_the_path(folder: Path) -> None:
    """--cpu-linear reaches the scheduler's model (honoured, not accepted and ignored)."""
    assert ServerArgs.from_cli([]).cpu_linear == "onednn"
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--cpu-linear", "mkl"])
    for flag, packed in (("onednn", True), ("aten", False)):
        args = ServerArgs.from_cli(["--model-path", str(folder), "--device", "cpu",
                                    "--dtype", "float32", "--cpu-linear", flag])
        model = load_model(args, TPGroup())
        assert {m.weight.is_mkldnn for m in _linears(model)} == {packed}
