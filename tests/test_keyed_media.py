"""Items sent by key only (no pixels) to scheduler ranks at tp 2 with the DP encoder: an item the
ranks' encoder caches hold runs without its pixels; an item they lost (a flush stands for an
eviction after the front end decided) makes the request wait while rank 0 asks for the pixels,
and it then completes as HF does; an item sent `awaiting` (--encoder-urls) lets both ranks
prefill the text before it and park the request until its `ItemEmbeddings` come; nothing stays
held or pinned."""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from scheduler_harness import SchedulerHarness
from vlm_cases import Case, Checkpoint, load_hf, noise_image, run_hf
from waits import wait_until

from runtime.io_struct import (
    BatchTokenOut,
    FlushCacheOut,
    FlushCacheReq,
    ItemEmbeddings,
    PixelsWanted,
    TokenizedGenerateReq,
)
from runtime.multimodal import Modality, MultimodalDataItem, MultimodalInputs
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs
from runtime.tiny_checkpoint import make_checkpoint
from runtime.transport.shm import SharedTensor, new_media_path
from scheduler.req import Req
from tokenizer_manager.media.pixel_ledger import PixelLedger

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    folder = make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("keyed") / "qwen2_vl")
    ckpt = Checkpoint(Path(folder))
    found = {
        "first": ckpt.case("first", [noise_image(), "What is this?"]),
        # the same image after other text: the radix cache cannot cover it, the encoder cache can
        "other": ckpt.case("other", ["Look closely.", noise_image(), "Describe the colors."]),
        "awaited": ckpt.case("awaited", ["Read all of this first.", noise_image(seed=7), "Go."]),
    }
    model = load_hf(Path(folder))
    for case in found.values():
        run_hf(model, case, NEW_TOKENS)
    return found | {"folder": str(folder)}


@pytest.fixture(scope="module")
def harness(cases: dict) -> Iterator[SchedulerHarness]:
    args = ServerArgs(
        model_path=cases["folder"], tp_size=2, mm_encoder_mode="dp", mm_cache_size_mb=16
    )
    with SchedulerHarness(args) as h:
        yield h


def request(case: Case, rid: str, keyed: bool) -> TokenizedGenerateReq:
    """The case's request; `keyed`: its items carry their hash only, as the front end sends an
    item whose pixels it has sent before."""
    mm = copy.deepcopy(case.mm)
    for item in mm.items if keyed else []:
        item.feature = None
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return TokenizedGenerateReq(rid, list(case.input_ids), params, mm)


def pixels_of(case: Case) -> dict[int, object]:
    return {item.hash: item.feature for item in case.mm.items}


def asked(h: SchedulerHarness) -> list[PixelsWanted]:
    found = [m for m in h.pending if isinstance(m, PixelsWanted)]
    h.pending.clear()
    return found


def test_an_item_the_ranks_hold_runs_without_its_pixels(harness: SchedulerHarness, cases: dict):
    first, other = cases["first"], cases["other"]
    out = harness.generate([request(first, "a", keyed=False)])
    assert out["a"]["tokens"] == first.hf_tokens
    before = harness.info()
    out = harness.generate([request(other, "b", keyed=True)])  # nothing to answer with
    after = harness.info()
    assert out["b"]["tokens"] == other.hf_tokens
    assert asked(harness) == []
    assert after.counters.pixels_wanted == before.counters.pixels_wanted
    assert after.encoder_cache.hits == before.encoder_cache.hits + 1
    assert after.encoder_cache.misses == before.encoder_cache.misses


def test_an_item_the_ranks_lost_is_asked_for_and_the_request_completes(
    harness: SchedulerHarness, cases: dict
) -> None:
    assert harness.request(FlushCacheReq(), FlushCacheOut).success  # the ranks lose the item
    asked(harness)
    first, other = cases["first"], cases["other"]
    out = harness.generate([request(first, "c", keyed=True)], pixels=pixels_of(first))
    assert out["c"]["tokens"] == first.hf_tokens and out["c"]["finish"]["type"] == "length"
    questions = asked(harness)
    assert [(q.rid, q.hashes) for q in questions] == [("c", [first.mm.items[0].hash])]
    # the pixels it got were encoded and cached: the next keyed request needs none
    out = harness.generate([request(other, "d", keyed=True)])
    assert out["d"]["tokens"] == other.hf_tokens
    assert asked(harness) == []
    assert harness.info().counters.pixels_wanted == 1


def test_an_awaited_item_parks_its_request_on_both_ranks_until_it_comes(
    harness: SchedulerHarness, cases: dict
) -> None:
    """Both ranks take the same decisions: the text before the image prefills, the request
    parks (no output, nothing encoded) until the message with the item comes (here its pixels,
    as with --encoder-fallback local), then it completes as HF does."""
    case = cases["awaited"]
    msg = request(case, "g", keyed=True)
    for item in msg.mm_inputs.items:
        item.awaiting = True
    before = harness.info()
    harness.send(msg)
    assert wait_until(lambda: harness.info().counters.parked == before.counters.parked + 1)
    info = harness.info()
    assert info.running == 1 and info.encoder_cache.misses == before.encoder_cache.misses
    assert info.counters.prompt_tokens_computed > before.counters.prompt_tokens_computed
    harness.pending.clear()
    harness.send(ItemEmbeddings("g", pixels_of(case), embedded=False))
    tokens = finish = None
    while finish is None:
        batch = harness.recv(120)
        for o in batch.outputs if isinstance(batch, BatchTokenOut) else []:
            tokens, finish = [*(tokens or []), *o.new_token_ids], o.finish_reason
    assert tokens == case.hf_tokens and finish.kind.value == "length"


