"""scheduler/batch.py: one prefill step as one object, filtered by request identity."""

from __future__ import annotations

from scheduler.batch import PrefillBatch
from scheduler.req import Req


def test_keep_filters_by_identity_and_keeps_each_chunk_with_its_length() -> None:
    a, twin, c = Req([1, 2, 3]), Req([1, 2, 3]), Req([4, 5])  # a and twin: equal fields
    d = Req([6, 7], kv_len=1)
    batch = PrefillBatch([a, twin, c], [3, 2, 1], [d])
    kept = batch.keep([c, d, twin])
    assert kept.reqs == [twin, c] and kept.reqs[0] is twin and kept.lens == [2, 1]
    assert kept.decodes == [d] and kept.new_tokens == 2 + 1 + 1
    assert not batch.keep([d]) and batch.keep([d]).decodes == [d]


def test_after_the_forward_the_finished_prompts_and_the_decodes_sample() -> None:
    done, cut, decoding = Req([1, 2, 3], kv_len=3), Req([4, 5, 6], kv_len=2), Req([7, 8], kv_len=1)
    batch = PrefillBatch([cut, done], [2, 3], [decoding])
    reqs, rows = batch.sampled()
    assert reqs == [done, decoding] and rows == [1, 2]  # logits rows: chunks, then decodes
    assert batch.prompts_done() == [done] and batch.cut() == [cut]
    assert batch.everyone == [cut, done, decoding]
