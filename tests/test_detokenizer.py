"""The detokenizer: UTF-8 safe incremental decoding, stop strings, the manager, the process."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import zmq
from transformers import AutoTokenizer
from transformers import PreTrainedTokenizerBase as Tokenizer

from runtime import detokenizer
from runtime.detokenizer import (
    MAX_HELD_TOKENS,
    DetokenizerManager,
    IncrementalDetokenizer,
    StopMatcher,
    run_detokenizer_process,
)
from runtime.io_struct import (
    BatchStrOut,
    BatchTokenOut,
    Finish,
    FinishKind,
    FlushCacheOut,
    FlushCacheReq,
    ForgetReqs,
    PrefixCut,
    ReadyReport,
    ReqOutput,
    ReqStart,
    ServerInfo,
    ShutdownReq,
    StageTimes,
    UnknownMessage,
)
from runtime.sampling_params import TokenLogprobs
from runtime.server_args import ServerArgs
from runtime.tiny_checkpoint import build_tokenizer, save_tokenizer

TEXT = "héllo wörld 你好 🙂 The robot counted: one, two, three."
LENGTH = Finish(FinishKind.LENGTH, "max_new_tokens")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the tiny checkpoint's byte-level BPE tokenizer (no weights needed here)."""
    folder = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(build_tokenizer(), folder)
    return folder


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> Tokenizer:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def feed(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int = 1, final: bool = True
) -> list[str]:
    """Feed `ids` in steps of `chunk`; the last step carries the scheduler's finish."""
    steps = [list(ids[i : i + chunk]) for i in range(0, len(ids), chunk)] or [[]]
    out = [detok.step(step) for step in steps[:-1]]
    return out + [detok.step(steps[-1], final=final)]


def req_out(rid: str, ids: list[int], finish: Finish | None = None, **kw: object) -> ReqOutput:
    return ReqOutput(rid, ids, 7, len(ids), 0, finish_reason=finish, **kw)


# ----------------------------------------------------------------------------- UTF-8 safety


