"""One request's fault fails that request alone, on every TP rank alike (issue 10).

Real scheduler ranks at tp 2 with the DP encoder, a small KV pool and chunked prefill, and the
suite's fault injector (tests/fault_injection.py, handed to each rank through the test seam of
scheduler/input_checks.py): the last rank's input check fails some requests (before
their prefill or in the middle of their decode). Rank 0 must report those as errors from rank 1,
finish the rest correctly, and free everything: the ranks agreed, or the next collective would
hang."""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fault_injection import FaultInjector, InjectorFactory
from scheduler_harness import SchedulerHarness
from vlm_cases import Checkpoint, gradient_image, noise_image

from runtime.distributed import TPGroup
from runtime.io_struct import TokenizedGenerateReq
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs
from runtime.tiny_checkpoint import make_checkpoint
from scheduler.input_checks import check_item
from scheduler.process import build_scheduler, load_model

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list]:
    folder = make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("faults") / "qwen2_vl")
    ckpt = Checkpoint(Path(folder))
    cases = [
        ckpt.case("text", ["Tell me something."]),
        ckpt.case("image", [noise_image(), "What is this?"]),
        ckpt.case("big_image", [noise_image((168, 168), seed=3), "Describe it."]),
        ckpt.case("two_images", [gradient_image(), noise_image(), "Compare."]),
    ]
    return str(folder), cases


def request(case: object, rid: str) -> TokenizedGenerateReq:
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return TokenizedGenerateReq(rid, list(case.input_ids), params, case.mm)


@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed"])
def test_injected_faults_fail_their_requests_only_at_tp2(
    prompts: tuple[str, list], mixed: bool
) -> None:
    folder, cases = prompts
    args = ServerArgs(
        model_path=folder,
        tp_size=2,
        mm_encoder_mode="dp",
        chunked_prefill_size=64,
        max_total_tokens=600,
        random_seed=1,
        enable_mixed_chunk=mixed,
    )
    reqs = [request(c, f"{c.name}-{k}") for k in range(6) for c in cases]
    with SchedulerHarness(args, faults=InjectorFactory(0.03, seed=1)) as h:
        results = h.generate(reqs)
        info = h.info()
        assert all(p.is_alive() for p in h.procs)
    failed = {rid for rid, r in results.items() if r["finish"]["type"] == "error"}
    assert failed and len(failed) < len(reqs)
    for rid in failed:
        assert results[rid]["finish"]["detail"].startswith("request fault on TP rank 1")
        assert results[rid]["finish"]["status"] == 500
    assert any(results[rid]["tokens"] for rid in failed), "no fault hit a decoding request"
    for case in cases:
        done = [
            r["tokens"]
            for rid, r in results.items()
            if rid.rsplit("-", 1)[0] == case.name and rid not in failed
        ]
        assert all(t == done[0] and len(t) == NEW_TOKENS for t in done)
    assert info.counters.failed == len(failed) == info.counters.faults_injected
    assert info.running == info.waiting == 0
    assert info.kv_free + info.kv_evictable == info.kv_total and info.kv_protected == 0
    assert info.encoder_cache.pins == 0
    assert (info.counters.mixed_steps > 0) == mixed


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, None])
def test_media_features_must_be_finite(bad: float | None) -> None:
    """The input check refuses a feature holding NaN or either infinity, anywhere in it."""
    feature = torch.randn(6, 4)
    if bad is not None:
        feature[4, 1] = bad
    item = SimpleNamespace(offsets=[(1, 3)], pad_value=7, feature=feature, num_patches=6,
                           embedded=False)
    prompt = [0, 7, 7, 0]
    if bad is None:
        check_item(item, prompt)
        return
    with pytest.raises(ValueError, match="NaN or inf"):
        check_item(item, prompt)


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        ([(1, 3)], None),
        ([(0, 2)], "pad value"),
        ([(1, 3), (2, 5)], "outside"),
        ([(3, 3)], "outside"),
    ],
)
def test_media_placeholders_must_hold_the_items_pad_value(
    offsets: list[tuple[int, int]], message: str | None
) -> None:
    """Each placeholder run lies inside the prompt, non-empty, and every token of it is the
    item's pad value."""
    item = SimpleNamespace(offsets=offsets, pad_value=7, feature=None, num_patches=2,
                           embedded=False)
    prompt = [0, 7, 7, 0]
    if message is None:
        check_item(item, prompt)
        return
    with pytest.raises(ValueError, match=message):
        check_item(item, prompt)


def test_the_test_seam_installs_faults_only_when_passed(prompts: tuple[str, list]) -> None:
    """Without a factory (production) a rank has no faults; with one, every rank builds its own
    injector from it and only the last rank raises; a factory crosses to the ranks pickled, and
    an impossible rate is refused loudly rather than ignored."""
    folder, _ = prompts
    args = ServerArgs(model_path=folder, device="cpu", attention_backend="torch")
    model = load_model(args, TPGroup())
    assert build_scheduler(args, TPGroup(), model).faults is None
    factory = InjectorFactory(0.5, seed=7)
    assert build_scheduler(args, TPGroup(), model, faults=factory).faults == FaultInjector(
        0.5, 7, True
    )
    ranks = [pickle.loads(pickle.dumps(factory))(rank, 2) for rank in range(2)]
    assert ranks == [FaultInjector(0.5, 7, False), FaultInjector(0.5, 7, True)]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        InjectorFactory(1.5, seed=0)
