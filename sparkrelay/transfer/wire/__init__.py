"""The control channel's wire layer: frame authentication (auth), the receiving PULL socket (inbox),
the non-blocking per-destination PUSH pool (outbox) and the rate-limited reject log."""

from sparkrelay.transfer.wire.auth import (
    TAG_BYTES,
    TAG_LABEL,
    TOKEN_HINT,
    FrameAuth,
    RejectLog,
    check_token,
    is_loopback,
    warn_if_exposed,
)
from sparkrelay.transfer.wire.inbox import Inbox, advertise_host, bind_pull, tcp_endpoint
from sparkrelay.transfer.wire.outbox import MAX_QUEUED, Outbox

__all__ = [
    "MAX_QUEUED",
    "TAG_BYTES",
    "TAG_LABEL",
    "TOKEN_HINT",
    "FrameAuth",
    "Inbox",
    "Outbox",
    "RejectLog",
    "advertise_host",
    "bind_pull",
    "check_token",
    "is_loopback",
    "tcp_endpoint",
    "warn_if_exposed",
]
