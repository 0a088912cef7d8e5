"""The receiving end of the control channel: a bound PULL socket and its monitor, and its tcp://
endpoint (which address to advertise for it: address.py)."""

from __future__ import annotations

import logging
from typing import Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from sparkrelay.transfer.wire.auth import RejectLog


def tcp_endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host.strip('[]')}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def bind_pull(ctx: zmq.Context, host: str, max_msg_size: int) -> tuple[zmq.Socket, int]:
    """A PULL socket on host:<random port>; a frame over max_msg_size bytes makes zmq drop the
    connection."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
    sock.setsockopt(zmq.RCVHWM, 256)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(tcp_endpoint(host, "*"))
    except zmq.ZMQError as e:
        sock.close()
        raise OSError(f"cannot bind a ZMQ PULL socket on {host}: {e}") from None
    port = int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    return sock, port


_PEER_EVENTS = {
    zmq.EVENT_DISCONNECTED: "a peer disconnected (it closed, or zmq dropped it for a frame over "
    "MAXMSGSIZE {max} bytes)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "a connection failed the ZMTP handshake (not a ZMQ peer?)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "a connection broke the ZMTP protocol (garbage bytes?)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "a connection failed ZMTP authentication",
}


def recv_with_peer(sock: zmq.Socket, flags: int = 0) -> tuple[list[bytes], Optional[str]]:
    """One whole message and the address of the connection it came over (zmq's Peer-Address: the IP on
    tcp://, the process's credentials on ipc://; None where the transport gives none)."""
    frames = sock.recv_multipart(flags, copy=False)
    try:
        peer = frames[0].get("Peer-Address") or None
    except zmq.ZMQError:
        peer = None
    return [f.bytes for f in frames], peer


class Inbox:
    """A bound PULL socket and its zmq monitor, owned by one listener thread. What zmq refuses on
    its own (a frame over MAXMSGSIZE, a connection that is not ZMTP) never reaches recv; the
    monitor's events make it visible in the log. Messages are read whole: frames, then the caller
    checks the tag (FrameAuth.open) before parsing."""

    def __init__(
        self, ctx: zmq.Context, host: str, max_msg_size: int, who: str, rejects: RejectLog
    ) -> None:
        self.sock, self.port = bind_pull(ctx, host, max_msg_size)
        self.max_msg_size, self.who, self.rejects = max_msg_size, who, rejects
        self.monitor = self.sock.get_monitor_socket(sum(_PEER_EVENTS))
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def poll(self, timeout_ms: int, limit: int = 256) -> list[tuple[list[bytes], Optional[str]]]:
        """Up to `limit` messages: (frames, the sender's address, for the reject log)."""
        ready = dict(self.poller.poll(timeout_ms))
        if self.monitor in ready:
            self._drain_events()
        out = []
        if self.sock in ready:
            for _ in range(limit):
                try:
                    out.append(recv_with_peer(self.sock, zmq.NOBLOCK))
                except zmq.Again:
                    break
        return out

    def _drain_events(self) -> None:
        for _ in range(256):
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            what = _PEER_EVENTS.get(event["event"])
            # a disconnect is routine (a peer restarting): info; the others are warnings
            if what is not None:
                level = (
                    logging.INFO if event["event"] == zmq.EVENT_DISCONNECTED else logging.WARNING
                )
                self.rejects.note(
                    "connection",
                    "%s: %s",
                    self.who,
                    what.format(max=self.max_msg_size),
                    level=level,
                )

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
