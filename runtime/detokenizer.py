"""The detokenizer process: token ids from scheduler rank 0 in, text out to the TokenizerManager.

Three parts, from pure to process:

- `StopMatcher` and `IncrementalDetokenizer` turn one request's token ids into text, a delta per
  step. Text is only released once it is whole: a multi-byte character split across byte-level
  tokens is held until its last byte arrives, and a tail that might be the start of a stop string
  is held until the next tokens show whether it is one.
- `DetokenizerManager` keeps one `IncrementalDetokenizer` per request and turns a `BatchTokenOut`
  into a `BatchStrOut`; other messages pass through unchanged.
- `run_detokenizer_process` is the process entry: it loads the tokenizer, binds its input socket,
  reports ready to `launch.py`, and loops until a `ShutdownReq`.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable, Sequence
from multiprocessing.connection import Connection
from typing import Protocol

import zmq

from runtime.allocator import freeze_startup_objects, keep_freed_memory
from runtime.io_struct import (
    BatchStrOut,
    BatchTokenOut,
    Finish,
    FinishKind,
    FlushCacheOut,
    ForgetReqs,
    OutputLogprobs,
    PixelsWanted,
    ReadyReport,
    ReqOutput,
    ReqStart,
    ServerInfo,
    ShutdownReq,
    StrOutput,
    ToDetokenizer,
    TokenText,
    ToTokenizer,
    UnknownMessage,
)
from runtime.logging_utils import configure_logging, get_logger
from runtime.parent_watch import exit_with_parent
from runtime.sampling_params import TokenLogprobs
from runtime.server_args import ServerArgs

logger = get_logger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Tokens held back while their text still ends in an unfinished character. No character needs
# more than four byte tokens, so a longer run only happens around invalid bytes: then the text up
# to the last token boundary that later ids cannot change is released, which bounds the cost of a
# step whatever the model produces.
MAX_HELD_TOKENS = 16
# Tokens (a byte or more each) after which a UTF-8 decoder has settled how to read the bytes
# before them: an unfinished character needs at most three more bytes.
UTF8_LOOKAHEAD = 3
# Requests whose stop string matched but whose finish from the scheduler has not arrived yet are
# remembered so that their late tokens are dropped; this bounds that memory.
MAX_STOPPED_RIDS = 65536


class TokenDecoder(Protocol):
    """What the detokenizer needs from a tokenizer (a transformers tokenizer satisfies it)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


# ----------------------------------------------------------------------------- pure logic


