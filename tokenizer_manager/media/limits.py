"""What a client's media may be, and the one error when it is not.

`MediaLimits` bounds one media item and one request's media (bytes, pixels, frames, seconds of
CPU) and names the local folder media may come from; `MediaUrlPolicy` says which http(s) URLs
may be fetched (the address rule: only public unicast addresses unless `allow_private`, IPv4
inside IPv6 checked as IPv4; how the fetcher holds it on every connection: media/fetch.py).
`MediaError` is the one error for everything a client's media can get wrong, wherever it is
found: in the fetch (URL policy, size, unreachable origin), in the header checks, or in the worker
that decodes it.

This module imports no other media module, so each of them may import it.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import httpx

from runtime.multimodal import Modality
from runtime.server_args import ServerArgs
from tokenizer_manager.protocol import APIError

MiB = 1 << 20

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class MediaError(APIError):
    """A client's media cannot be used: an `APIError` whose field defaults are the media's
    (param "messages", code "invalid_media"), so it reaches the HTTP reply as it is raised.

    Pickles across processes (CPU workers raise it too): every field has a default and the
    instance dict travels with the message.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = "messages",
        code: str | None = "invalid_media",
    ):
        super().__init__(message, status=status, param=param, code=code)


def media_param(modality: Modality) -> str:
    """The OpenAI request field that holds a media URL of this kind."""
    return "image_url" if modality == Modality.IMAGE else "video_url"


def too_large(max_bytes: int, param: str) -> MediaError:
    """A media item over its byte limit (encoded, or decoded from a compressed response)."""
    return MediaError(
        f"media item is too large: the limit is {max_bytes} bytes ({max_bytes / (1 << 20):.1f} "
        "MiB)",
        param=param,
        code="media_too_large",
    )


def bad_video(message: str, code: str = "invalid_video") -> MediaError:
    """The client's video cannot be used (param video_url)."""
    return MediaError(message, param="video_url", code=code)


class FetchRefused(Exception):
    """The policy refuses a URL or an address (the message is for the server log only)."""


@dataclass(frozen=True)
class MediaUrlPolicy:
    """Which http(s) URLs the server may fetch; see media/fetch.py's module docstring."""

    allow_private: bool = False
    allowed_domains: tuple[str, ...] | None = None
    trust_env: bool = False

    def check_url(self, url: httpx.URL) -> None:
        """Refuse a URL the policy does not fetch (invariant 14); again on every redirect."""
        if url.scheme not in ("http", "https"):
            raise FetchRefused(f"scheme {url.scheme!r} is not fetched")
        host = url.host.rstrip(".").lower()
        if not host:
            raise FetchRefused("the URL has no host")
        if self.allowed_domains is not None and host not in self.allowed_domains:
            raise FetchRefused(f"host {host!r} is not in the allowed media domains")

    def check_address(self, address: IPAddress) -> None:
        if not self.allow_private and not address_is_public(address):
            raise FetchRefused(f"address {address} is not a public address")


def parse_domains(text: str | None) -> tuple[str, ...] | None:
    """`--allowed-media-domains a.com,b.org` as normalised host names (None: any host)."""
    if text is None:
        return None
    return tuple(d.strip().rstrip(".").lower() for d in text.split(",") if d.strip())


def address_is_public(address: IPAddress) -> bool:
    """True for a globally routable unicast address (IPv4 inside IPv6 is checked as IPv4)."""
    embedded = _embedded_ipv4(address)
    if embedded is not None:
        return address_is_public(embedded)
    blocked = (
        address.is_loopback
        or address.is_private
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
        or (isinstance(address, ipaddress.IPv6Address) and address.is_site_local)
    )
    return address.is_global and not blocked


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


@dataclass(frozen=True)
class MediaLimits:
    """Bounds on one media item, checked before it is decoded or sent on."""

    max_image_bytes: int = 20 * MiB
    max_video_bytes: int = 100 * MiB
    max_request_bytes: int = 256 * MiB  # all media of one request together
    max_pixels: int = 50_000_000  # decoded pixels of one image or one video frame
    min_side: int = 1
    max_frames: int = 64  # sampled frames of one video
    max_video_frames: int = 108_000  # frames a video may declare (an hour at 30 fps)
    max_video_seconds: float = 3600.0  # duration a video may declare
    max_cpu_seconds: float | None = 10.0  # CPU time to decode and preprocess one item
    http_timeout: float = 10.0  # seconds for one whole fetch: connect, headers, body, redirects
    allowed_local_media_path: str | None = None  # None: local files are refused
    url_policy: MediaUrlPolicy = MediaUrlPolicy()  # which http(s) URLs may be fetched

    def max_bytes(self, modality: Modality) -> int:
        return self.max_image_bytes if modality == Modality.IMAGE else self.max_video_bytes

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> MediaLimits:
        policy = MediaUrlPolicy(
            allow_private=args.allow_private_media_urls,
            allowed_domains=parse_domains(args.allowed_media_domains),
            trust_env=args.media_trust_env,
        )
        return cls(
            max_cpu_seconds=args.media_cpu_seconds,
            http_timeout=args.media_fetch_timeout,
            allowed_local_media_path=args.allowed_local_media_path,
            url_policy=policy,
        )
