"""TokenizerManager: chat template, tokenization, media, and routing results back to requests.

It lives in the main process next to the HTTP server (asyncio). Media are fetched in an I/O thread
pool and preprocessed in a CPU process pool (AsyncMMDataProcessor); each item is hashed once here.
Each request goes to one data-parallel replica's entry rank over ZMQ (the `Dispatcher` picks
which, from its token ids with the image pad values in them); detokenized text comes back from
the one detokenizer every replica sends to, and is routed to the waiting request by rid. What
the front end assumes a replica holds (the pixels it was sent: a `PixelLedger` each) is kept
per replica.

A replica may die alone (invariant 20): the supervisor calls `replica_lost` (its requests in
flight end with a 503 each, the dispatcher skips it, what the front end assumed it held is
forgotten) and, once its restarted ranks are ready, `replica_ready`. With --dp > 1 a replica
whose requests get no output for --health-stall-timeout seconds is killed through the
supervisor (`ReplicaControl.kill`), and so restarted as if it had died.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import zmq
import zmq.asyncio
from jinja2 import TemplateError

from runtime.io_struct import (
    AbortReq,
    BatchStrOut,
    Finish,
    FlushCacheOut,
    FlushCacheReq,
    ForgetReqs,
    GetServerInfoReq,
    ItemEmbeddings,
    ItemPixels,
    PixelsWanted,
    ServerInfo,
    ShutdownReq,
    StrOutput,
    TokenizedGenerateReq,
    ToScheduler,
    ToTokenizer,
    UnknownMessage,
)
from runtime.logging_utils import get_logger
from runtime.model_config import ModelConfig
from runtime.multimodal import Modality, MultimodalDataItem, MultimodalInputs
from runtime.sampling_params import SamplingParams, bad_words_token_ids
from runtime.server_args import ServerArgs
from runtime.token_budget import TokenBudget, context_length
from runtime.transport.frames import to_frames
from runtime.transport.shm import SharedTensor, remove_file
from tokenizer_manager.dispatcher import Balance, Dispatcher, Route
from tokenizer_manager.encoder_pool import EncoderPool, EncoderRefused, EncoderUnavailable
from tokenizer_manager.grammar_check import GrammarCheck
from tokenizer_manager.media.limits import media_param
from tokenizer_manager.media.mm_processor import AsyncMMDataProcessor
from tokenizer_manager.media.multimodal_inputs import (
    PreparedMedia,
    build_multimodal_inputs,
    check_prompt_ids,
    check_rendered_chat,
    check_text_prompt,
    expand_placeholder_ids,
    expand_placeholders,
    with_placeholders,
)
from tokenizer_manager.media.pixel_ledger import PixelLedger
from tokenizer_manager.media.settings import checked_settings, request_spec
from tokenizer_manager.media.types import MediaRef, ProcessorSpec
from tokenizer_manager.metrics import RequestTimeline, ServingMetrics
from tokenizer_manager.prompt_limits import max_prompt_chars
from tokenizer_manager.protocol import APIError

logger = get_logger(__name__)

T = TypeVar("T")
LONG_PROMPT_CHARS = 16_384  # prompts longer than this are tokenized in a lane of their own
MAX_HANDED = 1024  # requests whose handed-off files are tracked per replica before a prune
# A request of at most this many tokens with no video is built on the event loop: its pad ids
# and MRoPE positions took 0.5 ms for a resent 2-image turn of 572 tokens there, against 0.8 ms
# through the CPU thread and back (0.02 against 0.2 ms for a text request; docs/benchmarks.md).
INLINE_BUILD_IDS = 2048
# Chats and prompts this short are templated and tokenized on the event loop (about 0.1 ms
# each): the two hops to the CPU thread and back would cost more, up to the interpreter's
# 5 ms thread switch interval each while the loop is busy with other requests.
INLINE_PROMPT_CHARS = 4096


def renders_quickly(messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None) -> bool:
    """Whether a chat is short enough to render on the event loop: its text parts within
    INLINE_PROMPT_CHARS and nothing else for the template (tools, documents) but its flags."""
    if any(not isinstance(v, bool | None) for v in (template_kwargs or {}).values()):
        return False
    chars = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
        elif content is not None:
            return False
        if len(m) > 2 + ("name" in m):  # tool calls, reasoning: the thread renders them
            return False
        if chars > INLINE_PROMPT_CHARS:
            return False
    return True


def awaiting(
    mm: MultimodalInputs | None, items: list[MultimodalDataItem]
) -> MultimodalInputs | None:
    """The request's media as its replica first gets them: `items` without their features,
    marked `awaiting` (an `ItemEmbeddings` message brings them); the others as they are."""
    if mm is None or not items:
        return mm
    late = {id(item) for item in items}
    copies = [
        dataclasses.replace(i, feature=None, awaiting=True) if id(i) in late else i
        for i in mm.items
    ]
    return dataclasses.replace(mm, items=copies)


def load_chat_template(model_path: str | Path, tokenizer: Any) -> str:
    """chat_template.json or chat_template.jinja in the folder, else the tokenizer's own."""
    root = Path(model_path)
    if (root / "chat_template.json").is_file():
        return json.loads((root / "chat_template.json").read_text())["chat_template"]
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text()
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    raise ValueError(f"no chat template in {model_path}")