def test_with_an_encoder_cache_too_small_for_the_item_every_keyed_request_asks(
    cases: dict,
) -> None:
    """An encoder cache that stores nothing (the tiniest there is): the front end's guess is
    always wrong, and every keyed request still completes as HF's, after one question each."""
    first, other = cases["first"], cases["other"]
    args = ServerArgs(
        model_path=cases["folder"], tp_size=2, mm_encoder_mode="dp", mm_cache_size_mb=0
    )
    with SchedulerHarness(args) as h:
        for rid, case in (("e", first), ("f", other)):
            out = h.generate([request(case, rid, keyed=True)], pixels=pixels_of(first))
            assert out[rid]["tokens"] == case.hf_tokens
        assert [q.rid for q in asked(h)] == ["e", "f"]
        info = h.info()
    assert info.counters.pixels_wanted == 2 and info.encoder_cache.entries == 0
    assert info.encoder_cache.pins == 0 and info.kv_free + info.kv_evictable == info.kv_total


def test_nothing_is_held_once_idle(harness: SchedulerHarness) -> None:
    info = harness.info()
    assert info.running == info.waiting == 0
    assert info.kv_free + info.kv_evictable == info.kv_total and info.kv_protected == 0
    assert info.encoder_cache.pins == 0 and info.req_slots_used == 0


def test_keyed_items_are_read_from_the_cache_or_their_pixels() -> None:
    """`Req.keyed_items`: only featureless items whose run ends past the start count."""
    items = [
        MultimodalDataItem(Modality.IMAGE, None, hash=1, offsets=[(2, 6)]),
        MultimodalDataItem(Modality.IMAGE, None, hash=2, offsets=[(8, 12)]),
        dataclasses.replace(
            MultimodalDataItem(Modality.IMAGE, None, hash=3, offsets=[(12, 14)]), feature=1
        ),
    ]
    req = Req(list(range(16)), MultimodalInputs(items, mrope_positions=None))
    assert req.keyed_items(0) == {1, 2} and req.keyed_items(6) == {2}
    assert req.keyed_items(12) == frozenset()


def ledger_request(*hashes: int) -> MultimodalInputs:
    items = [
        MultimodalDataItem(Modality.IMAGE, torch.full((4, 3), float(h)), hash=h, offsets=[(0, 1)])
        for h in hashes
    ]
    return MultimodalInputs(items, mrope_positions=torch.zeros(3, 1))


def test_the_ledger_sends_pixels_once_and_keeps_them_for_the_request(tmp_path: Path) -> None:
    ledger = PixelLedger(enabled=True, shm_dir=str(tmp_path))
    first = ledger_request(1, 1)  # an image twice in a new request: pixels with both
    ledger.hold("r1", first)
    assert all(item.feature is not None for item in first.items)
    assert ledger.info()["pixel_bytes_sent"] == 2 * 48
    second = ledger_request(1, 2)
    ledger.hold("r2", second)
    assert [item.feature is None for item in second.items] == [True, False]
    answer = ledger.answer("r2", [1])
    assert answer.rid == "r2" and torch.equal(answer.features[1], torch.full((4, 3), 1.0))
    assert ledger.info() == {
        "pixel_bytes_sent": 4 * 48, "items_sent_by_key": 1, "items_asked_again": 1,
        "requests_holding_pixels": 1,
    }  # fmt: skip
    ledger.release("r2")
    assert ledger.answer("r2", [1]) is None and ledger.info()["requests_holding_pixels"] == 0


def test_a_held_shared_file_is_answered_with_a_new_name_and_removed_at_the_end(
    tmp_path: Path,
) -> None:
    ledger = PixelLedger(enabled=True, shm_dir=str(tmp_path))
    ledger.hold("r1", ledger_request(5))
    mm = ledger_request(5)
    held = SharedTensor.write(mm.items[0].feature.numpy(), new_media_path(str(tmp_path)))
    mm.items[0].feature = SharedTensor(held.path, held.shape, held.dtype)  # the request's own
    ledger.hold("r2", mm)
    sent = ledger.answer("r2", [5]).features[5]
    assert sent.path != held.path and torch.equal(sent.load(), torch.full((4, 3), 5.0))
    sent.hand_off()  # as `_send` does: the ranks remove it once read
    ledger.release("r2")
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(sent.path)]


def test_without_an_encoder_cache_every_item_carries_its_pixels() -> None:
    ledger = PixelLedger(enabled=False, shm_dir=None)
    for rid in ("a", "b"):
        mm = ledger_request(7)
        ledger.hold(rid, mm)
        assert mm.items[0].feature is not None
    assert ledger.info()["items_sent_by_key"] == 0