def test_multibyte_characters_one_token_at_a_time(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the text must split characters"
    chunks = feed(IncrementalDetokenizer(tok), ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == tok.decode(ids) == TEXT


def random_ids(rng: random.Random, tok: Tokenizer, size: int = 30) -> list[int]:
    """Half ids from TEXT (split multi-byte characters), half from the whole vocabulary."""
    text_ids = tok.encode(TEXT)
    pick = [lambda: rng.choice(text_ids), lambda: rng.randrange(len(tok))]
    return [rng.choice(pick)() for _ in range(size)]


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_random_ids_match_full_decode(tok: Tokenizer, chunk: int) -> None:
    rng = random.Random(chunk)
    for _ in range(40):
        ids = random_ids(rng, tok)
        for skip in (True, False):
            chunks = feed(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids, chunk)
            assert "".join(chunks) == tok.decode(ids, skip_special_tokens=skip)


def test_window_stays_small(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode(TEXT * 20)
    for i in ids:
        detok.step([i])
        assert len(detok.window) <= 8


@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_long_runs_of_broken_bytes_stay_bounded_and_exact(tok: Tokenizer, chunk: int) -> None:
    """Lone high bytes keep the text ending in U+FFFD; the held window must not grow forever."""
    rng = random.Random(chunk)
    high_bytes = [i for i in range(len(tok)) if tok.decode([i]) == "\ufffd"]
    ids = [rng.choice(high_bytes) for _ in range(300)]
    detok = IncrementalDetokenizer(tok)
    chunks = []
    for start in range(0, len(ids), chunk):
        chunks.append(detok.step(ids[start : start + chunk]))
        assert len(detok.window) <= 2 * MAX_HELD_TOKENS + chunk
    chunks.append(detok.step([], final=True))
    assert "".join(chunks) == tok.decode(ids)


def test_unfinished_character_is_flushed_at_finish(tok: Tokenizer) -> None:
    ids = tok.encode("a你")[:-1]  # the last byte of the character is missing
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.step([i]) for i in ids) == "a"
    assert detok.step([], final=True) == tok.decode(ids)[1:]


def test_skip_special_tokens(tok: Tokenizer) -> None:
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [*tok.encode("two cats"), end, *tok.encode(" sat")]
    assert "".join(feed(IncrementalDetokenizer(tok), ids)) == "two cats sat"
    kept = "".join(feed(IncrementalDetokenizer(tok, skip_special_tokens=False), ids))
    assert kept == "two cats<|im_end|> sat"


# ----------------------------------------------------------------------------- stop strings


def test_stop_string_in_the_middle(tok: Tokenizer) -> None:
    ids = tok.encode("one, two, three, four")
    detok = IncrementalDetokenizer(tok, stop=["three"])
    chunks = feed(detok, ids, final=False)
    assert "".join(chunks) == "one, two, "
    assert detok.matched_stop == "three"
    assert detok.step(tok.encode(" five"), final=True) == ""


def test_stop_string_split_across_steps_never_leaks(tok: Tokenizer) -> None:
    stop = "the window"
    ids = tok.encode("The robot walked to the window and looked")
    detok = IncrementalDetokenizer(tok, stop=[stop])
    released = ""
    for i in ids:
        released += detok.step([i])
        assert not any(released.endswith(stop[:k]) for k in range(1, len(stop) + 1))
    assert released == "The robot walked to "
    assert detok.matched_stop == stop


def test_earliest_stop_string_wins(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["garden", "window", "wind"])
    text = "".join(feed(detok, tok.encode("looked at the window and the garden"), chunk=50))
    assert text == "looked at the "
    assert detok.matched_stop == "wind"


def test_stop_prefix_that_never_completes_is_flushed(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["the end."])
    chunks = feed(detok, tok.encode("this is the end"))
    assert "".join(chunks[:-1]) == "this is "
    assert "".join(chunks) == "this is the end"
    assert detok.matched_stop is None


def test_stop_matcher_holds_the_longest_possible_start() -> None:
    matcher = StopMatcher(["abc", "bcd", ""])
    assert matcher.push("xxab") == "xx"
    assert matcher.push("x") == "abx"
    assert matcher.push("bc") == ""
    assert matcher.push("e") == "bce"
    assert matcher.push("zbcd!") == "z"
    assert matcher.matched == "bcd"
    assert matcher.push("abc") == "" and matcher.flush() == ""


# ----------------------------------------------------------------------------- manager


def test_manager_streams_and_drops_state_at_finish(tok: Tokenizer) -> None:
    manager = DetokenizerManager(tok)
    ids = tok.encode(TEXT)
    texts = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        batch = manager.handle(BatchTokenOut([req_out("r1", [token], LENGTH if last else None)]))
        assert isinstance(batch, BatchStrOut) and batch.outputs[0].token_ids == [token]
        texts.append(batch.outputs[0].text)
    assert "".join(texts) == TEXT
    assert batch.outputs[0].finish_reason == LENGTH and batch.outputs[0].prompt_tokens == 7
    assert manager.states == {} and manager.stopped == {}


def test_manager_passes_the_scheduler_stage_times_on(tok: Tokenizer) -> None:
    manager = DetokenizerManager(tok)
    stages = StageTimes(queue=0.5, encoder=0.25, prefill=0.75)
    first = manager.handle(BatchTokenOut([req_out("s", tok.encode("a"), stages=stages)]))
    later = manager.handle(BatchTokenOut([req_out("s", tok.encode("b"), LENGTH)]))
    assert first.outputs[0].stages == stages and later.outputs[0].stages is None


def test_manager_ignores_a_request_after_its_stop_matched(tok: Tokenizer) -> None:
    manager = DetokenizerManager(tok)
    first = manager.handle(
        BatchTokenOut(
            [
                req_out("a", tok.encode("the cat sat on")),
                req_out("b", tok.encode("the cat sat on")),
            ],
            started=[ReqStart("a", ("sat",)), ReqStart("b")],
        )
    )
    a, b = first.outputs
    assert (a.text, a.finish_reason) == ("the cat ", Finish(FinishKind.STOP, matched="sat"))
    assert (b.text, b.finish_reason) == ("the cat sat on", None)
    later = manager.handle(BatchTokenOut([req_out("a", tok.encode(" the"))]))
    assert later.outputs == []
    abort = Finish(FinishKind.ABORT, "aborted")
    assert manager.handle(BatchTokenOut([req_out("a", [], abort)])).outputs == []
    assert set(manager.states) == {("b", 0)} and manager.stopped == {}


def test_manager_forgets_the_requests_of_a_replica_that_died(tok: Tokenizer) -> None:
    """`ForgetReqs`: every choice of those requests goes, what their dead rank sent before it
    died is dropped when it arrives after, and the other requests go on."""
    manager = DetokenizerManager(tok)
    starts = [ReqStart("a", ("zz",)), ReqStart("a", index=1), ReqStart("b")]
    outs = [req_out("a", tok.encode("the cat")), req_out("b", tok.encode("the cat"))]
    manager.handle(BatchTokenOut(outs, started=starts))
    assert manager.handle(ForgetReqs(["a"])) == BatchStrOut(outputs=[])
    assert set(manager.states) == set(manager.starts) == {("b", 0)}
    late = [req_out("a", tok.encode(" sat"), LENGTH), req_out("b", tok.encode(" sat"), LENGTH)]
    after = manager.handle(BatchTokenOut(late))
    assert [o.rid for o in after.outputs] == ["b"] and manager.states == {}


def test_manager_stop_and_scheduler_finish_in_one_message(tok: Tokenizer) -> None:
    manager = DetokenizerManager(tok)
    batch = BatchTokenOut([req_out("a", tok.encode("x. y"), LENGTH)], [ReqStart("a", (".",))])
    out = manager.handle(batch)
    assert out.outputs[0].text == "x"
    assert out.outputs[0].finish_reason == Finish(FinishKind.STOP, matched=".")
    assert manager.states == {} and manager.stopped == {}


def test_a_stop_token_ends_the_text_without_appearing_in_it(tok: Tokenizer) -> None:
    """A non-special stop token (EOS or stop_token_ids) is cut, unless asked for."""
    dot = tok.encode(".")[0]
    ids = [*tok.encode("the cat sat"), dot]
    stop = Finish(FinishKind.STOP, str(dot))
    for keep, want in ((False, "the cat sat"), (True, "the cat sat.")):
        manager = DetokenizerManager(tok)
        start = ReqStart("a", include_stop_str_in_output=keep)
        out = manager.handle(BatchTokenOut([req_out("a", ids, stop)], [start])).outputs[0]
        assert (out.text, out.token_ids, out.finish_reason) == (want, ids, stop)


def test_include_stop_str_in_output_keeps_the_matched_string(tok: Tokenizer) -> None:
    manager = DetokenizerManager(tok)
    start = ReqStart("a", (" sat",), include_stop_str_in_output=True)
    out = manager.handle(BatchTokenOut([req_out("a", tok.encode("the cat sat on"))], [start]))
    assert out.outputs[0].text == "the cat sat"
    assert out.outputs[0].finish_reason == Finish(FinishKind.STOP, matched=" sat")


def test_stop_strings_wait_for_min_tokens(tok: Tokenizer) -> None:
    """Before min_tokens output tokens a stop string passes as text (vLLM's rule)."""
    ids = tok.encode("the cat and the cat again")
    later = len(tok.encode("the cat and the"))
    manager = DetokenizerManager(tok)
    manager.start(ReqStart("a", ("cat",), min_tokens=later))
    text, finish = "", None
    for n, token in enumerate(ids, start=1):
        out = ReqOutput("a", [token], 7, n, 0)
        (got,) = manager.handle(BatchTokenOut([out])).outputs
        text, finish = text + got.text, got.finish_reason
        if finish is not None:
            break
    assert text == "the cat and the " and finish == Finish(FinishKind.STOP, matched="cat")


def test_logprobs_carry_each_token_text_and_exact_bytes(tok: Tokenizer) -> None:
    ids = tok.encode("a你🙂")
    assert any("\ufffd" in tok.decode([i]) for i in ids), "a token must split a character"
    entries = [TokenLogprobs(t, -0.5, [(t, -0.5), (ids[0], -1.0)]) for t in ids]
    manager = DetokenizerManager(tok)
    (out,) = manager.handle(BatchTokenOut([req_out("a", ids, LENGTH, logprobs=entries)])).outputs
    assert [e.chosen.token_id for e in out.logprobs] == ids
    assert b"".join(bytes(e.chosen.bytes) for e in out.logprobs) == "a你🙂".encode()
    assert [e.chosen.text for e in out.logprobs] == [tok.decode([i]) for i in ids]
    assert all([t.logprob for t in e.top] == [-0.5, -1.0] for e in out.logprobs)
    assert out.logprobs[0].top[1].text == "a"
    plain = manager.handle(BatchTokenOut([req_out("b", ids, LENGTH)])).outputs[0]
    assert plain.logprobs is None


def test_choices_of_one_request_are_detokenized_apart(tok: Tokenizer) -> None:
    """n > 1: each choice has its own text, stop match and finish under the same rid."""
    manager = DetokenizerManager(tok)
    starts = [ReqStart("a", ("cat",), index=i) for i in range(2)]
    outs = [
        ReqOutput("a", tok.encode("the cat sat"), 7, 3, 0, index=0),
        ReqOutput("a", tok.encode("a dog ran"), 7, 3, 0, index=1),
    ]
    first, second = manager.handle(BatchTokenOut(outs, starts)).outputs
    assert (first.index, first.text, first.finish_reason.matched) == (0, "the ", "cat")
    assert (second.index, second.text, second.finish_reason) == (1, "a dog ran", None)
    later = BatchTokenOut([ReqOutput("a", tok.encode(" on"), 7, 4, 0, LENGTH, index=1)])
    (last,) = manager.handle(later).outputs
    assert (last.index, last.text, last.finish_reason) == (1, " on", LENGTH)
    assert manager.states == {} and set(manager.stopped) == {("a", 0)}


class BrokenTokenizer:
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        raise ValueError("cannot decode")


def test_manager_turns_a_failure_into_an_error_finish() -> None:
    manager = DetokenizerManager(BrokenTokenizer())
    out = manager.handle(BatchTokenOut([req_out("bad", [1, 2])])).outputs[0]
    assert out.finish_reason.is_error and "cannot decode" in out.finish_reason.detail
    assert manager.states == {}
    assert manager.handle(BatchTokenOut([req_out("bad", [3])])).outputs == []


def test_control_messages_pass_through(tok: Tokenizer) -> None:
    manager = DetokenizerManager(tok)
    for msg in (FlushCacheOut(True), ServerInfo(10, 10, 0, 0, 0, 0), ShutdownReq()):
        assert manager.handle(msg) is msg


def test_a_message_outside_the_channels_union_is_a_loud_error(tok: Tokenizer) -> None:
    manager = DetokenizerManager(tok)
    with pytest.raises(UnknownMessage, match="-> detokenizer: unknown message FlushCacheReq"):
        manager.handle(FlushCacheReq())  # a scheduler-bound request that went the wrong way


# ----------------------------------------------------------------------------- process


def test_process_reports_a_start_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(detokenizer, "configure_logging", lambda *args, **kw: None)
    reader, writer = mp.Pipe(duplex=False)
    with pytest.raises(ValueError, match="model_path"):
        run_detokenizer_process(ServerArgs(model_path=None), writer)
    msg = reader.recv()
    assert msg.status == "error" and "model_path" in msg.error


@pytest.fixture
def detokenizer_process(tokenizer_dir: Path, tmp_path: Path) -> Iterator[ServerArgs]:
    """A real detokenizer process on sockets in a temp folder; always stopped at the end."""
    args = dataclasses.replace(ServerArgs(model_path=str(tokenizer_dir)), ipc_dir=str(tmp_path))
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_detokenizer_process, args=(args, writer), daemon=True)
    proc.start()
    try:
        assert reader.poll(60), "the detokenizer did not report in time"
        assert reader.recv() == ReadyReport("ready")
        yield args
        proc.join(10)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


def test_process_round_trip_and_shutdown(detokenizer_process: ServerArgs, tok: Tokenizer) -> None:
    args = detokenizer_process
    ctx = zmq.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        pull.bind(args.tokenizer_ipc)
        pull.setsockopt(zmq.RCVTIMEO, 10_000)
        push = ctx.socket(zmq.PUSH)
        push.connect(args.detokenizer_ipc)
        push.send_pyobj(BatchTokenOut([req_out("r", tok.encode(TEXT), LENGTH)]))
        out = pull.recv_pyobj()
        assert isinstance(out, BatchStrOut)
        assert (out.outputs[0].text, out.outputs[0].finish_reason) == (TEXT, LENGTH)
        push.send_pyobj(FlushCacheOut(True, "ok"))
        assert pull.recv_pyobj() == FlushCacheOut(True, "ok")
        push.send_pyobj(ShutdownReq())
        assert isinstance(pull.recv_pyobj(), ShutdownReq)
    finally:
        ctx.destroy(linger=0)


def test_constants_arrive_once_and_a_restart_forgets_the_old_request(tok: Tokenizer) -> None:
    """Stop strings and detokenization options come with the request's start, not with its
    outputs; a new start under an id drops whatever the detokenizer kept for that id."""
    assert {"stop", "skip_special_tokens"}.isdisjoint(ReqOutput.__dataclass_fields__)
    manager = DetokenizerManager(tok)
    manager.handle(
        BatchTokenOut([req_out("a", tok.encode("the cat sat"))], [ReqStart("a", ("cat",))])
    )
    assert ("a", 0) in manager.stopped  # matched; the scheduler's finish has not come yet
    batch = BatchTokenOut([req_out("a", tok.encode("the cat"), LENGTH)], [ReqStart("a")])
    out = manager.handle(batch).outputs[0]
    assert (out.text, out.finish_reason) == ("the cat", LENGTH)
    assert manager.states == {} and manager.stopped == {}


def test_a_replicas_evictions_pass_on_with_its_index(tok: Tokenizer) -> None:
    """A batch's radix evictions reach the TokenizerManager stamped with the replica, with the
    outputs or alone (a batch with nothing else is still sent: not `empty`)."""
    manager = DetokenizerManager(tok)
    cut = PrefixCut(3, 7, 12345)
    alone = manager.handle(BatchTokenOut([], evicted=[cut], replica=1))
    assert alone == BatchStrOut([], evicted=[cut], replica=1) and not alone.empty
    both = manager.handle(BatchTokenOut([req_out("a", tok.encode("hi"))], evicted=[cut]))
    assert len(both.outputs) == 1 and both.evicted == [cut] and both.replica == 0
    assert manager.handle(BatchTokenOut([])).empty