def replica_summary(info: ServerInfo) -> dict[str, object]:
    """One replica's KV, queue and cache use from its entry rank's report."""
    kv = ("kv_total", "kv_free", "kv_evictable", "kv_protected", "running", "waiting")
    return {k: getattr(info, k) for k in kv} | {
        "cached_prompt_tokens": info.counters.cached_prompt_tokens,
        "prompt_tokens_computed": info.counters.prompt_tokens_computed,
        "finished": info.counters.finished,
        "encoder_cache_hits": info.encoder_cache.hits,
        "encoder_cache_misses": info.encoder_cache.misses,
        "encoder_cache_pins": info.encoder_cache.pins,
    }


def _client_error(check: Callable[..., None], *args: Any, param: str = "messages") -> None:
    """Run a prompt check; its ValueError is the client's 400, naming `param`."""
    try:
        check(*args)
    except ValueError as e:
        raise APIError(str(e), param=param, code="invalid_special_token") from e


class ReplicaControl(Protocol):
    """What the front end may ask of the replicas' supervisor (launch.Supervisor)."""

    def status(self) -> dict[int, dict[str, object]]:
        """Each replica's `state` (up, restarting, down), `restarts` and rank `pids`."""
        ...

    def kill(self, replica: int, reason: str) -> None:
        """End a replica that hangs; it is then handled as one that died."""
        ...


@dataclass
class ReqState:
    timeline: RequestTimeline
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False  # every choice has ended
    started: bool = False  # an output arrived: no longer queued
    n: int = 1  # choices
    ended: set[int] = field(default_factory=set)  # choices that have ended
    replica: int = 0  # the data-parallel replica it runs on
    load: int = 0  # its tokens so far (prompt and outputs): its share of the replica's load
    output_ids: list[int] = field(default_factory=list)  # the first choice's, as they came
    lost: bool = False  # its replica died: it ended there, the replica's views were reset
    encoding: bool = False  # its media are with the encoder servers: its replica owes nothing
    spilled: bool = False  # its media went to its replica's own tower (--encoder-fallback spill)

    @property
    def awaits_output(self) -> bool:
        """Its replica owes it output (the stall clocks count it): not ended, not encoding."""
        return not self.finished and not self.encoding

    def end(self, index: int) -> None:
        self.ended.add(index)
        self.finished = len(self.ended) == self.n


@dataclass
class GenerateInput:
    """A parsed request as the HTTP routes hand it over: one prompt form (chat messages, text
    or token ids), its media in prompt order, and how to make its sampling parameters once the
    prompt's length (and so the room left for output) is known."""

    rid: str
    stream: bool
    sampling: Callable[[int], SamplingParams]  # room left for output -> the request's params
    max_tokens: int | None = None  # the client's output cap, when it gave one
    n: int = 1  # choices (each up to max_tokens): they must fit the KV pool together
    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    input_ids: list[int] | None = None
    media: list[MediaRef] = field(default_factory=list)
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat: for the template
    mm_processor_kwargs: dict[str, Any] | None = None  # the client's media settings, unchecked
    media_scope: str = ""  # the caller's scope of client media ids (http.server.media_scope)


