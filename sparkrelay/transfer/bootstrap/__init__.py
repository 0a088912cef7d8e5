"""The prefill's bootstrap HTTP server (server.py), its clients (client.py: stage registration, the
decode's reads with 503 retries, the heartbeat) and the decode's cache of what each prefill
published (prefill_book.py)."""

from sparkrelay.transfer.bootstrap.client import (
    BootstrapCancelled,
    BootstrapError,
    bootstrap_url,
    check_health,
    fetch_prefill_info,
    fetch_rank,
    http_request,
    register_rank,
)
from sparkrelay.transfer.bootstrap.server import BootstrapServer

__all__ = [
    "BootstrapCancelled",
    "BootstrapError",
    "BootstrapServer",
    "bootstrap_url",
    "check_health",
    "fetch_prefill_info",
    "fetch_rank",
    "http_request",
    "register_rank",
]
