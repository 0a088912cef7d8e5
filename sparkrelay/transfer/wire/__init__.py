"""The control channel's wire layer: frame authentication (auth), the receiving PULL socket (inbox),
the non-blocking per-destination PUSH pool (outbox), the rate-limited reject log, and which address
a server advertises to its peers (address)."""

from sparkrelay.transfer.wire.address import (
    advertised_host,
    check_advertised,
    dials_itself,
    interface_of,
    is_wildcard,
    local_host,
    resolves_to_loopback,
)
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
from sparkrelay.transfer.wire.inbox import Inbox, bind_pull, recv_with_peer, tcp_endpoint
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
    "advertised_host",
    "bind_pull",
    "check_advertised",
    "check_token",
    "dials_itself",
    "interface_of",
    "is_loopback",
    "is_wildcard",
    "local_host",
    "recv_with_peer",
    "resolves_to_loopback",
    "tcp_endpoint",
    "warn_if_exposed",
]