class TokenizerManager:
    def __init__(
        self,
        args: ServerArgs,
        mm: AsyncMMDataProcessor | None = None,
        kv_total: int | None = None,
        replicas: ReplicaControl | None = None,
    ):
        """`kv_total`: the smallest replica's KV pool; `replicas`: the supervisor's view of
        the replicas (their state and processes, for /server_info) and its kill switch."""
        from transformers import AutoTokenizer

        self.args = args
        self.replicas = replicas
        self.config = ModelConfig.from_dir(args.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(args.model_path)
        self.chat_template = load_chat_template(args.model_path, self.tokenizer)
        self.mm = mm
        # pixels go to a replica's ranks only when their encoder caches may lack the item
        # (with encoder servers every item goes, encoded: the ranks cannot ask for one again)
        keyed = args.mm_cache_size_mb > 0 and not args.encoder_url_list
        shm = mm.shm_dir if mm else None
        self.encoders: EncoderPool | None = None  # --encoder-urls: made in `start`
        self.pixels = [PixelLedger(keyed, shm) for _ in range(args.dp_size)]
        # the shared files handed to each replica's ranks, by request, until it has started
        # (its ranks read their files on receipt): a replica that dies first leaves them here
        self.handed: list[dict[str, list[str]]] = [{} for _ in range(args.dp_size)]
        self.context_length = context_length(args, self.config)
        # prompt + output tokens one request may hold: the context, and the scheduler's KV pool
        shared = not args.disable_radix_cache  # a request's choices share its prompt's KV
        self.budget = TokenBudget(self.context_length, kv_total or self.context_length, shared)
        balance = Balance(args.dp_cache_threshold, args.dp_balance_abs_tokens, args.dp_balance_rel)
        # each replica's prefix tree is bounded by what its KV pool can cache
        self.dispatcher = Dispatcher(args.dp_size, args.dp_policy, self.budget.kv_tokens, balance)
        self.states: dict[str, ReqState] = {}
        self.metrics = ServingMetrics()
        self.fatal: str | None = None  # set when the server is going down: new requests get 503
        self.client_rids: set[str] = set()  # ids of the requests in flight, as clients know them
        self._serial = itertools.count()
        self.last_progress = time.monotonic()  # when the detokenizer last sent anything
        # when each replica last sent an output (or began to run requests): its stall clock
        self.replica_progress = [self.last_progress] * args.dp_size
        self._replies: dict[tuple[type, int], asyncio.Future] = {}  # by type and replica
        self._reply_lock = asyncio.Lock()
        self._ctx = zmq.asyncio.Context()
        self._recv_task: asyncio.Task | None = None
        self._stall_task: asyncio.Task | None = None
        # One thread for a request's CPU work (chat template, tokenizing, hashing): off the
        # event loop, and one at a time, since a fast tokenizer is not safe to share.
        self._cpu = ThreadPoolExecutor(1, thread_name_prefix="tessera-tokenize")
        # Long prompts take a second thread with a tokenizer of its own (tokenizing releases
        # the GIL), so short prompts never wait behind one; a prompt that cannot fit the
        # context by its length alone is refused before either.
        self._long = ThreadPoolExecutor(1, thread_name_prefix="tessera-tokenize-long")
        self._long_tokenizer = AutoTokenizer.from_pretrained(args.model_path)
        # Short prompts are tokenized on the event loop, with a tokenizer only the loop uses.
        self._loop_tokenizer = AutoTokenizer.from_pretrained(args.model_path)
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.budget.limit)
        self.grammar = GrammarCheck(
            args.model_path, self.config.text.vocab_size, self.config.eos_token_ids
        )

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._to_scheduler = [self._scheduler_socket(r) for r in range(self.args.dp_size)]
        self._to_detok = self._ctx.socket(zmq.PUSH)
        self._to_detok.connect(self.args.detokenizer_ipc)
        self._from_detok = self._ctx.socket(zmq.PULL)
        self._from_detok.bind(self.args.tokenizer_ipc)
        self._recv_task = asyncio.create_task(self._recv_loop())
        args = self.args
        if args.encoder_url_list:
            urls, key = args.encoder_url_list, args.encoder_key
            self.encoders = EncoderPool(urls, key, args.encoder_timeout, args.encoder_retries)
        if self.args.dp_size > 1 and self.replicas is not None:
            self._stall_task = asyncio.create_task(self._watch_stalls())

    def _scheduler_socket(self, replica: int) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.PUSH)
        sock.connect(self.args.scheduler_ipc(replica))
        return sock

    async def close(self) -> None:
        for task in (self._recv_task, self._stall_task):
            if task is not None:
                task.cancel()
        if self.mm is not None:
            await self.mm.close()
        self._cpu.shutdown(wait=False, cancel_futures=True)
        self._long.shutdown(wait=False, cancel_futures=True)
        await self.grammar.close()
        if self.encoders is not None:
            await self.encoders.close()
        self._ctx.destroy(linger=0)

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a request's CPU-heavy step off the event loop (see `_cpu`)."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    async def _recv_loop(self) -> None:
        while True:
            msg = await self._from_detok.recv_pyobj()
            self.last_progress = time.monotonic()
            try:
                self._dispatch(msg)
            except Exception:  # noqa: BLE001 - one bad message must not stop routing
                logger.exception("failed to route %s", type(msg).__name__)

    def _dispatch(self, msg: ToTokenizer) -> None:
        match msg:
            case BatchStrOut(outputs=outputs):
                for out in outputs:
                    self._route(out)
                if msg.evicted:
                    self.dispatcher.evicted(msg.replica, msg.evicted)
            case FlushCacheOut() | ServerInfo():
                self._reply(msg)
            case PixelsWanted(rid=rid, hashes=hashes):
                state = self.states.get(rid)
                answer = state and self.pixels[state.replica].answer(rid, hashes)
                if answer is not None:
                    self._send(answer, state.replica)
            case ShutdownReq():
                logger.info("the detokenizer has shut down")
            case _:
                raise UnknownMessage(msg, "detokenizer -> tokenizer")

    def _reply(self, msg: FlushCacheOut | ServerInfo) -> None:
        """The answer to the control request waiting for this type from this replica (see
        `_ask`)."""
        future = self._replies.pop((type(msg), msg.replica), None)
        if future is not None and not future.done():
            future.set_result(msg)

    def _route(self, out: StrOutput) -> None:
        state = self.states.get(out.rid)
        if state is None or out.index in state.ended:
            return
        if not state.started:
            self.handed[state.replica].pop(out.rid, None)  # its ranks have read its files
        state.started = True
        self.replica_progress[state.replica] = self.last_progress
        state.load += len(out.token_ids)
        self.dispatcher.progressed(state.replica, len(out.token_ids))
        if out.index == 0:
            state.output_ids += out.token_ids
        if out.finish_reason is not None:
            state.end(out.index)
            # A stop string or a detokenizer failure ends the choice before the scheduler does.
            if out.finish_reason.matched is not None or out.finish_reason.is_error:
                self._send(AbortReq(out.rid, out.index), state.replica)
        state.queue.put_nowait(out)

    def fail_all(self, reason: str) -> None:
        """The server is going down: every request in flight ends with a 503 error."""
        self.fatal = reason
        finish = Finish.error(reason, 503, "server_shutdown")
        for rid, state in list(self.states.items()):
            self._fail(rid, state, finish)

    def _fail(self, rid: str, state: ReqState, finish: Finish) -> None:
        """Every choice of the request that has not ended ends with `finish`."""
        for index in sorted(set(range(state.n)) - state.ended):
            state.end(index)
            state.queue.put_nowait(StrOutput(rid, "", [], 0, 0, 0, finish, index=index))

    def replica_lost(self, replica: int, reason: str) -> None:
        """`replica`'s ranks died (the supervisor says so): each request in flight there ends
        with its own 503 (the other replicas' go on), the replica takes nothing until
        `replica_ready`, and what the front end assumed it held (its pixel ledger, its prefix
        tree, its load) is forgotten, as is its requests' state in the detokenizer. Messages
        still queued for its dead ranks are dropped with their socket, and the shared files
        they (or requests its ranks had not started) carried are removed (`remove_handed`)."""
        self.dispatcher.lost(replica)
        self._to_scheduler[replica].close(linger=0)
        self._to_scheduler[replica] = self._scheduler_socket(replica)
        finish = Finish.error(f"replica {replica} failed: {reason}", 503, "replica_unavailable")
        lost = [(rid, s) for rid, s in self.states.items() if s.replica == replica and not s.lost]
        for rid, state in lost:
            state.lost = True
            self._fail(rid, state, finish)
        self.pixels[replica].forget()
        self.remove_handed(replica)
        for key in [key for key in self._replies if key[1] == replica]:
            future = self._replies.pop(key)
            if not future.done():
                future.set_result(None)  # its answer never comes: _ask leaves it out
        if lost:
            self._to_detok.send_pyobj(ForgetReqs([rid for rid, _ in lost]))
        logger.warning("replica %d lost: %d requests in flight failed", replica, len(lost))

    def replica_ready(self, replica: int) -> None:
        """`replica`'s restarted ranks reported ready: the dispatcher sends to it again."""
        self.replica_progress[replica] = time.monotonic()
        self.dispatcher.set_up(replica, True)
        logger.info("replica %d is serving again", replica)

    def _send(self, msg: ToScheduler, replica: int) -> None:
        shared: list[SharedTensor] = []
        self._to_scheduler[replica].send_multipart(to_frames(msg, shared), copy=False)
        for handle in shared:  # the scheduler ranks own these files now
            handle.hand_off()
        if shared and isinstance(msg, TokenizedGenerateReq | ItemPixels | ItemEmbeddings):
            self.handed[replica].setdefault(msg.rid, []).extend(h.path for h in shared)
            if len(self.handed[replica]) > MAX_HANDED:
                self.prune_handed(replica)

    def remove_handed(self, replica: int) -> None:
        """`replica` died: the files it was sent and may not have read (its requests queued in
        its socket or not yet started) are removed; those it read are gone already."""
        for paths in self.handed[replica].values():
            for path in paths:
                remove_file(path)
        self.handed[replica].clear()

    def prune_handed(self, replica: int) -> None:
        """Forget the requests whose files are all gone (read, or ended before they started)."""
        kept = self.handed[replica]
        for rid in [rid for rid, paths in kept.items() if not any(map(os.path.exists, paths))]:
            del kept[rid]

    # ------------------------------------------------------------------ prompts
    async def tokenize_request(self, inp: GenerateInput) -> TokenizedGenerateReq:
        """The one path from a parsed request to what the scheduler receives: the prompt, the
        media count and budgets, media preparation, placeholder expansion, the context check."""
        self.check_choices(0, inp.max_tokens, inp.n)  # before any work: outputs alone too many
        ids, media = await self.prompt_ids(inp)
        params = inp.sampling(max(1, self.budget.room(len(ids), inp.n)))
        if params.grammar is not None:  # the scheduler compiles the checked, prepared form
            params.grammar = await self.grammar.check(params.grammar)
        with self.metrics.timed("build"):
            if len(ids) <= INLINE_BUILD_IDS and all(m.modality == Modality.IMAGE for m in media):
                return self.build_request(inp.rid, ids, media, params, inp.stream)
            return await self.in_thread(
                self.build_request, inp.rid, ids, media, params, inp.stream
            )

    async def prompt_ids(self, inp: GenerateInput) -> tuple[list[int], list[PreparedMedia]]:
        """The prompt's token ids, every media item expanded to its tokens (what /tokenize
        counts), and the prepared media."""
        spec = self.media_spec(inp.mm_processor_kwargs)
        prompt, refs = await self.prompt_of(inp)
        refs = [dataclasses.replace(ref, scope=inp.media_scope) for ref in refs]
        self.check_media_count(refs)
        if prompt is None:
            return self.checked_ids(inp.input_ids or []), []
        with self.metrics.timed("tokenize"):
            ids = await self.encode_prompt(prompt)
        media = await self.prepare_media(refs, ids, inp.max_tokens, spec)
        field = "messages" if inp.messages is not None else "prompt"
        return await self.expand_ids(prompt, ids, media, field), media

    async def prompt_of(self, inp: GenerateInput) -> tuple[str | None, list[MediaRef]]:
        """The prompt text (None for token ids) and its media, placeholders in place."""
        if inp.messages is not None:
            with self.metrics.timed("template"):
                if renders_quickly(inp.messages, inp.template_kwargs):
                    return self.render_chat(inp.messages, inp.template_kwargs)
                return await self.in_thread(self.render_chat, inp.messages, inp.template_kwargs)
        if inp.text is not None:
            tokens = self.config.family.tokens
            _client_error(check_text_prompt, inp.text, tokens, param="prompt")
            modalities = [ref.modality for ref in inp.media]
            return with_placeholders(inp.text, modalities, tokens), inp.media
        if inp.media:
            raise APIError("media need a text prompt, not token ids", param="image_data")
        return None, []

    def render_chat(
        self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None
    ) -> tuple[str, list[MediaRef]]:
        """Apply the chat template (with the request's `template_kwargs`: add_generation_prompt,
        documents, the template's own kwargs); media parts become placeholders, in order."""
        hf_messages, refs = [], []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):
                content = [self._part(p, refs) for p in content]
            hf_messages.append({**m, "content": content or ""})
        kwargs = {"add_generation_prompt": True, **(template_kwargs or {})}
        try:
            prompt = self.tokenizer.apply_chat_template(
                hf_messages, chat_template=self.chat_template, tokenize=False, **kwargs
            )
        except (TemplateError, TypeError, ValueError) as e:
            message = f"the chat template cannot render these messages: {e}"
            raise APIError(message, param="messages", code="invalid_messages") from e
        self.check_modalities(refs)
        modalities = [ref.modality for ref in refs]
        _client_error(check_rendered_chat, prompt, modalities, self.config.family.tokens)
        return prompt, refs

    def _part(self, part: dict[str, Any], refs: list[MediaRef]) -> dict[str, Any]:
        kind = part.get("type")
        if kind in ("text", "input_text"):
            return {"type": "text", "text": part.get("text") or ""}
        modality = Modality.IMAGE if kind == "image_url" else Modality.VIDEO
        url = (part.get(kind) or {}).get("url", "")
        refs.append(MediaRef(modality, url, part.get("uuid")))
        return {"type": modality.value}

    def check_media_count(self, refs: list[MediaRef]) -> None:
        if len(refs) > self.args.max_images_per_request:
            raise APIError(
                f"{len(refs)} images/videos in one request; the limit is "
                f"{self.args.max_images_per_request}",
                param="messages",
                code="too_many_images",
            )
        if refs and self.mm is None:
            raise APIError("this server has no media processor", status=500)
        self.check_modalities(refs)

    def check_modalities(self, refs: list[MediaRef]) -> None:
        """Every medium is one the family takes (a 400 naming its field and saying why, where
        the family says). Checked before the rendered chat is: a template may mark a medium the
        family does not take with boundary tokens the checks would take for typed ones."""
        family = self.config.family
        why = f" ({family.refused_media_reason})" if family.refused_media_reason else ""
        for ref in refs:
            if ref.modality not in family.modalities:
                raise APIError(
                    f"{family.name} checkpoints take no {ref.modality.value} input{why}",
                    param=media_param(ref.modality),
                    code="unsupported_media",
                )

    def checked_ids(self, ids: list[int]) -> list[int]:
        if len(ids) >= self.budget.limit:  # before walking them on the event loop
            raise self.too_long(f"{len(ids)} prompt tokens")
        vocab = self.config.text.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise APIError(f"token ids must be in [0, {vocab})", param="prompt")
        _client_error(check_prompt_ids, ids, self.config, param="prompt")
        return list(ids)

    def media_spec(self, raw: dict[str, Any] | None) -> ProcessorSpec | None:
        """The request's processor settings (`mm_processor_kwargs`, checked against this
        server's limits), or None for the server's own."""
        if not raw:
            return None
        if self.mm is None:
            raise APIError("this server has no media processor", param="mm_processor_kwargs")
        return request_spec(self.mm.spec, checked_settings(raw, self.mm.spec))

    async def prepare_media(
        self,
        refs: list[MediaRef],
        ids: list[int],
        max_tokens: int | None,
        spec: ProcessorSpec | None = None,
    ) -> list[PreparedMedia]:
        """Fetch and preprocess `refs` (with the request's `spec`, else the server's); the
        images' tokens are checked against what the context leaves the prompt `ids` (from their
        headers, with the request's pixel bounds, before any is decoded)."""
        if not refs:
            return []
        budget = self.media_token_budget(ids, max_tokens)
        with self.metrics.timed("media"):  # a MediaError is the client's APIError
            return await self.mm.process(refs, budget, spec)

    def media_token_budget(self, ids: list[int], max_tokens: int | None) -> int:
        """Tokens left for the media: the budget less the text (the prompt's ids less its
        placeholders) and the tokens to generate."""
        pads = (self.config.image_token_id, self.config.video_token_id)
        text = len(ids) - sum(1 for token in ids if token in pads)
        reserve = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 1
        return self.budget.room(text + reserve)

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt)["input_ids"]

    async def encode_prompt(self, prompt: str) -> list[int]:
        """Tokenize off the event loop: refused by its length when it cannot fit; a long
        prompt in its own lane, so it delays no short one (invariant 18)."""
        if self.max_prompt_chars is not None and len(prompt) > self.max_prompt_chars:
            raise self.too_long(f"a prompt of {len(prompt)} characters")
        if len(prompt) <= INLINE_PROMPT_CHARS:
            return self._loop_tokenizer(prompt)["input_ids"]
        if len(prompt) <= LONG_PROMPT_CHARS:
            return await self.in_thread(self.encode, prompt)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._long, self.encode_long, prompt)

    def encode_long(self, prompt: str) -> list[int]:
        return self._long_tokenizer(prompt)["input_ids"]

    def check_choices(self, prompt_tokens: int, max_tokens: int | None, n: int) -> None:
        """The request's n choices must fit the KV pool together (`TokenBudget.choices_problem`,
        the rule the scheduler applies again): a 400 naming n when they never can, while one
        choice could (else the context check names the prompt and max_tokens)."""
        if max_tokens is None or self.budget.problem(prompt_tokens, max_tokens):
            return
        problem = self.budget.choices_problem(prompt_tokens, max_tokens, n)
        if problem:
            raise APIError(problem, param="n", code="kv_pool_exceeded")

    def too_long(self, what: str) -> APIError:
        return APIError(
            f"{what} cannot fit the {self.budget.limit} tokens one request may hold (context "
            f"length {self.context_length}, KV pool {self.budget.kv_tokens})",
            param="messages",
            code="context_length_exceeded",
        )

    async def expand_ids(
        self, prompt: str, ids: list[int], media: list[PreparedMedia], field: str = "messages"
    ) -> list[int]:
        """The prompt's ids with every placeholder expanded to its item's tokens: spliced into
        the ids, or (Qwen3-VL videos) the expanded text tokenized. Placeholders that do not
        match the media are a 400 naming `field`, the request's prompt field."""
        try:
            expanded = expand_placeholder_ids(ids, media, self.config)
        except ValueError as e:
            raise APIError(str(e), param=field) from e
        if expanded is None:
            expanded = await self.in_thread(self.tokenize, prompt, media, field)
        return expanded

    def tokenize(
        self, prompt: str, media: list[PreparedMedia], field: str = "messages"
    ) -> list[int]:
        """Expand each placeholder to its item's prompt text, then tokenize."""
        try:
            text = expand_placeholders(prompt, media, self.config)
        except ValueError as e:
            raise APIError(str(e), param=field) from e
        return self.encode(text)

    def build_request(
        self,
        rid: str,
        input_ids: list[int],
        media: list[PreparedMedia],
        params: SamplingParams,
        stream: bool,
    ) -> TokenizedGenerateReq:
        if not input_ids:
            raise APIError("the prompt is empty", param="messages")
        problem = self.budget.problem(len(input_ids), params.max_new_tokens)
        if problem:
            raise APIError(problem, param="messages", code="context_length_exceeded")
        self.check_choices(len(input_ids), params.max_new_tokens, params.n)
        ids, mm = build_multimodal_inputs(input_ids, media, self.config)
        if params.bad_words:
            params.bad_words_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        return TokenizedGenerateReq(rid, ids, params, mm, stream)

    # ------------------------------------------------------------------ requests
    async def generate(
        self, req: TokenizedGenerateReq, arrival: float | None = None, route: Route = Route()
    ) -> AsyncIterator[StrOutput]:
        """Send to a replica's scheduler (the dispatcher's choice, or the one `route` names)
        and yield outputs until finished; abort if abandoned. `arrival` (perf_counter) is when
        the HTTP request came in: latencies count from it. With n > 1 the outputs of the n
        choices interleave (`StrOutput.index`); it ends when every choice has.

        Inside the server the request gets a unique id (the client's id plus a serial number), so
        a client that reuses an id after its request ended never meets that request's leftovers
        in the scheduler or the detokenizer."""
        self.check_admission(req.rid)
        replica = self.choose_replica(req.input_ids, route)
        awaited = self.awaited_media(req)
        spilled = self.spills(awaited, replica)
        awaited = [] if spilled else awaited
        if not awaited:
            self.start_stall_clocks(replica)
        rid = f"{req.rid}-{next(self._serial)}"
        timeline = RequestTimeline(self.metrics, arrival or time.perf_counter())
        n = req.sampling_params.n
        state = self.states[rid] = ReqState(timeline, n=n, replica=replica, spilled=spilled)
        state.load = len(req.input_ids)
        self.client_rids.add(req.rid)
        sent = dataclasses.replace(req, rid=rid, mm_inputs=awaiting(req.mm_inputs, awaited))
        self.pixels[replica].hold(rid, sent.mm_inputs)
        self.dispatcher.sent(replica, req.input_ids)
        self._send(sent, replica)
        timeline.stage("send", time.perf_counter() - timeline.arrival)  # arrival -> scheduler
        encoding = self.start_encoding(rid, state, awaited)
        try:
            ended = 0
            while ended < n:
                out = await state.queue.get()
                timeline.output(len(out.token_ids))
                if out.index == 0:  # every choice times its own prefill; the first one counts
                    timeline.scheduler_stages(out.stages)
                ended += out.finish_reason is not None
                if ended == n and out.finish_reason.completed:
                    timeline.finish(out.prompt_tokens)
                yield out
        finally:
            if encoding is not None:
                encoding.cancel()  # its jobs' files go with it; a late answer is dropped
            if not state.finished:
                self._send(AbortReq(rid), replica)
            self.states.pop(rid, None)
            self.client_rids.discard(req.rid)
            if not state.lost:  # else the replica's ledger and view were reset when it died
                self.pixels[replica].release(rid)
                tracks = self.dispatcher.tracks_prefixes
                cached = [*req.input_ids, *state.output_ids] if tracks else []
                self.dispatcher.ended(replica, cached, state.load)

    def awaited_media(self, req: TokenizedGenerateReq) -> list[MultimodalDataItem]:
        """With --encoder-urls: the request's items the encoder servers encode (the request
        goes to its replica at once, without them: `awaiting`)."""
        mm = req.mm_inputs
        if self.encoders is None or mm is None:
            return []
        return [i for i in mm.items if i.feature is not None and not i.embedded]

    def spills(self, items: list[MultimodalDataItem], replica: int) -> bool:
        """--encoder-fallback spill: the request's media go to its replica's own tower instead
        of the encoder servers when every one of them is busy and the replica neither decodes
        (no running chat's next token waits behind the encode) nor encodes another spilled
        request, i.e. when its tower would otherwise sit idle while the media queue. `items`:
        the request's media for the encoder servers (`awaited_media`); a spill is counted."""
        if self.args.encoder_fallback != "spill" or not items:
            return False
        assert self.encoders is not None
        if not self.encoders.busy():
            return False
        mine = [s for s in self.states.values() if s.replica == replica and not s.finished]
        if any(s.started or s.spilled for s in mine):
            return False
        self.encoders.spilled += 1
        return True

    def start_encoding(
        self, rid: str, state: ReqState, items: list[MultimodalDataItem]
    ) -> asyncio.Task | None:
        """The encoder jobs of a request already sent, beside its wait for outputs."""
        if not items:
            return None
        state.encoding = True
        return asyncio.ensure_future(self.deliver_media(rid, state, items))

    async def deliver_media(
        self, rid: str, state: ReqState, items: list[MultimodalDataItem]
    ) -> None:
        """The request's items encoded by the encoder servers, their rows then sent to its
        replica (`ItemEmbeddings`), whose scheduler prefills the text before them meanwhile. No
        server answers: with --encoder-fallback local the pixels go instead and the ranks
        encode them, else the request ends with its own 503 (`end_unencoded`)."""
        embedded = True
        try:
            with self.metrics.timed("encode"):
                await self.encoders.embed(items)
        except EncoderUnavailable as exc:
            if self.args.encoder_fallback == "none":
                message = f"no encoder server could encode the media: {exc}"
                return self.end_unencoded(rid, state, message, 503)
            logger.warning("request %s: %s; its ranks encode its media", rid, exc)
            embedded = False
        except EncoderRefused as exc:
            message = f"the encoder server refused the media: {exc}"
            return self.end_unencoded(rid, state, message, 500)
        if not (state.finished or state.lost):
            self.start_stall_clocks(state.replica)
            state.encoding = False
            features = {item.hash: item.feature for item in items}
            self._send(ItemEmbeddings(rid, features, embedded), state.replica)

    def end_unencoded(self, rid: str, state: ReqState, message: str, status: int) -> None:
        """The request's media could not be encoded after it was sent: it is aborted on its
        ranks (which free what it holds) and ends with its own error."""
        if state.finished or state.lost:
            return
        self._send(AbortReq(rid), state.replica)
        code = "encoder_unavailable" if status == 503 else "internal_error"
        self._fail(rid, state, Finish.error(message, status, code))

    def choose_replica(self, ids: list[int], route: Route) -> int:
        """The replica for a prompt of `ids` (503 when none serves, or the one named)."""
        try:
            return self.dispatcher.choose(ids, route)
        except LookupError as e:
            raise APIError(str(e), status=503, code="replica_unavailable", retry_after=1) from e

    def check_admission(self, rid: str) -> None:
        """503 while shutting down or when too many requests wait; 409 for an id in flight."""
        if self.fatal is not None:
            raise APIError(self.fatal, status=503, code="server_shutdown")
        if rid in self.client_rids:
            raise APIError(
                f"a request with id {rid} is still in flight",
                status=409,
                param="rid",
                code="duplicate_request_id",
            )
        queued = sum(not s.started for s in self.states.values())
        if queued >= self.args.max_queued_requests:
            raise APIError(
                f"{queued} requests are waiting to start; try again shortly",
                status=503,
                code="server_overloaded",
                retry_after=1,
            )

    def media_info(self) -> dict[str, object] | None:
        """/server_info's media: the processed-item cache and the pixels sent to the ranks."""
        if self.mm is None:
            return None
        ledgers = [ledger.info() for ledger in self.pixels]
        info = self.mm.info() | {k: sum(info[k] for info in ledgers) for k in ledgers[0]}
        if self.encoders is not None:
            info["encoder_servers"] = self.encoders.info()
        return info

    def stalled(self) -> bool:
        """Requests are running and nothing came back for --health-stall-timeout seconds. A
        finished request whose client has not taken its output yet is not running: a stalled
        client is not a stalled server."""
        quiet = time.monotonic() - self.last_progress
        if quiet <= self.args.health_stall_timeout:
            return False
        return self.running()

    def running(self) -> bool:
        return any(state.awaits_output for state in self.states.values())

    def busy(self, replica: int) -> bool:
        """Some request on `replica` has a choice that has not ended (and is not encoding)."""
        return any(s.replica == replica and s.awaits_output for s in self.states.values())

    def start_stall_clocks(self, replica: int) -> None:
        """`replica` is about to owe a request output: where it owed none, its stall clock
        (and the server's) starts now."""
        now = time.monotonic()
        if not self.running():
            self.last_progress = now
        if not self.busy(replica):
            self.replica_progress[replica] = now

    def healthy(self) -> bool:
        """/health: one replica: not stalled (`stalled`); several: some replica serves and is
        not stalled (a stalled one is killed and restarted: `_watch_stalls`)."""
        if self.args.dp_size == 1:
            return not self.stalled()
        stalled = self.stalled_replicas()
        views = self.dispatcher.replicas
        return any(view.up and r not in stalled for r, view in enumerate(views))

    def stalled_replicas(self) -> list[int]:
        """The serving replicas with requests running whose last output is older than
        --health-stall-timeout seconds."""
        now, limit = time.monotonic(), self.args.health_stall_timeout
        busy = {s.replica for s in self.states.values() if s.awaits_output}
        views = self.dispatcher.replicas
        return [r for r in sorted(busy) if views[r].up and now - self.replica_progress[r] > limit]

    async def _watch_stalls(self) -> None:
        """With --dp > 1: a replica that stalls (`stalled_replicas`) is killed through the
        supervisor, which then fails its requests and restarts it as after any death."""
        limit = self.args.health_stall_timeout
        reason = f"no output for {limit:g}s with requests in flight"
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            for replica in self.stalled_replicas():
                self.replica_progress[replica] = time.monotonic()  # one kill per stall
                logger.error("replica %d stalled (%s): killing its ranks", replica, reason)
                self.replicas.kill(replica, reason)

    async def _ask(self, msg: ToScheduler, reply: type, timeout: float = 30.0) -> list[Any]:
        """Ask every replica that serves; their replies, in replica order (a replica that dies
        before it answers is left out)."""
        replicas = [r for r, view in enumerate(self.dispatcher.replicas) if view.up]
        async with self._reply_lock:
            loop = asyncio.get_running_loop()
            futures = [loop.create_future() for _ in replicas]
            for replica, future in zip(replicas, futures, strict=True):
                self._replies[(reply, replica)] = future
                self._send(msg, replica)
            replies = await asyncio.wait_for(asyncio.gather(*futures), timeout)
            return [r for r in replies if r is not None]

    def replicas_info(self, infos: list[ServerInfo]) -> list[dict[str, object]]:
        """/server_info's replicas: each one's state as the front end sees it (up, requests
        routed, load, prefix tree) and as its entry rank reports it (KV, queue, caches)."""
        reported = {info.replica: info for info in infos}
        status = self.replicas.status() if self.replicas is not None else {}
        out = []
        for replica in range(self.args.dp_size):
            entry: dict[str, object] = {"replica": replica, **self.dispatcher.info(replica)}
            entry |= status.get(replica, {"state": "up", "restarts": 0, "pids": []})
            info = reported.get(replica)
            if info is not None:
                entry |= replica_summary(info)
            entry["pixels"] = self.pixels[replica].info()
            out.append(entry)
        return out

    async def server_infos(self) -> list[ServerInfo]:
        """Each serving replica's counters (its entry rank's), in replica order."""
        return await self._ask(GetServerInfoReq(), ServerInfo)

    async def server_info(self) -> ServerInfo:
        """The replicas' counters added up (one replica: its own)."""
        return ServerInfo.total(await self.server_infos())

    async def flush_cache(self) -> FlushCacheOut:
        """Flush every replica (each refuses while it runs requests); the dispatcher forgets
        what the flushed ones cached."""
        outs = await self._ask(FlushCacheReq(), FlushCacheOut)
        for out in outs:
            if out.success:
                self.dispatcher.flushed(out.replica)
        refused = [f"replica {o.replica}: {o.message}" for o in outs if not o.success]
        if self.args.dp_size == 1 or not refused:
            return outs[0] if len(outs) == 1 else FlushCacheOut(not refused)
        return FlushCacheOut(False, "; ".join(refused))