class StopMatcher:
    """Cuts a stream of text right before the first stop string it contains.

    `push` returns the text that is safe to release: everything before a matched stop string, or,
    while none has matched, everything except the longest tail that could still grow into one.
    """

    def __init__(self, stops: Iterable[str] = (), keep: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.keep = keep  # include_stop_str_in_output: the released text ends with the stop
        self.pending = ""
        self.matched: str | None = None

    def push(self, text: str, armed: bool = True) -> str:
        """`armed` False (min_tokens not reached yet): the text passes without being matched."""
        if self.matched is not None:
            return ""
        if not armed:
            out, self.pending = self.pending + text, ""
            return out
        self.pending += text
        hit = self._first_match()
        if hit is not None:
            return self._cut_at(*hit)
        keep = self._held_tail_len()
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out

    def flush(self) -> str:
        """Release the held tail: the text ended without it becoming a stop string."""
        out, self.pending = self.pending, ""
        return out

    def _first_match(self) -> tuple[int, str] | None:
        hits = [(self.pending.find(s), len(s), s) for s in self.stops]
        found = [(index, size, s) for index, size, s in hits if index >= 0]
        if not found:
            return None
        index, _, stop = min(found)
        return index, stop

    def _cut_at(self, index: int, stop: str) -> str:
        out = self.pending[: index + (len(stop) if self.keep else 0)]
        self.pending = ""
        self.matched = stop
        return out

    def _held_tail_len(self) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of some stop string."""
        longest = max((len(s) for s in self.stops), default=0)
        for size in range(min(len(self.pending), longest - 1), 0, -1):
            tail = self.pending[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0


class IncrementalDetokenizer:
    """One request's token ids -> text deltas, UTF-8 safe, with stop strings trimmed.

    Only a window of recent ids is kept: ids[:read_offset] were already turned into released
    text, the ids before that window are forgotten. Each step decodes the window with and without
    the unread ids and releases the difference, so a step costs O(window), not O(sequence).
    Decoding the already-read ids again gives the tokenizer the same context on both sides
    (e.g. a leading space that depends on the previous token).
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        *,
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.window: list[int] = []
        self.read_offset = 0
        self.stops = StopMatcher(stop, keep=include_stop)

    @property
    def matched_stop(self) -> str | None:
        return self.stops.matched

    def step(self, new_ids: Sequence[int], final: bool = False, armed: bool = True) -> str:
        """Add the new ids and return the text to release; `final` flushes everything held;
        `armed` False: stop strings are not matched in this step's text (min_tokens)."""
        if self.matched_stop is not None:
            return ""
        self.window.extend(new_ids)
        text = self.stops.push(self._decode_unread(force=final), armed)
        if final and self.matched_stop is None:
            text += self.stops.flush()
        return text

    def _decode_unread(self, force: bool) -> str:
        read_text = self._decode(self.window[: self.read_offset])
        full_text = self._decode(self.window)
        if force or is_whole(read_text, full_text):
            return self._release(len(self.window), read_text, full_text)
        if len(self.window) - self.read_offset >= MAX_HELD_TOKENS:
            return self._release_settled_part(read_text, full_text)
        return ""

    def _release_settled_part(self, read_text: str, full_text: str) -> str:
        """Held too long: release up to the last token boundary that later ids cannot change."""
        for cut in range(len(self.window) - 1, self.read_offset, -1):
            head = self._decode(self.window[:cut])
            if self._is_settled(cut, head, full_text):
                return self._release(cut, read_text, head)
        return self._release(len(self.window), read_text, full_text)

    def _is_settled(self, cut: int, head: str, full_text: str) -> bool:
        """Text before `cut` is final: it ends in a whole character, or in bytes that stay
        invalid whatever follows (an unfinished character needs at most three more bytes)."""
        if not head.endswith(REPLACEMENT_CHAR):
            return True
        if len(self.window) - cut < UTF8_LOOKAHEAD:
            return False
        return head + self._decode(self.window[cut:]) == full_text

    def _release(self, cut: int, read_text: str, cut_text: str) -> str:
        """Ids up to `cut` become the read context of the next step; older ids are dropped."""
        dropped = self.read_offset
        del self.window[:dropped]
        self.read_offset = cut - dropped
        return cut_text[len(read_text) :]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


Key = tuple[str, int]  # a request's id and which of its n choices


def key_of(msg: ReqOutput | ReqStart) -> Key:
    return msg.rid, msg.index


def ends_on_stop_token(finish: Finish | None) -> bool:
    """The scheduler ended the request on a stop token (EOS or stop_token_ids, named in
    `detail`): its last id. A grammar that ended on its own last token names none: that token
    is output."""
    if finish is None or finish.kind != FinishKind.STOP:
        return False
    return finish.matched is None and finish.detail != ""


def is_whole(read_text: str, full_text: str) -> bool:
    """The new ids added text and it does not end inside an unfinished character."""
    return len(full_text) > len(read_text) and not full_text.endswith(REPLACEMENT_CHAR)


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable character for each byte, inverted (character -> byte): bytes
    that print as themselves keep their character, the others map to 256 and up in order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}
    return {c: b for b, c in chars.items()}


