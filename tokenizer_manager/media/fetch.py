"""Fetching media over http(s) without letting a client aim the server at its own network.

The policy (`MediaUrlPolicy`, media/limits.py), checked on the first URL and again on every
redirect hop:
- only `http` and `https`;
- when `allowed_domains` is set, only those host names (exact, case-insensitive);
- unless `allow_private` is set, every address the host name resolves to must be a public one:
  loopback, private, shared (CGNAT), link-local, multicast, reserved and unspecified addresses are
  refused, for IPv4, IPv6 and IPv4 inside IPv6 (mapped, 6to4, Teredo).

The address is checked inside the connection itself (`PolicyBackend.connect_tcp`): the host is
resolved once, every address checked, and the socket connected to a checked address, so nothing
can answer a second lookup differently (DNS rebinding). TLS still verifies the certificate against
the host name (httpcore passes it as the SNI name), and the Host header is the URL's.

One wall-clock deadline covers a whole fetch: connect, TLS, request, headers, body and redirects.
It is held in a context variable of the fetching thread, and every socket operation's timeout is
cut to what is left of it, so a server that sends its headers one byte at a time is cut off too.

A body is read under the caller's byte cap, counted in decoded bytes: an origin that compresses
anyway (gzip or deflate; any other or a stack of codings is refused) has its body inflated as it
arrives, never more than the cap at once (`Inflater`).

Environment proxies, `.netrc` and `SSL_CERT_FILE` are ignored unless `trust_env` is set; a proxy
taken from the environment does its own name resolution, so the address rule then applies to the
proxy, not to the media host.
"""

from __future__ import annotations

import contextlib
import contextvars
import ipaddress
import socket
import time
import zlib
from collections.abc import Iterator
from typing import Any

import httpcore
import httpx

from runtime.logging_utils import get_logger
from tokenizer_manager.media.limits import (
    FetchRefused,
    IPAddress,
    MediaError,
    MediaUrlPolicy,
    too_large,
)

logger = get_logger(__name__)

MAX_REDIRECTS = 5
USER_AGENT = "tessera-media-fetcher/0.1"
REDIRECTS = (301, 302, 303, 307, 308)

_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "tessera_fetch_deadline", default=None
)

# ---------------------------------------------------------------------------------------------
# The deadline of the fetch running in this thread
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def fetch_deadline(seconds: float) -> Iterator[None]:
    """Every socket operation of this thread inside the block ends by now + `seconds`."""
    token = _deadline.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _deadline.reset(token)


def _clamp(timeout: float | None, error: type[Exception]) -> float | None:
    deadline = _deadline.get()
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise error("the fetch deadline passed")
    return left if timeout is None else min(timeout, left)


class DeadlineStream(httpcore.NetworkStream):
    """A connection whose every read and write ends by the current fetch's deadline."""

    def __init__(self, inner: httpcore.NetworkStream):
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _clamp(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _clamp(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        timeout = _clamp(timeout, httpcore.ConnectTimeout)
        return DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class PolicyBackend(httpcore.NetworkBackend):
    """Resolves once, checks every address, connects to a checked one."""

    def __init__(self, policy: MediaUrlPolicy):
        self.policy = policy
        self._sync = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.NetworkStream:
        addresses = self.resolve(host, port)
        last: Exception | None = None
        for address in addresses:
            try:
                stream = self._sync.connect_tcp(
                    str(address),
                    port,
                    _clamp(timeout, httpcore.ConnectTimeout),
                    local_address,
                    socket_options,
                )
                return DeadlineStream(stream)
            except httpcore.ConnectError as exc:
                last = exc
        raise last or httpcore.ConnectError(f"no address for {host}")

    def resolve(self, host: str, port: int) -> list[IPAddress]:
        """Every address of `host`, each checked against the policy (all must pass)."""
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            raise httpcore.ConnectError(f"cannot resolve {host}") from exc
        addresses = list(dict.fromkeys(_address(info[4][0]) for info in infos))
        for address in addresses:
            self.policy.check_address(address)
        return addresses

    def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        raise FetchRefused("unix sockets are not fetched")

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def _address(text: str) -> IPAddress:
    return ipaddress.ip_address(text.split("%", 1)[0])  # drop an IPv6 zone id


# ---------------------------------------------------------------------------------------------
# The httpx client
# ---------------------------------------------------------------------------------------------


class _Body(httpx.SyncByteStream):
    def __init__(self, stream: Any):
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        yield from self._stream

    def close(self) -> None:
        if hasattr(self._stream, "close"):
            self._stream.close()


class PolicyTransport(httpx.BaseTransport):
    """An httpx transport over an httpcore pool whose connections go through `PolicyBackend`."""

    def __init__(self, policy: MediaUrlPolicy):
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=policy.trust_env),
            max_connections=64,
            network_backend=PolicyBackend(policy),
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = httpcore.URL(
            scheme=request.url.raw_scheme,
            host=request.url.raw_host,
            port=request.url.port,
            target=request.url.raw_path,
        )
        core = httpcore.Request(
            request.method, url, headers=request.headers.raw, content=request.stream
        )
        response = self._pool.handle_request(core)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_Body(response.stream),
            extensions=response.extensions,
        )

    def close(self) -> None:
        self._pool.close()


