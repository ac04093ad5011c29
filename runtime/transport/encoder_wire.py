"""The encoder servers' wire: a message is a JSON header plus its tensors' raw bytes.

An LLM server sends encode jobs to an encoder server (`--encoder-only`) and gets embeddings back,
over ZMQ. A message is the frames `[mac, header, buffer, ...]`: the header is JSON (never a
pickle: the peer may be another machine), the buffers are the tensors' bytes, each described in
the header (`"tensors": [{"dtype", "shape", "shm"}]`). Between processes of one node a tensor's
bytes go in a shared-memory file instead (`shm` names it; `runtime.transport.shm`), which the
receiver maps and removes at once; only files of tessera's media naming in the shared-memory
folder are ever opened. `mac` is an HMAC-SHA256 over every other frame when the channel has a
key (`--encoder-secret`), empty otherwise; a message whose mac does not verify is dropped
before its header is parsed.

`EncoderTransport` is the small interface a faster transfer (NIXL, Mooncake's transfer engine)
would implement beside the ZMQ one; only ZMQ exists today.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from runtime.transport.frames import Frame
from runtime.transport.shm import (
    MEDIA_PREFIX,
    SharedTensor,
    local_shm_dir,
    new_media_path,
    remove_file,
)

MAX_HEADER_BYTES = 1 << 20
SHARED_MIN_BYTES = 1 << 16  # tensors from this size up go through shared memory, when local
WIRE_DTYPES = {"float32", "float16", "bfloat16", "int64", "int32", "uint8"}
Header = dict[str, Any]


class WireError(ValueError):
    """A message that is not one (bad mac, header or tensor description): dropped or refused."""


@dataclass(frozen=True)
class Channel:
    """How one end of an encoder channel frames its messages: `key` for the HMAC (None: no
    mac), `shm_dir` where large tensors go when both ends share the node (None: inline)."""

    key: bytes | None = None
    shm_dir: str | None = None

    def pack(
        self,
        header: Header,
        tensors: Sequence[torch.Tensor | SharedTensor] = (),
        written: list[str] | None = None,
    ) -> list[Frame]:
        """The frames of `header` with `tensors` (described under header["tensors"]). A
        `SharedTensor` goes by its name (the receiver removes the file once read); the files
        written here for large tensors are noted in `written`, for the sender to remove should
        the receiver never read them."""
        descriptions, buffers = [], []
        for tensor in tensors:
            description, buffer = self._put(tensor, written)
            descriptions.append(description)
            if buffer is not None:
                buffers.append(buffer)
        body = json.dumps({**header, "tensors": descriptions}).encode()
        frames: list[Frame] = [body, *buffers]
        return [self.mac(frames), *frames]

    def unpack(self, frames: Sequence[Frame]) -> tuple[Header, list[torch.Tensor]]:
        """The header and its tensors; WireError for anything malformed or unsigned."""
        if len(frames) < 2:
            raise WireError("a message has a mac frame and a header frame")
        if not hmac.compare_digest(bytes(frames[0]), self.mac(frames[1:])):
            raise WireError("the message's mac does not verify")
        header = parse_header(frames[1])
        inline = iter(frames[2:])
        tensors = [self._take(d, inline) for d in header.pop("tensors", [])]
        return header, tensors

    def mac(self, frames: Sequence[Frame]) -> bytes:
        if self.key is None:
            return b""
        digest = hmac.new(self.key, digestmod=hashlib.sha256)
        for frame in frames:
            view = memoryview(frame)
            digest.update(view.nbytes.to_bytes(8, "little"))
            digest.update(view)
        return digest.digest()

    def _put(
        self, tensor: torch.Tensor | SharedTensor, written: list[str] | None
    ) -> tuple[Header, Frame | None]:
        if isinstance(tensor, SharedTensor):
            return {"dtype": tensor.dtype, "shape": list(tensor.shape), "shm": tensor.path}, None
        tensor = tensor.detach().cpu().contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        raw = tensor.reshape(-1).view(torch.uint8).numpy()
        description: Header = {"dtype": dtype, "shape": list(tensor.shape), "shm": None}
        if self.shm_dir is None or raw.nbytes < SHARED_MIN_BYTES:
            return description, memoryview(raw)
        description["shm"] = SharedTensor.write(raw, new_media_path(self.shm_dir)).path
        if written is not None:
            written.append(description["shm"])
        return description, None

    def _take(self, description: object, inline: Any) -> torch.Tensor:
        dtype, shape, path = tensor_description(description)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if path is None:
            frame = next(inline, None)
            if frame is None or memoryview(frame).nbytes != nbytes:
                raise WireError(f"a tensor of {nbytes} bytes has no matching buffer")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only buffer: an input
                raw = torch.frombuffer(frame, dtype=torch.uint8) if nbytes else None
        else:
            raw = self._read_shared(path, nbytes)
        if raw is None:
            return torch.empty(shape, dtype=dtype)
        return raw.view(dtype).view(shape)

    def _read_shared(self, path: str, nbytes: int) -> torch.Tensor | None:
        """The bytes of a shared file the peer wrote; the file is removed whatever happens."""
        if self.shm_dir is None or not is_media_file(path, self.shm_dir):
            raise WireError(f"{path!r} is not a shared tensor this channel may read")
        try:
            return SharedTensor(path, (nbytes,), "uint8", owned=False).load() if nbytes else None
        except OSError as exc:
            raise WireError(f"shared tensor {path}: {exc}") from None
        finally:
            remove_file(path)


def parse_header(frame: Frame) -> Header:
    if memoryview(frame).nbytes > MAX_HEADER_BYTES:
        raise WireError(f"a header is at most {MAX_HEADER_BYTES} bytes")
    try:
        header = json.loads(bytes(frame))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"the header is not JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("tensors", []), list):
        raise WireError("the header is not a JSON object with a list of tensors")
    return header


def tensor_description(description: object) -> tuple[torch.dtype, list[int], str | None]:
    if not isinstance(description, dict) or description.get("dtype") not in WIRE_DTYPES:
        raise WireError(f"bad tensor description {description!r}")
    shape, path = description.get("shape"), description.get("shm")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise WireError(f"bad tensor shape {shape!r}")
    if path is not None and not isinstance(path, str):
        raise WireError(f"bad shared tensor name {path!r}")
    return getattr(torch, description["dtype"]), shape, path


def is_media_file(path: str, shm_dir: str) -> bool:
    """A file of tessera's media naming directly in `shm_dir` (no other file is ever opened)."""
    folder, name = os.path.split(path)
    same = os.path.realpath(folder) == os.path.realpath(shm_dir)
    return same and name.startswith(MEDIA_PREFIX) and "/" not in name


