"""ServerArgs: every setting of a tessera server, typed, parsed once and frozen.

"auto" values are resolved at parse time (`resolve()`); derived values are properties. Each
process receives the object (or the parts it needs) explicitly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kernels.availability import flashinfer_problem
from runtime.cpus import auto_media_workers, usable_cpus
from runtime.families import family_for
from runtime.logging_utils import get_logger

logger = get_logger(__name__)

MAX_DEFAULT_GRAPH_BS = 256  # captured decode sizes by default: up to this many requests
CPU_LINEAR_PATHS = ("onednn", "aten")  # runtime/layers/linear.py


def _opt(help: str, **kw) -> dataclasses.Field:  # noqa: A002 - mirrors argparse
    return field(default=kw.pop("default", None), metadata={"help": help, **kw})


def _count_or_auto(text: str) -> int | str:
    """A flag's value: a count, or "auto" (resolved by `ServerArgs.resolve`)."""
    return text if text == "auto" else int(text)


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = _opt("checkpoint folder; default: a generated tiny Qwen2-VL")
    tp_size: int = _opt("tensor-parallel ranks", default=1, flag="--tp")
    dp_size: int = _opt(
        "data-parallel replicas, each a TP group of --tp ranks with its own KV pool and caches "
        "(on GPUs replica r takes devices r*tp .. (r+1)*tp-1), behind one front end",
        default=1,
        flag="--dp",
        aliases=("--dp-size", "--data-parallel-size"),
    )
    dp_policy: str = _opt(
        "which replica takes a request: cache_aware (the longest cached prefix, image pad "
        "values included, unless the replicas' loads are out of balance), round_robin, or "
        "shortest_queue (the fewest tokens in flight)",
        default="cache_aware",
        choices=["cache_aware", "round_robin", "shortest_queue"],
    )
    dp_cache_threshold: float = _opt(
        "cache_aware: a cached prefix counts only when it covers more than this share of the "
        "prompt (else the least loaded replica)",
        default=0.3,
    )
    dp_balance_abs_tokens: int = _opt(
        "cache_aware: the loads (tokens in flight) are out of balance, and the least loaded "
        "replica takes the request, when the largest is this many above the smallest and "
        "--dp-balance-rel times it", default=4096
    )
    dp_balance_rel: float = _opt("cache_aware: see --dp-balance-abs-tokens", default=1.5)
    mm_enable_dp_encoder_flag: bool = _opt(
        "run the vision encoder data-parallel (same as --mm-encoder-mode dp)",
        default=False,
        flag="--mm-enable-dp-encoder",
    )
    mm_encoder_mode: str = _opt(
        "vision encoder: tp (sharded), dp (replicated, items balanced), or auto (replicated; "
        "each call runs DP, TP or a hybrid, by a cost model calibrated at start-up)",
        default="tp",
        choices=["tp", "dp", "auto"],
    )
    mm_encoder_costs: str | None = _opt(
        "auto encoder mode: JSON (inline or a file path) with the cost model, instead of the "
        "start-up calibration"
    )
    host: str = _opt("HTTP host", default="127.0.0.1")
    port: int = _opt("HTTP port", default=30000)
    device: str = _opt("device", default="auto", choices=["auto", "cpu", "cuda"])
    dtype: str = _opt(
        "weights/activation dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    attention_backend: str = _opt(
        "kernels: torch, or triton for attention, RMSNorm, rotary and vision attention, or "
        "flashinfer (CUDA only) for the decoder's attention with triton for the rest "
        "(auto: triton on CUDA, torch on CPU)",
        default="auto",
        choices=["auto", "torch", "triton", "flashinfer"],
    )
    cpu_linear: str = _opt(
        "CPU linear layers: onednn (float32/bf16 weights packed once at load for oneDNN's "
        "matmul) or aten (aten's own path, MKL); GPU weights are never packed",
        default="onednn",
        choices=list(CPU_LINEAR_PATHS),
    )
    disable_vit_mlp_padding: bool = _opt(
        "keep the vision tower's MLP hidden size as the checkpoint has it on CUDA (by default "
        "it is zero-padded where its rows are not 16-byte aligned, e.g. Qwen2.5-VL's 3420)",
        default=False,
    )
    cuda_graph_max_bs: int | None = _opt(
        "largest decode batch replayed as a CUDA graph (padded to 1, 2, 4, 8, 16, 24, ...); "
        "larger batches run eagerly (default: --max-running-requests, at most 256)",
        type=int,
    )
    disable_cuda_graph: bool = _opt(
        "run every decode step eagerly (CUDA graphs are on by default on CUDA, off on CPU)",
        default=False,
    )
    disable_overlap_schedule: bool = _opt(
        "read each decode step's tokens before launching the next (by default a GPU launches "
        "a plain greedy decode step before reading the last one's tokens; with CUDA graphs)",
        default=False,
    )
    cpu_decode_threads: int = _opt(
        "intra-op threads of a CPU decode step (and of a step whose new prompt tokens are few); "
        "0: one thread under 2^32 multiply-adds a step, every rank thread above",
        default=0,
    )
    chunked_prefill_size: int = _opt("max prompt tokens of one request per step", default=2048)
    max_prefill_tokens: int = _opt("max prompt tokens of one prefill batch", default=8192)
    max_running_requests: int = _opt("max requests decoding at once", default=64)
    max_total_tokens: int | None = _opt("KV pool size in tokens (default: from memory)", type=int)
    mem_fraction_static: float = _opt(
        "GPU memory share for the weights, the encoder cache and the KV pool; the rest (or "
        "more, when the estimated activation peak needs it) stays free for activations, CUDA "
        "graphs and NCCL (docs/gpu.md)",
        default=0.85,
    )
    context_length: int | None = _opt("max prompt + output tokens per request", type=int)
    enable_mixed_chunk: bool = _opt(
        "mixed steps (the default; --disable-mixed-chunk turns them off): the running decodes "
        "join each prefill step's forward as one-token extends, so they keep flowing while "
        "images are encoded and prefilled, and while they run a prefill step computes at most "
        "--chunked-prefill-size prompt tokens",
        default=True,
        off_flag="--disable-mixed-chunk",
    )
    max_encoder_patches_per_step: int = _opt(
        "vision patches one prefill step may encode: a step always takes its first image or "
        "video request, and further media requests only while their patches fit, so a burst "
        "of images is encoded over several steps (text prompts behind them and, with mixed "
        "steps, the running requests' tokens go on meanwhile); 0: no bound",
        default=0,
    )
    disable_jump_forward: bool = _opt(
        "structured outputs: decode the tokens a grammar forces one step each instead of "
        "computing each forced run as one extend",
        default=False,
    )
    grammar_ms_per_token: float = _opt(
        "structured outputs: the entry rank's CPU time one request's grammar may take (mask "
        "fills and token accepts), in ms per token it produced, counted over at least 100 "
        "tokens; a grammar over it ends its request with a 400 (0: no bound)",
        default=10.0,
    )
    schedule_policy: str = _opt("waiting-queue order", default="fcfs", choices=["fcfs", "lpm"])
    disable_radix_cache: bool = _opt("turn off prefix caching", default=False)
    mm_cache_size_mb: int = _opt("encoder output cache size (0 disables)", default=256)
    max_images_per_request: int = _opt("media items per request", default=16)
    max_content_parts: int = _opt(
        "messages plus content parts of one chat request (400 beyond, before validation)",
        default=2048,
    )
    media_workers: int | str = _opt(
        "media worker processes (decode, resize, patchify); auto: on CUDA the CPUs this "
        "process may run on (its affinity mask) less one per TP rank on this node and one for "
        "the front end, at least 1 and at most 16; on CPU up to 4, sharing the ranks' cores",
        default="auto",
        type=_count_or_auto,
        metavar="N|auto",
    )
    mm_max_concurrent_calls: int = _opt("concurrent media preprocessing calls", default=32)
    mm_per_request_timeout: float = _opt(
        "seconds to fetch and preprocess one request's media", default=30.0
    )
    mm_max_fetches_per_request: int = _opt(
        "media URLs of one request fetched at once (of 16 fetch threads)", default=4
    )
    mm_processor_cache_gb: float = _opt(
        "processed media kept in the front end by digest, in GiB (at most a quarter of "
        "/dev/shm), so a resent image skips decoding; 0 disables",
        default=1.0,
    )
    mm_max_inflight_mb: int = _opt(
        "decoded media bytes in flight across all requests, in MiB (beyond: wait, then 503)",
        default=4096,
    )
    allowed_local_media_path: str | None = _opt("folder from which file:// media may be read")
    allow_private_media_urls: bool = _opt(
        "let media URLs reach loopback, private and link-local addresses (off: refused)",
        default=False,
    )
    allowed_media_domains: str | None = _opt(
        "comma-separated host names media URLs may name (default: any public host)"
    )
    media_trust_env: bool = _opt(
        "let media fetches use proxies, .netrc and SSL_CERT_FILE from the environment",
        default=False,
    )
    media_cpu_seconds: float = _opt(
        "CPU seconds one image or video may take to decode and preprocess (beyond: a 400, and "
        "its media worker is replaced)",
        default=10.0,
    )
    media_fetch_timeout: float = _opt(
        "seconds for one media URL fetch: connect, headers, body and redirects", default=10.0
    )
    api_key: tuple[str, ...] = _opt(
        "bearer token required by the HTTP API; give it again for more keys (one per tenant: "
        "client media ids are scoped to the key presented); see --api-key-file",
        default=(),
        action="append",
    )
    api_key_file: str | None = _opt(
        "file holding the bearer tokens, one per line (keeps them out of the process list)"
    )
    max_request_bytes: int = _opt(
        "largest HTTP request body in bytes (413 beyond); default 64 MiB", default=64 << 20
    )
    http_max_header_bytes: int = _opt(
        "largest request line plus headers of one HTTP request, in bytes (431 beyond)",
        default=64 << 10,
    )
    http_header_timeout: float = _opt(
        "seconds from a request's first byte to the end of its headers (408 beyond)",
        default=10.0,
    )
    http_body_timeout: float = _opt(
        "seconds from a request's headers to the end of its body (408 beyond)", default=60.0
    )
    http_keep_alive_timeout: float = _opt(
        "seconds an idle keep-alive connection stays open", default=5.0
    )
    http_max_connections: int = _opt(
        "open HTTP connections; a connection beyond them gets 503 and is closed", default=1024
    )
    http_send_buffer_bytes: int = _opt(
        "response bytes buffered per connection for a client that does not read, in the kernel "
        "and again in the server (past them, writes wait for the client)",
        default=256 << 10,
    )
    http_send_timeout: float = _opt(
        "seconds a response may wait for a client that stopped reading; then the connection "
        "is dropped and its request aborted",
        default=30.0,
    )
    served_model_name: str | None = _opt("model name reported by the API")
    generation_config: str = _opt(
        "auto: the checkpoint's generation_config.json gives the defaults of temperature, "
        "top_p, top_k, min_p, repetition_penalty and max_tokens a request leaves unset; vllm: "
        "tessera's own defaults (its EOS ids stop requests either way)",
        default="auto",
        choices=["auto", "vllm"],
    )
    reasoning_parser: str | None = _opt(
        "split the thinking section of chat replies into reasoning_content: qwen3 (a reply "
        "that opens <think>), deepseek_r1 (the template opened <think> in the prompt), glm45 "
        "(GLM-4.1V-Thinking: qwen3's, and <answer> tags dropped from the content), auto (the "
        "checkpoint family's own rule, none if it has none)",
        choices=["qwen3", "deepseek_r1", "glm45", "auto"],
    )
    log_level: str = _opt("log level", default="info")
    random_seed: int = _opt("seed for sampling without a per-request seed", default=0)
    nnodes: int = _opt("nodes", default=1)
    node_rank: int = _opt("this node's rank", default=0)
    dist_init_addr: str | None = _opt("host:port of the torch.distributed rendezvous")
    ipc_dir: str | None = _opt("folder for ipc:// sockets (default: a fresh temp folder)")
    ready_timeout: float = _opt("seconds to wait for every child to report ready", default=600.0)
    max_queued_requests: int = _opt(
        "requests waiting for their first token beyond which new ones get 503", default=256
    )
    health_stall_timeout: float = _opt(
        "seconds without any output while requests are in flight before /health says 503 "
        "(with --dp: before the replica whose requests get no output is killed and restarted)",
        default=60.0,
    )
    replica_max_restarts: int = _opt(
        "with --dp: restarts of a replica whose rank died, within --replica-restart-window "
        "seconds, before it stays down",
        default=3,
    )
    replica_restart_window: float = _opt(
        "with --dp: the window, in seconds, over which --replica-max-restarts counts",
        default=600.0,
    )
    encoder_only: bool = _opt(
        "serve only the checkpoint's vision tower (and projector) as an encoder server: encode "
        "jobs over ZMQ on tcp://--host:--port, embeddings back by digest; no HTTP, no decoder",
        default=False,
    )
    encoder_urls: str | None = _opt(
        "encoder servers (tcp://host:port or ipc://path, comma-separated) that encode this "
        "server's images and videos; the ranks then do not load the vision tower"
    )
    encoder_fallback: str = _opt(
        "with --encoder-urls: when no encoder server answers a job, none (the requests fail "
        "with 503) or local (the ranks keep their own tower and encode it themselves); spill: "
        "local, and also a request whose replica decodes nothing while every encoder server is "
        "busy is encoded by the replica's own tower",
        default="none",
        choices=["none", "local", "spill"],
    )
    encoder_timeout: float = _opt(
        "with --encoder-urls: seconds for one encode job on one encoder server", default=60.0
    )
    encoder_retries: int = _opt(
        "with --encoder-urls: encoder servers one job is tried on after the first", default=2
    )
    encoder_secret: str | None = _opt(
        "key of the HMAC every encoder-channel message carries (required where it leaves the "
        "machine); see --encoder-secret-file"
    )
    encoder_secret_file: str | None = _opt("file whose first line is --encoder-secret")

    # ------------------------------------------------------------------ derived
    @property
    def mm_enable_dp_encoder(self) -> bool:
        """True when the vision tower is a full replica per rank run data-parallel (dp mode)."""
        return self.mm_encoder_mode == "dp"

    @property
    def encoder_url_list(self) -> tuple[str, ...]:
        """--encoder-urls, one URL each (empty: the ranks run their own tower)."""
        urls = (self.encoder_urls or "").split(",")
        return tuple(url.strip() for url in urls if url.strip())

    @property
    def loads_tower(self) -> bool:
        """Whether the scheduler ranks load the vision tower (not with --encoder-urls, unless
        --encoder-fallback local or spill keeps it)."""
        return not self.encoder_url_list or self.encoder_fallback != "none"

    @property
    def encoder_key(self) -> bytes | None:
        """The encoder channel's HMAC key (None: messages carry no mac)."""
        return self.encoder_secret.encode() if self.encoder_secret else None

    @property
    def encoder_bind_url(self) -> str:
        """Where an encoder server (--encoder-only) takes jobs."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    @property
    def use_cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def decode_graph_bs(self) -> int:
        """The largest decode batch replayed as a CUDA graph; 0: none (CPU, turned off, or the
        FlashInfer backend, which plans each step on the host)."""
        if self.disable_cuda_graph or not self.use_cuda or self.attention_backend == "flashinfer":
            return 0
        return self.cuda_graph_max_bs or min(self.max_running_requests, MAX_DEFAULT_GRAPH_BS)

    @property
    def overlap_schedule(self) -> bool:
        """Whether decode steps overlap (scheduler/overlap.py): on CUDA, over decode graphs,
        unless turned off."""
        return not self.disable_overlap_schedule and self.decode_graph_bs > 0

    @property
    def ranks_per_node(self) -> int:
        """Scheduler ranks on this node: every replica's TP ranks (or this node's share of the
        one TP group across --nnodes)."""
        return self.dp_size * self.tp_size // self.nnodes

    def ipc_name(self, what: str) -> str:
        """A ZMQ ipc path in a private folder: never a TCP port (invariant 15)."""
        return f"ipc://{os.path.join(self.ipc_dir or tempfile.gettempdir(), f'tessera-{what}')}"

    def scheduler_ipc(self, replica: int) -> str:
        """Where replica `replica`'s entry rank takes its requests."""
        return self.ipc_name(f"scheduler-dp{replica}")

    @property
    def scheduler_input_ipc(self) -> str:
        """Replica 0's input (the only one with --dp 1)."""
        return self.scheduler_ipc(0)

    @property
    def detokenizer_ipc(self) -> str:
        return self.ipc_name("detokenizer")

    @property
    def tokenizer_ipc(self) -> str:
        return self.ipc_name("tokenizer")

    # ------------------------------------------------------------------ parsing
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            meta = dict(f.metadata)
            flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
            aliases = meta.pop("aliases", ())
            if f.type == "bool":
                if f.default is True and "off_flag" not in meta:  # else nothing could turn it off
                    raise TypeError(f"ServerArgs.{f.name} is on by default and needs an off_flag")
                parser.add_argument(flag, dest=f.name, action="store_true", help=meta["help"])
                if "off_flag" in meta:  # on by default: the flag is accepted, this one turns off
                    parser.add_argument(meta["off_flag"], dest=f.name, action="store_false")
                parser.set_defaults(**{f.name: f.default})
                continue
            kind = meta.pop("type", None) or {"int": int, "float": float}.get(str(f.type), str)
            default = None if meta.get("action") == "append" else f.default
            parser.add_argument(flag, *aliases, dest=f.name, type=kind, default=default, **meta)

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> ServerArgs:
        parser = argparse.ArgumentParser(description="Serve a vision-language model with tessera")
        cls.add_cli_args(parser)
        ns = parser.parse_args(argv)
        return cls(**vars(ns)).resolve()

    def resolve(self) -> ServerArgs:
        """Fill "auto" values and check the settings; returns a new frozen object."""
        device = resolve_device(self.device, self.tp_size, _cuda_count(), self.dp_size)
        backend = self.attention_backend
        if backend == "auto":
            backend = "torch" if device == "cpu" else _best_gpu_backend()
        if backend == "flashinfer":
            _check_flashinfer(device)
        ipc_dir = _private_dir(self.ipc_dir)
        out = dataclasses.replace(
            self,
            device=device,
            attention_backend=backend,
            ipc_dir=ipc_dir,
            media_workers=self._media_workers(device),
            reasoning_parser=self._reasoning_parser(),
            api_key=self._read_api_key(),
            api_key_file=None,
            encoder_secret=self._read_encoder_secret(),
            encoder_secret_file=None,
        )
        out.check()
        return out

    def _media_workers(self, device: str) -> int | str:
        if self.media_workers != "auto":
            return self.media_workers
        node_ranks = max(1, self.ranks_per_node)
        return auto_media_workers(len(usable_cpus()), node_ranks, device == "cuda")

    def _reasoning_parser(self) -> str | None:
        """`auto`: the rule the checkpoint's family declares (`Family.reasoning_parser`)."""
        if self.reasoning_parser != "auto":
            return self.reasoning_parser
        path = Path(self.model_path or "") / "config.json"
        if self.model_path is None or not path.is_file():  # the built-in tiny Qwen2-VL, or
            return None  # no checkpoint, which loading it reports
        return family_for(json.loads(path.read_text())).reasoning_parser

    def _read_encoder_secret(self) -> str | None:
        if self.encoder_secret_file is None:
            return self.encoder_secret
        if self.encoder_secret:
            raise ValueError("give --encoder-secret or --encoder-secret-file, not both")
        secret = Path(self.encoder_secret_file).read_text().partition("\n")[0].strip()
        if not secret:
            raise ValueError(f"--encoder-secret-file {self.encoder_secret_file}: empty first line")
        return secret

    def _read_api_key(self) -> tuple[str, ...]:
        if self.api_key_file is None:
            return self.api_key
        if self.api_key:
            raise ValueError("give --api-key or --api-key-file, not both")
        lines = Path(self.api_key_file).read_text().splitlines()
        keys = tuple(key for line in lines if (key := line.strip()))
        if not keys:
            raise ValueError(f"--api-key-file {self.api_key_file} is empty")
        return keys

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_key", _as_keys(self.api_key))
        # --mm-enable-dp-encoder is folded into the one encoder-mode field however the object
        # is made (CLI, constructor, dataclasses.replace), so readers see a single answer.
        if not self.mm_enable_dp_encoder_flag:
            return
        if self.mm_encoder_mode == "auto":
            raise ValueError("--mm-enable-dp-encoder contradicts --mm-encoder-mode auto")
        object.__setattr__(self, "mm_encoder_mode", "dp")
        object.__setattr__(self, "mm_enable_dp_encoder_flag", False)

    def check(self) -> None:
        positive = ["tp_size", "dp_size", "chunked_prefill_size", "max_prefill_tokens"]
        positive.append("max_running_requests")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.dp_size > 1 and self.nnodes > 1:
            raise ValueError(
                "--dp with --nnodes is not built: serve one replica per node behind a router"
            )
        if not 0 <= self.dp_cache_threshold <= 1:
            raise ValueError("--dp-cache-threshold must be between 0 and 1")
        if self.dp_balance_abs_tokens < 0 or self.dp_balance_rel < 1:
            raise ValueError("--dp-balance-abs-tokens must be >= 0 and --dp-balance-rel >= 1")
        if self.max_content_parts < 1:
            raise ValueError("--max-content-parts must be at least 1")
        if self.replica_max_restarts < 0 or self.replica_restart_window <= 0:
            raise ValueError("--replica-max-restarts must be >= 0, --replica-restart-window > 0")
        if self.max_queued_requests < 1:
            raise ValueError("--max-queued-requests must be at least 1")
        if self.max_encoder_patches_per_step < 0:
            raise ValueError("--max-encoder-patches-per-step must be at least 0 (0: no bound)")
        if self.grammar_ms_per_token < 0:
            raise ValueError("--grammar-ms-per-token must be at least 0 (0: no bound)")
        if self.mm_cache_size_mb < 0:
            raise ValueError("--mm-cache-size-mb must be 0 (off) or positive")
        if self.mm_processor_cache_gb < 0:
            raise ValueError("--mm-processor-cache-gb must be 0 (off) or positive")
        if self.mm_encoder_mode not in ("tp", "dp", "auto"):
            raise ValueError(f"--mm-encoder-mode {self.mm_encoder_mode!r}: tp, dp or auto")
        if self.mm_encoder_costs is not None and self.mm_encoder_mode != "auto":
            raise ValueError("--mm-encoder-costs applies only to --mm-encoder-mode auto")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError("--max-total-tokens must be at least 16")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError("--mem-fraction-static must be between 0 and 1")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError("--cuda-graph-max-bs must be at least 1 (--disable-cuda-graph: none)")
        if self.cpu_decode_threads < 0:
            raise ValueError("--cpu-decode-threads must be 0 (by step size) or positive")
        if not isinstance(self.media_workers, int) or self.media_workers < 1:
            raise ValueError(f"--media-workers {self.media_workers!r}: auto or at least 1")
        if self.max_request_bytes < 1024:
            raise ValueError("--max-request-bytes must be at least 1024")
        self.check_http()
        self.check_encoder()

    def check_encoder(self) -> None:
        if self.encoder_only and self.encoder_urls:
            raise ValueError("--encoder-only serves a tower: it takes no --encoder-urls")
        if self.encoder_only and self.dp_size > 1:
            raise ValueError("--encoder-only with --dp is not built: start one server per pool")
        if self.encoder_timeout <= 0 or self.encoder_retries < 0:
            raise ValueError("--encoder-timeout must be positive, --encoder-retries >= 0")

    def check_http(self) -> None:
        if self.http_max_header_bytes < 1024:
            raise ValueError("--http-max-header-bytes must be at least 1024")
        if self.http_max_connections < 1:
            raise ValueError("--http-max-connections must be at least 1")
        if self.http_send_buffer_bytes < 4096:
            raise ValueError("--http-send-buffer-bytes must be at least 4096")
        timeouts = ["header", "body", "keep_alive", "send"]
        for name in timeouts:
            if getattr(self, f"http_{name}_timeout") <= 0:
                raise ValueError(f"--http-{name.replace('_', '-')}-timeout must be positive")