class NotFetched(Exception):
    """The URL gave no usable body; the reason is for the server log only."""


# httpcore's errors (our transport passes them through untranslated) and httpx's own.
FETCH_ERRORS = (
    FetchRefused,
    httpx.HTTPError,
    httpx.InvalidURL,
    httpcore.TimeoutException,
    httpcore.NetworkError,
    httpcore.ProtocolError,
    httpcore.UnsupportedProtocol,
    httpcore.ProxyError,
    UnicodeError,
    zlib.error,
)


class MediaFetcher:
    """GETs media under a `MediaUrlPolicy`, each fetch within one deadline; thread-safe."""

    def __init__(self, policy: MediaUrlPolicy, timeout: float):
        self.policy = policy
        self.timeout = timeout
        self.client = httpx.Client(
            transport=PolicyTransport(policy),
            timeout=httpx.Timeout(timeout),
            follow_redirects=False,  # followed here, each hop checked
            trust_env=policy.trust_env,
            headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"},
        )

    def close(self) -> None:
        self.client.close()

    def fetch(self, url: str, max_bytes: int, param: str) -> bytes:
        """The body of `url`, or MediaError (the request field `param` to blame).

        Every failure but size gives the client the same message, so that replies cannot map
        a network; the reason goes to the server log."""
        with fetch_deadline(self.timeout):
            try:
                return self._follow(httpx.URL(url), max_bytes, param)
            except (NotFetched, *FETCH_ERRORS) as exc:
                logger.info("media fetch of %s failed: %s", url[:120], exc or type(exc).__name__)
                raise MediaError(
                    "could not fetch the media URL", param=param, code="media_fetch_failed"
                ) from None

    def _follow(self, url: httpx.URL, max_bytes: int, param: str) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            self.policy.check_url(url)
            with self.client.stream("GET", url) as response:
                location = response.headers.get("location")
                if response.status_code in REDIRECTS and location:
                    url = url.join(location)
                    continue
                if not response.is_success:
                    raise NotFetched(f"HTTP {response.status_code}")
                if _declared_length(response) > max_bytes:
                    raise too_large(max_bytes, param)
                return _read_body(response, max_bytes, param)
        raise NotFetched(f"more than {MAX_REDIRECTS} redirects")


def _declared_length(response: httpx.Response) -> int:
    try:
        return int(response.headers.get("content-length") or 0)
    except ValueError:
        return 0


def _read_body(response: httpx.Response, max_bytes: int, param: str) -> bytes:
    """The body, decoded, and never more than `max_bytes` of it (encoded or decoded) held."""
    inflater = Inflater.for_response(response)
    body, received = bytearray(), 0
    for raw in response.iter_raw():
        received += len(raw)
        body += inflater.feed(raw, max_bytes - len(body)) if inflater else raw
        if len(body) > max_bytes or received > max_bytes:
            raise too_large(max_bytes, param)
    if inflater is not None and not inflater.finished:
        raise NotFetched("the compressed body is truncated")
    return bytes(body)


# Content codings an origin may answer with although we ask for none (one at most): zlib's
# window bits for each.
GZIP_WBITS = 16 + zlib.MAX_WBITS
CONTENT_CODINGS = {"gzip": GZIP_WBITS, "x-gzip": GZIP_WBITS, "deflate": zlib.MAX_WBITS}


class Inflater:
    """A gzip or deflate body decoded as it arrives, under a running cap: each step inflates at
    most one byte past the room the caller has left, so a few KB that claim gigabytes cost
    what the cap allows and no more."""

    def __init__(self, wbits: int):
        self.wbits = wbits
        self._zlib = zlib.decompressobj(wbits)

    @classmethod
    def for_response(cls, response: httpx.Response) -> Inflater | None:
        """None for an unencoded body; NotFetched for unknown or stacked codings."""
        codings = [
            coding.strip().lower()
            for header in response.headers.get_list("content-encoding")
            for coding in header.split(",")
            if coding.strip().lower() not in ("", "identity")
        ]
        if not codings:
            return None
        if len(codings) > 1 or codings[0] not in CONTENT_CODINGS:
            raise NotFetched(f"content encoding {', '.join(codings)!r} is not accepted")
        return cls(CONTENT_CODINGS[codings[0]])

    @property
    def finished(self) -> bool:
        return self._zlib.eof

    def feed(self, data: bytes, room: int) -> bytes:
        """What `data` decodes to, cut at `room` + 1 bytes (more than that: the caller refuses).
        Gzip members that follow one another are decoded one after the other."""
        out = bytearray()
        while data and len(out) <= room:
            if self._zlib.eof:
                self._zlib = zlib.decompressobj(self.wbits)
            out += self._zlib.decompress(data, room + 1 - len(out))
            data = self._zlib.unconsumed_tail or self._zlib.unused_data
        return bytes(out)