def endpoint(url: str) -> str:
    """A ZMQ endpoint from an encoder URL: `tcp://host:port`, `host:port`, or `ipc://path`."""
    if url.startswith(("tcp://", "ipc://")):
        return url
    if ":" not in url:
        raise ValueError(f"encoder URL {url!r}: expected tcp://host:port, host:port or ipc://path")
    return f"tcp://{url}"


def endpoint_host(url: str) -> str | None:
    """The host of a tcp endpoint (None for ipc, which never leaves the node)."""
    address = endpoint(url)
    if address.startswith("ipc://"):
        return None
    host = address.removeprefix("tcp://").rsplit(":", 1)[0]
    return host.strip("[]")


def is_loopback(url: str) -> bool:
    host = endpoint_host(url)
    if host is None or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(url: str, key: bytes | None) -> None:
    """An encoder server binds loopback, or a private address with a key (invariants 15, 22)."""
    host = endpoint_host(url)
    if is_loopback(url):
        return
    try:
        address = ipaddress.ip_address(host or "")
        private = address.is_private and not address.is_unspecified
    except ValueError:
        private = False
    if not private:
        raise ValueError(f"encoder address {url!r}: bind loopback or a private address only")
    if key is None:
        raise ValueError(f"encoder address {url!r} leaves the machine: it needs --encoder-secret")


class EncoderTransport(Protocol):
    """What carries jobs and embeddings between an LLM server and one encoder server. The ZMQ
    client (scheduler/remote_encoder.py) is the one built; a GPU transfer engine (NIXL,
    Mooncake) would move the tensors device to device behind the same three calls."""

    url: str

    def send(self, header: Header, tensors: Sequence[torch.Tensor]) -> None: ...

    def recv(self, timeout_s: float) -> tuple[Header, list[torch.Tensor]] | None: ...

    def close(self) -> None: ...


def client_channel(url: str, key: bytes | None) -> Channel:
    """The channel an LLM server uses towards `url`: shared memory when it is on this node."""
    return Channel(key, local_shm_dir(1) if is_loopback(url) else None)


class ZmqEncoderTransport:
    """A blocking ZMQ DEALER towards one encoder server (tools, tests and benchmarks; the
    front end's pool is tokenizer_manager/encoder_pool.py)."""

    def __init__(self, url: str, key: bytes | None = None):
        import zmq  # a dependency; only here, so the wire's pure parts import without it

        self.url, self.channel = url, client_channel(url, key)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint(url))

    @property
    def shared(self) -> bool:
        return self.channel.shm_dir is not None

    def send(self, header: Header, tensors: Sequence[torch.Tensor] = ()) -> None:
        self.sock.send_multipart(self.channel.pack(header, tensors), copy=False)

    def recv(self, timeout_s: float) -> tuple[Header, list[torch.Tensor]] | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        parts = self.sock.recv_multipart(copy=False)
        return self.channel.unpack([p.buffer for p in parts])

    def close(self) -> None:
        self.ctx.destroy(linger=0)