def _private_dir(path: str | None) -> str:
    """The IPC folder, private to this user (0700): a fresh temporary one when none is given."""
    if path is None:
        return tempfile.mkdtemp(prefix="tessera-ipc-")  # created 0700
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.stat(path).st_mode & 0o077:
        raise ValueError(f"--ipc-dir {path} must be private to this user (chmod 700)")
    return path


def _as_keys(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """--api-key as a tuple, however it was given: one key (a string), several (a list from
    the command line), or none."""
    keys = () if value is None else (value,) if isinstance(value, str) else tuple(value)
    if any(not key for key in keys):
        raise ValueError("--api-key must not be empty")
    return keys


def resolve_device(requested: str, tp_size: int, visible_gpus: int, dp_size: int = 1) -> str:
    """"cuda" or "cpu" for --device `requested` with `visible_gpus` CUDA devices.

    Every rank of every replica needs a GPU of its own (replica r's ranks take devices r*tp ..
    (r+1)*tp-1): --device cuda with fewer is an error; --device auto takes the GPUs when there
    are enough, runs on CPU when there are none, and says so with a warning when there are some
    but fewer than --dp x --tp (CPU is then surely not what was meant)."""
    if requested == "cpu":
        return "cpu"
    needed = tp_size * dp_size
    if visible_gpus >= needed:
        return "cuda"
    asked = f"--tp {tp_size}" if dp_size == 1 else f"--dp {dp_size} x --tp {tp_size}"
    shortfall = f"{asked} needs {needed} GPUs but {visible_gpus} are visible"
    if requested == "cuda":
        raise ValueError(f"--device cuda: {shortfall} (CUDA_VISIBLE_DEVICES, --dp, --tp)")
    if visible_gpus:
        logger.warning(
            "--device auto: %s; running on CPU. Ask for %d GPUs or fewer, make more visible, "
            "or --device cpu to mean it.", shortfall, visible_gpus
        )
    return "cpu"


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_flashinfer(device: str) -> None:
    problem = flashinfer_problem(device)
    if problem:
        raise ValueError(problem)


def _best_gpu_backend() -> str:
    # The Triton kernels until the FlashInfer backend has been measured on a GPU (docs/gpu.md).
    return "triton"