class TokenTexts:
    """One token's text (decoded alone, special tokens shown) and its exact bytes (from the
    byte-level alphabet, so a token holding part of a character still has its true bytes),
    cached per id: logprobs name the same few thousand tokens over and over."""

    MAX_CACHED = 65536

    def __init__(self, tokenizer: TokenDecoder):
        self.tokenizer = tokenizer
        self.alphabet = byte_level_alphabet()
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token_id)
        if hit is None:
            if len(self.cache) >= self.MAX_CACHED:
                self.cache.clear()
            hit = self.cache[token_id] = self._look_up(token_id)
        return hit

    def _look_up(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        piece = getattr(self.tokenizer, "convert_ids_to_tokens", lambda _: None)(token_id)
        if isinstance(piece, str) and piece and all(c in self.alphabet for c in piece):
            return text, [self.alphabet[c] for c in piece]
        return text, list(text.encode("utf-8"))

    def entry(self, token_id: int, logprob: float) -> TokenText:
        text, raw = self(token_id)
        return TokenText(token_id, text, raw, logprob)

    def logprobs(self, entries: list[TokenLogprobs] | None) -> list[OutputLogprobs] | None:
        if entries is None:
            return None
        return [
            OutputLogprobs(
                self.entry(e.token_id, e.logprob), [self.entry(t, lp) for t, lp in e.top]
            )
            for e in entries
        ]


class DetokenizerManager:
    """Per-request detokenizer state; turns `BatchTokenOut` into `BatchStrOut`.

    A request whose stop string matched is reported finished at once and its state is dropped.
    The scheduler keeps generating it until the TokenizerManager's abort arrives, so its later
    messages are ignored, up to and including the scheduler's own finish.
    """

    def __init__(self, tokenizer: TokenDecoder):
        self.tokenizer = tokenizer
        self.states: dict[Key, IncrementalDetokenizer] = {}
        self.starts: dict[Key, ReqStart] = {}
        self.token_texts = TokenTexts(tokenizer)
        self.stopped: dict[Key, None] = {}  # ordered set of choices awaiting the scheduler's finish
        self.forgotten: dict[str, None] = {}  # ordered set of requests of a replica that died

    def handle(self, msg: ToDetokenizer) -> ToTokenizer:
        match msg:
            case BatchTokenOut():
                return self.handle_batch(msg)
            case FlushCacheOut() | ServerInfo() | PixelsWanted() | ShutdownReq():
                return msg  # replies and questions for the TokenizerManager, and the shutdown
            case ForgetReqs(rids=rids):
                self.forget(rids)
                return BatchStrOut(outputs=[])
            case _:
                raise UnknownMessage(msg, "scheduler -> detokenizer")

    def handle_batch(self, batch: BatchTokenOut) -> BatchStrOut:
        for start in batch.started:
            self.start(start)
        outputs = (self._detokenize(out) for out in batch.outputs)
        kept = [out for out in outputs if out is not None]
        return BatchStrOut(kept, evicted=batch.evicted, replica=batch.replica)

    def forget(self, rids: list[str]) -> None:
        """Drop the state of every choice of `rids` (their scheduler died), and whatever of
        theirs a dead rank sent before it died and arrives after this."""
        gone = set(rids)
        for key in [k for k in self.states if k[0] in gone]:
            del self.states[key]
        for key in [k for k in self.starts if k[0] in gone]:
            del self.starts[key]
        for key in [k for k in self.stopped if k[0] in gone]:
            del self.stopped[key]
        self.forgotten.update(dict.fromkeys(rids))
        while len(self.forgotten) > MAX_STOPPED_RIDS:
            del self.forgotten[next(iter(self.forgotten))]

    def _detokenize(self, out: ReqOutput) -> StrOutput | None:
        if out.rid in self.forgotten:
            return None
        if key_of(out) in self.stopped:
            if out.finish_reason is not None:
                del self.stopped[key_of(out)]
            return None
        try:
            text, finish = self._step(out)
        except Exception as exc:  # noqa: BLE001 - one request's failure becomes its typed error
            logger.exception("detokenizing request %s failed", out.rid)
            text, finish = "", Finish.error(f"detokenizer: {exc!r}")
            self._drop(out)
        output = self._str_output(out, text, finish)
        output.logprobs = self.token_texts.logprobs(out.logprobs)
        return output

    def start(self, start: ReqStart) -> None:
        """A request was admitted: its constants arrive once, here."""
        self.stopped.pop(key_of(start), None)
        self.starts[key_of(start)] = start
        self.states[key_of(start)] = IncrementalDetokenizer(
            self.tokenizer,
            skip_special_tokens=start.skip_special_tokens,
            stop=start.stop,
            include_stop=start.include_stop_str_in_output,
        )

    def _step(self, out: ReqOutput) -> tuple[str, Finish | None]:
        state = self.states.get(key_of(out)) or self._new_state(out)
        start = self.starts[key_of(out)]
        ids = out.new_token_ids
        if ends_on_stop_token(out.finish_reason) and not start.include_stop_str_in_output:
            ids = ids[:-1]  # a stop token ends the text without appearing in it
        armed = out.completion_tokens >= start.min_tokens
        text = state.step(ids, final=out.finish_reason is not None, armed=armed)
        if state.matched_stop is not None:
            self._drop(out)
            return text, Finish(FinishKind.STOP, matched=state.matched_stop)
        if out.finish_reason is not None:
            self._drop(out)
        return text, out.finish_reason

    def _new_state(self, out: ReqOutput) -> IncrementalDetokenizer:
        """Defaults for a request whose start was not seen (none is lost on the ordered socket;
        this keeps a stray output harmless)."""
        self.start(ReqStart(out.rid, index=out.index))
        return self.states[key_of(out)]

    def _drop(self, out: ReqOutput) -> None:
        """Forget the request; if the scheduler still runs it, ignore what it sends later."""
        self.states.pop(key_of(out), None)
        self.starts.pop(key_of(out), None)
        if out.finish_reason is None:
            self.stopped[key_of(out)] = None
            if len(self.stopped) > MAX_STOPPED_RIDS:
                del self.stopped[next(iter(self.stopped))]

    @staticmethod
    def _str_output(out: ReqOutput, text: str, finish: Finish | None) -> StrOutput:
        return StrOutput(
            rid=out.rid,
            index=out.index,
            text=text,
            token_ids=list(out.new_token_ids),
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            finish_reason=finish,
            stages=out.stages,
        )


# ----------------------------------------------------------------------------- process


class DetokenizerChannel:
    """The process's sockets: scheduler outputs in (bound), text out to the TokenizerManager."""

    def __init__(self, args: ServerArgs):
        self.ctx = zmq.Context()
        self.recv_sock = self.ctx.socket(zmq.PULL)
        self.recv_sock.bind(args.detokenizer_ipc)
        self.send_sock = self.ctx.socket(zmq.PUSH)
        self.send_sock.connect(args.tokenizer_ipc)

    def recv(self) -> ToDetokenizer:
        return self.recv_sock.recv_pyobj()

    def send(self, msg: ToTokenizer) -> None:
        self.send_sock.send_pyobj(msg)

    def close(self, linger_ms: int = 1000) -> None:
        self.ctx.destroy(linger=linger_ms)


def load_tokenizer(model_path: str | None) -> TokenDecoder:
    """The checkpoint's tokenizer only; importing it never pulls in modeling code."""
    if model_path is None:
        raise ValueError("the detokenizer needs server_args.model_path")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def serve(manager: DetokenizerManager, channel: DetokenizerChannel) -> None:
    """Receive, detokenize, send, until a ShutdownReq (which is forwarded)."""
    while True:
        msg = channel.recv()
        if isinstance(msg, ShutdownReq):
            channel.send(msg)
            logger.info("shutdown requested; detokenizer exits")
            return
        out = manager.handle(msg)
        if not (isinstance(out, BatchStrOut) and out.empty):
            channel.send(out)


def run_detokenizer_process(server_args: ServerArgs, ready: Connection) -> None:
    """Entry point of the detokenizer process: load, bind, report ready (or why not), loop."""
    exit_with_parent()
    configure_logging(server_args.log_level, prefix="detokenizer")
    keep_freed_memory()
    try:
        manager = DetokenizerManager(load_tokenizer(server_args.model_path))
        channel = DetokenizerChannel(server_args)
    except Exception:
        ready.send(ReadyReport.failed(traceback.format_exc()))
        raise
    ready.send(ReadyReport("ready"))
    logger.info("detokenizer ready on %s", server_args.detokenizer_ipc)
    freeze_startup_objects()
    try:
        serve(manager, channel)
    finally:
        channel.close()
