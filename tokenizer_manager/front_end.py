"""The front end of the main process, built by one factory from `ServerArgs`.

`build_front_end` builds what the main process serves with: the media processor
(`AsyncMMDataProcessor.from_server_args`, or what the caller's `media` factory makes, or none),
the `TokenizerManager` over it, and the HTTP app over that (`http.server.create_app`).
`FrontEnd.start` waits for the media workers and connects the TokenizerManager to the scheduler
and the detokenizer; `FrontEnd.uvicorn_config` is the bounded HTTP server's config
(`http.connection_limits`); `FrontEnd.close` stops the TokenizerManager and the media workers.
launch.py serves what this returns, and the tests and benchmarks that need a real
TokenizerManager build it here too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.server_args import ServerArgs
from tokenizer_manager.http.connection_limits import ConnectionLimits, uvicorn_config
from tokenizer_manager.http.server import create_app
from tokenizer_manager.media.mm_processor import AsyncMMDataProcessor
from tokenizer_manager.tokenizer_manager import ReplicaControl, TokenizerManager

if TYPE_CHECKING:
    from fastapi import FastAPI

MediaFactory = Callable[[ServerArgs], AsyncMMDataProcessor]


@dataclass(eq=False)
class FrontEnd:
    """The media processor (None: text only), the TokenizerManager and the HTTP app."""

    args: ServerArgs
    mm: AsyncMMDataProcessor | None
    tm: TokenizerManager
    app: FastAPI

    async def start(self) -> None:
        """Wait until every media worker has started, then open the IPC sockets."""
        if self.mm is not None:
            await self.mm.warmup()
        await self.tm.start()

    def uvicorn_config(self, **kwargs: Any) -> Any:
        """The uvicorn config of the app, with the connection bounds the flags set."""
        limits = ConnectionLimits.from_server_args(self.args)
        args = self.args
        return uvicorn_config(
            self.app, args.host, args.port, limits, log_level=args.log_level, **kwargs
        )

    async def close(self) -> None:
        """Stop the TokenizerManager, which stops the media processor with it."""
        await self.tm.close()


def build_front_end(
    args: ServerArgs,
    kv_total: int | None = None,
    media: MediaFactory | None = AsyncMMDataProcessor.from_server_args,
    replicas: ReplicaControl | None = None,
) -> FrontEnd:
    """Everything the main process serves with, from resolved `args`. `kv_total` is the
    smallest replica's KV pool (a request may hold no more); `media` makes the media processor
    from the args (None: a text-only front end); `replicas` is the supervisor's view of the
    replicas (state, restarts, rank processes for /server_info; the kill of one that stalls)."""
    mm = media(args) if media is not None else None
    try:
        tm = TokenizerManager(args, mm, kv_total=kv_total, replicas=replicas)
        return FrontEnd(args, mm, tm, create_app(tm))
    except BaseException:
        if mm is not None:
            mm.shutdown()  # its worker processes are already running
        raise
