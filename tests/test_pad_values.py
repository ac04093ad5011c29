"""Keys that cannot collide: an item's 128-bit digest is its encoder-cache key and its pad_value
keeps 62 bits of it, so two different images that agree on the 30 bits SGLang keeps still get
different prefix-cache keys, and each request is served its own image (HF is the oracle)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import xxhash
from scheduler_harness import SchedulerHarness
from vlm_cases import Checkpoint, load_hf, noise_image, run_hf

from runtime.io_struct import TokenizedGenerateReq
from runtime.multimodal import MM_PAD_SHIFT_VALUE, Modality, MultimodalDataItem
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs
from runtime.tiny_checkpoint import make_checkpoint
from tokenizer_manager.media.types import ProcessorSpec
from tokenizer_manager.media.video_processor import VideoProcessingConfig
from tokenizer_manager.media.worker import media_digest

NEW_TOKENS = 8
DIGEST = (0x5EED << 100) | (0xABCDE << 40) | 0x2345_6789  # an arbitrary 128-bit digest
QUESTION = "What is in the picture?"


def test_pad_value_keeps_62_bits_and_fits_int64() -> None:
    low, high = MultimodalDataItem(Modality.IMAGE, hash=DIGEST), MultimodalDataItem(Modality.IMAGE)
    high.hash = DIGEST + 2**30  # the same low 30 bits
    for item in (low, high):
        item.set_pad_value()
    assert low.pad_value != high.pad_value
    assert low.pad_value - MM_PAD_SHIFT_VALUE == DIGEST % 2**62
    top = MultimodalDataItem(Modality.IMAGE, hash=2**128 - 1)
    top.set_pad_value()
    assert top.pad_value < 2**63


def test_media_digest_is_128_bits_of_xxh3() -> None:
    spec = ProcessorSpec("model", VideoProcessingConfig(), VideoProcessingConfig(), "qwen2_vl")
    digests = [media_digest(Modality.IMAGE, bytes([i]) * 9, spec) for i in range(8)]
    assert len(set(digests)) == 8
    assert max(d.bit_length() for d in digests) > 64
    expected = xxhash.xxh3_128(f"image|{spec!r}|".encode() + b"\0" * 9).digest()
    assert digests[0] == int.from_bytes(expected, "little")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("pad") / "qwen2_vl"))


def request(rid: str, case: object) -> TokenizedGenerateReq:
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return TokenizedGenerateReq(rid, list(case.input_ids), params, case.mm)


def test_items_agreeing_on_30_bits_share_no_cache_entry(folder: Path) -> None:
    """Two images of the same size in the same prompt, their digests forced to agree on the low
    30 bits: the second request reuses only the text before its image and answers as HF does."""
    ckpt = Checkpoint(folder)
    first = dataclasses.replace(ckpt.image_media(noise_image(seed=11)), digest=DIGEST)
    second = dataclasses.replace(ckpt.image_media(noise_image(seed=12)), digest=DIGEST + 2**30)
    cases = [ckpt.case(name, [m, QUESTION]) for name, m in (("a", first), ("b", second))]
    model = load_hf(folder)
    for case in cases:
        run_hf(model, case, NEW_TOKENS)
    assert cases[0].hf_tokens != cases[1].hf_tokens  # a wrong reuse would show
    args = ServerArgs(model_path=str(folder), max_total_tokens=2000, mm_cache_size_mb=64)
    with SchedulerHarness(args) as harness:
        out_a = harness.generate([request("a", cases[0])])["a"]
        out_b = harness.generate([request("b", cases[1])])["b"]
    assert out_a["tokens"] == cases[0].hf_tokens
    assert out_b["tokens"] == cases[1].hf_tokens
    (item_a,), (item_b,) = cases[0].mm.items, cases[1].mm.items
    assert out_b["cached"] <= item_b.offsets[0][0]
    assert item_a.hash != item_b.hash and item_a.pad_value != item_b.pad_value
    assert cases[0].input_ids != cases[1].input_ids  # the radix keys differ
