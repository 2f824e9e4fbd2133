"""Messages on the isolated child's socket: a 4-byte length, then JSON; file descriptors ride along
as SCM_RIGHTS. JSON (never pickle) because the child runs untrusted code: whatever it sends back is
parsed as data only. Standard library only: the children import it by name from this folder, not
through the kgen package."""

from __future__ import annotations

import json
import socket
import struct
import time

HEADER = struct.Struct("<I")
MAX_MESSAGE = 1 << 20
MAX_FDS = 64


class WireError(Exception):
    """The peer closed the socket (EOF) or sent something that is not a message."""


def send(sock: socket.socket, obj: object, fds: list[int] | tuple[int, ...] = ()) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    msg = HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [msg], list(fds)) if fds else sock.send(msg)
    if sent < len(msg):
        sock.sendall(msg[sent:])


def _read(sock: socket.socket, n: int, fds: list[int] | None, deadline: float | None) -> bytes:
    chunks, left = [], n
    while left:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            sock.settimeout(remaining)
        if fds is None:
            chunk = sock.recv(min(left, 1 << 16))
        else:
            chunk, got, _flags, _addr = socket.recv_fds(sock, min(left, 1 << 16), MAX_FDS)
            fds.extend(got)
        if not chunk:
            raise WireError("end of stream")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket, fds: list[int] | None = None, deadline: float | None = None) -> dict:
    """The next message (a JSON object). With `fds`, descriptors sent along are appended to it;
    without, any are discarded by the kernel (the parent never accepts descriptors). Past
    `deadline` (time.monotonic()), TimeoutError."""
    (size,) = HEADER.unpack(_read(sock, HEADER.size, fds, deadline))
    if size > MAX_MESSAGE:
        raise WireError(f"message of {size} bytes (at most {MAX_MESSAGE})")
    try:
        obj = json.loads(_read(sock, size, fds, deadline))
    except ValueError as e:
        raise WireError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise WireError("not a JSON object")
    return obj
