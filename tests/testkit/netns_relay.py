"""The processes tests/testkit/netns.py starts to act inside a network namespace (stdlib only, run
by file path: `python netns_relay.py relay|ping NSPATH ...`).

relay NSPATH HOST PORT: listens on 127.0.0.1 of the namespace it was started in (the root one),
prints that port, then enters NSPATH and relays every connection to HOST:PORT from there; sockets
made after setns() live in NSPATH, the listener made before stays where it was. It exits on
SIGTERM or when its stdin closes (the parent died), so no relay outlives its test.

ping NSPATH DST TIMEOUT: ICMP echoes from inside NSPATH to DST; exit 0 on a reply, 1 on none within
TIMEOUT seconds (this machine has no ping binary).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import socket
import struct
import sys
import threading
import time

CLONE_NEWNET = 0x40000000
CHUNK = 65536


def enter_netns(path: str) -> None:
    """Moves the calling thread into the namespace at `path`; threads it starts later follow it.
    Call it before starting any thread, since setns() moves only the calling thread."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
    finally:
        os.close(fd)


def pump(src: socket.socket, dst: socket.socket) -> None:
    """Copies src to dst as bytes arrive (so SSE streams through), then passes the EOF on with a
    half-close; on an error both sockets are shut so the opposite pump wakes up too."""
    try:
        while data := src.recv(CHUNK):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def reset(sock: socket.socket) -> None:
    """Closes with an RST, so a client of an unreachable target sees a reset, not a clean EOF."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def serve_one(client: socket.socket, host: str, port: int) -> None:
    """One relayed connection: a thread per direction, both sockets closed when both are done."""
    try:
        upstream = socket.create_connection((host, port), timeout=10)
    except OSError:
        reset(client)
        return
    upstream.settimeout(None)
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
    back.start()
    pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def exit_on_eof() -> None:
    """Stdin is a pipe from the parent: its EOF means the parent closed it or died."""
    sys.stdin.buffer.read()
    os._exit(0)


def relay(nspath: str, host: str, port: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    enter_netns(nspath)
    print(listener.getsockname()[1], flush=True)
    threading.Thread(target=exit_on_eof, daemon=True).start()
    while True:
        client, _ = listener.accept()
        threading.Thread(target=serve_one, args=(client, host, port), daemon=True).start()


def checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) an ICMP header carries."""
    data += b"\0" * (len(data) % 2)
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def echo_request(ident: int, seq: int) -> bytes:
    payload = b"sparkrelay-netns"
    header = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
    return struct.pack("!BBHHH", 8, 0, checksum(header + payload), ident, seq) + payload


def is_reply(data: bytes, addr: tuple, ident: int, dst: str) -> bool:
    ihl = (data[0] & 0x0F) * 4
    kind, _, _, got_id, _ = struct.unpack("!BBHHH", data[ihl : ihl + 8])
    return kind == 0 and got_id == ident and addr[0] == dst


def ping(nspath: str, dst: str, timeout: float) -> bool:
    """Echo requests every 0.2 s over a raw socket (root only) until a reply or `timeout`; resent
    like ping's, since a request queued behind a failing ARP lookup is dropped (right after a
    heal)."""
    enter_netns(nspath)
    ident = os.getpid() & 0xFFFF
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as s:
        for seq in itertools.count(1):
            if (left := deadline - time.monotonic()) <= 0:
                return False
            try:
                s.sendto(echo_request(ident, seq), (dst, 0))
            except OSError:  # no route: the link is down on this side
                pass
            wake = time.monotonic() + min(0.2, left)
            while (wait := wake - time.monotonic()) > 0:
                s.settimeout(wait)
                try:
                    if is_reply(*s.recvfrom(2048), ident, dst):
                        return True
                except TimeoutError:
                    break
    return False


def main(argv: list[str]) -> int:
    if argv[1] == "relay":
        relay(argv[2], argv[3], int(argv[4]))
    if argv[1] == "ping":
        return 0 if ping(argv[2], argv[3], float(argv[4])) else 1
    raise SystemExit(f"usage: {argv[0]} relay NSPATH HOST PORT | ping NSPATH DST TIMEOUT")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
