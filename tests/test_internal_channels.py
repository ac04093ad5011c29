"""Internal channels stay internal: the c10d store and the Gloo pairs listen on loopback only,
and the IPC folder is private."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from pathlib import Path

import pytest
from dist_utils import run_on_ranks

from runtime.server_args import ServerArgs


def _address(hex_ip: str) -> str:
    raw = bytes.fromhex(hex_ip)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = struct.unpack("<4I", raw)  # /proc prints each 32-bit word in host order
    return socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))


def my_listening_addresses() -> set[str]:
    """Local addresses of the TCP sockets this process listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.add(_address(fields[1].split(":")[0]))
    return found


def listening(tp: object) -> set[str]:
    tp.all_reduce_cpu(__import__("torch").ones(1))
    return my_listening_addresses()


def test_store_and_gloo_listen_on_loopback_only() -> None:
    per_rank = run_on_ranks(listening, 2, timeout=120)
    assert per_rank[0], "rank 0 serves the store: it must listen somewhere"
    for addresses in per_rank:
        for address in addresses:
            assert ipaddress.ip_address(address).is_loopback, addresses


def test_ipc_folder_is_private(tmp_path: Path) -> None:
    args = ServerArgs.from_cli(["--device", "cpu"])
    assert os.stat(args.ipc_dir).st_mode & 0o777 == 0o700
    os.rmdir(args.ipc_dir)
    fresh = tmp_path / "ipc"
    assert ServerArgs.from_cli(["--device", "cpu", "--ipc-dir", str(fresh)]).ipc_dir == str(fresh)
    assert os.stat(fresh).st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(ValueError, match="private"):
        ServerArgs.from_cli(["--device", "cpu", "--ipc-dir", str(shared)])
