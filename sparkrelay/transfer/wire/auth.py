"""Frame authentication, the exposure warning and the reject log.

With a shared token (--disaggregation-auth-token) every message gets one more frame, its 32-byte
tag:

    control  [msgpack map, tag]          data  [msgpack map, raw bytes, tag]
    tag = HMAC-SHA256(key = token (UTF-8), TAG_LABEL || for each frame before the tag: u64be(len) || bytes)

The receiver checks the tag before it parses anything (FrameAuth.open); a message without a valid
tag is dropped and never fails a room, so a stranger cannot fail a live room. Without a token
messages carry no tag.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import threading
import time
from collections import Counter
from typing import Optional

from sparkrelay.transfer.protocol import AuthError

logger = logging.getLogger(__name__)

TAG_BYTES = 32
TAG_LABEL = b"sparkrelay-transfer-frame-v1"
TOKEN_HINT = (
    "a peer with --disaggregation-auth-token appends a tag frame: set the same "
    "--disaggregation-auth-token on both servers"
)


def check_token(token: Optional[str]) -> Optional[str]:
    """The token, or None when unset (None or ""); ValueError for one that cannot ride an HTTP
    header."""
    if token is None or token == "":
        return None
    if (
        not isinstance(token, str)
        or not 0 < len(token) <= 4096
        or not all("!" <= c <= "~" for c in token)
    ):
        raise ValueError(
            "--disaggregation-auth-token must be 1..4096 printable ASCII characters without spaces"
        )
    return token


class FrameAuth:
    """HMAC-SHA256 tags on every message when a token is set; a no-op without one. Thread safe
    (stateless)."""

    def __init__(self, token: Optional[str], label: bytes = TAG_LABEL) -> None:
        """label: what the frames are (a tag made for one protocol is never valid in another)."""
        token = check_token(token)
        self._key, self._label = (None if token is None else token.encode()), label

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def hint(self) -> str:
        """What to add to a frame-count error when one frame too many arrived: a tag this agent does
        not expect."""
        return "" if self.enabled else f" ({TOKEN_HINT})"

    def tag(self, frames: list) -> bytes:
        h = hmac.new(self._key, self._label, hashlib.sha256)
        for f in frames:
            # lengths make the frame split unambiguous
            h.update(memoryview(f).nbytes.to_bytes(8, "big"))
            h.update(f)
        return h.digest()

    def seal(self, frames: list) -> list:
        return frames if self._key is None else [*frames, self.tag(frames)]

    def open(self, msg: list) -> list:
        """The frames before the tag; AuthError (nothing parsed yet) when the tag is missing or
        wrong."""
        if self._key is None:
            return msg
        if len(msg) < 2 or len(msg[-1]) != TAG_BYTES:
            raise AuthError(
                f"no authentication tag ({len(msg)} frame(s); is the peer running without "
                "--disaggregation-auth-token?)"
            )
        if not hmac.compare_digest(msg[-1], self.tag(msg[:-1])):
            raise AuthError(
                "authentication tag does not match (a different --disaggregation-auth-token, or a "
                "forged or altered message)"
            )
        return msg[:-1]


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, or a wildcard ("0.0.0.0" / "::" parse and are not loopback)


def warn_if_exposed(host: str, auth: bool, what: str) -> None:
    if not auth and not is_loopback(host):
        logger.warning(
            "%s binds %s, which is not a loopback address, without --disaggregation-auth-token: anyone "
            "who can reach it can register, read or inject transfer messages. Set the same "
            "--disaggregation-auth-token (or SPARKRELAY_DISAGGREGATION_AUTH_TOKEN) on both servers.",
            what,
            host,
        )


MAX_PEERS_NAMED = 1024


class RejectLog:
    """Counts rejected inputs by kind and logs each reason, rate limited (a burst of `burst` lines,
    then `per_s` lines a second; the next line that gets through says how many were suppressed) so a
    flood cannot fill disks. A reject that names its peer (`peer=`, the sender's address) is logged
    once per peer and kind, then only counted: one stranger or one misconfigured server is one line,
    not one per frame (past MAX_PEERS_NAMED peers, the rate limit alone applies)."""

    def __init__(self, log: logging.Logger, burst: int = 50, per_s: float = 10.0) -> None:
        self._log, self._burst, self._per_s = log, burst, per_s
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self._allowance, self._last, self._suppressed = float(burst), time.monotonic(), 0
        self._named: set[tuple[str, str]] = set()  # (kind, peer) already logged

    def note(
        self, kind: str, fmt: str, *args, level: int = logging.WARNING, peer: Optional[str] = None
    ) -> None:
        with self._lock:
            self._counts[kind] += 1
            if peer is not None and len(self._named) < MAX_PEERS_NAMED:
                if (kind, peer) in self._named:
                    return
                self._named.add((kind, peer))
                fmt = fmt + " (from %s; more from this peer are counted, not logged)"
                args = (*args, peer)
            now = time.monotonic()
            self._allowance = min(self._burst, self._allowance + (now - self._last) * self._per_s)
            self._last = now
            if self._allowance < 1:
                self._suppressed += 1
                return
            self._allowance -= 1
            suppressed, self._suppressed = self._suppressed, 0
        if suppressed:
            fmt, args = fmt + " (%d similar lines suppressed)", (*args, suppressed)
        self._log.log(level, fmt, *args, stacklevel=2)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
