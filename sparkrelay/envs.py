"""Environment knobs of the PD deployment. Each SPARKRELAY_* name also accepts its SGLANG_* alias
(the names users of the proof of concept and of SGLang already set); the SPARKRELAY_ name wins when
both are set. A malformed value is a startup error naming the variable."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from typing import Optional

from sparkrelay.config import ConfigError


def _raw(name: str) -> tuple[str, Optional[str]]:
    """(the variable actually read, its value) for SPARKRELAY_X or its SGLANG_X alias."""
    alias = "SGLANG_" + name.removeprefix("SPARKRELAY_")
    for var in (name, alias):
        value = os.environ.get(var)
        if value is not None and value.strip() != "":
            return var, value.strip()
    return name, None


def env_float(name: str, default: float, minimum: float = 0.0) -> float:
    var, value = _raw(name)
    if value is None:
        return default
    try:
        out = float(value)
    except ValueError:
        raise ConfigError(f"{var}={value!r} is not a number") from None
    if out < minimum:
        raise ConfigError(f"{var}={value!r} must be >= {minimum}")
    return out


def env_int(name: str, default: int, minimum: int = 0) -> int:
    var, value = _raw(name)
    if value is None:
        return default
    try:
        out = int(value)
    except ValueError:
        raise ConfigError(f"{var}={value!r} is not an integer") from None
    if out < minimum:
        raise ConfigError(f"{var}={value!r} must be >= {minimum}")
    return out


def env_bool(name: str, default: bool) -> bool:
    var, value = _raw(name)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{var}={value!r} is not a boolean (1/0, true/false)")


def env_str(name: str) -> Optional[str]:
    return _raw(name)[1]


def _set(name: str) -> tuple[str, Optional[str]]:
    """(the variable set, its raw value) for SPARKRELAY_X or its SGLANG_X alias, blank values
    included."""
    alias = "SGLANG_" + name.removeprefix("SPARKRELAY_")
    for var in (name, alias):
        if os.environ.get(var) is not None:
            return var, os.environ[var]
    return name, None


def env_int_list(name: str) -> Optional[tuple[int, ...]]:
    """Comma-separated integers, each item stripped ("1, 3,5"); an empty value, an empty item
    ("1,,3", ","), inner spaces ("1 3 5") or a non-integer is an error naming the variable actually
    set. Unset: None."""
    var, value = _set(name)
    if value is None:
        return None
    if value.strip() == "":
        raise ConfigError(
            f"{var}={value!r} is empty: give comma-separated integers (e.g. 1,3,5), or unset it"
        )
    items = [item.strip() for item in value.split(",")]
    for item in items:
        if item == "":
            raise ConfigError(
                f"{var}={value!r} has an empty item: give comma-separated integers (e.g. 1,3,5)"
            )
        # int() would also take "+3", "1_0" and non-ASCII digits
        if not re.fullmatch(r"-?[0-9]+", item):
            spaced = re.fullmatch(r"-?[0-9]+(\s+-?[0-9]+)+", item)
            hint = " (separate the items with commas, not spaces)" if spaced else ""
            raise ConfigError(f"{var}={value!r}: {item!r} is not an integer{hint}")
    return tuple(int(item) for item in items)


# a host name: dot-separated labels of letters, digits and inner hyphens (RFC 1123), not all digits
_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_HOST_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*\.?")


def env_host(name: str) -> Optional[str]:
    """An IP address (an IPv6 one with or without brackets, which are dropped) or a host name, as
    peers on other hosts dial it: a wildcard (0.0.0.0, ::), a port, a scheme or a malformed name is
    an error naming the variable actually set. Unset or blank: None."""
    var, value = _raw(name)
    if value is None:
        return None
    host = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None and ip.is_unspecified:
        raise ConfigError(
            f"{var}={value!r} is a wildcard address: give the address the peers reach this host at"
        )
    if ip is not None:
        return host
    dotted = re.fullmatch(r"[0-9.]+", host)  # 10.0.0.300 is a bad address, not a host name
    if dotted or len(host) > 253 or not _HOST_NAME.fullmatch(host):
        raise ConfigError(
            f"{var}={value!r} is not an IP address or host name (give the address alone, without a "
            "scheme or a port)"
        )
    return host


CAPTURE = "SPARKRELAY_DSPARK_PD_ENABLE_PREFILL_CAPTURE"
LAYER_IDS = "SPARKRELAY_DSPARK_PD_TARGET_LAYER_IDS"
TAIL_TOKENS = "SPARKRELAY_DSPARK_PD_PREFILL_TAIL_TOKENS"
HOST_IP = "SPARKRELAY_HOST_IP"

# name -> (default, what it sets): the one table of the variables DisaggEnv.read() reads (--help lists it)
ENV_VARS: dict[str, tuple[object, str]] = {
    "SPARKRELAY_DISAGGREGATION_BOOTSTRAP_TIMEOUT": (
        300.0,
        "prefill: seconds a room waits for its decode peer",
    ),
    "SPARKRELAY_DISAGGREGATION_WAITING_TIMEOUT": (300.0, "decode: seconds a room waits for its KV"),
    "SPARKRELAY_DISAGGREGATION_HEARTBEAT_INTERVAL": (
        5.0,
        "decode: seconds between health checks of each prefill",
    ),
    "SPARKRELAY_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": (
        2,
        "decode: missed checks before a prefill's rooms fail",
    ),
    "SPARKRELAY_DISAGGREGATION_AUTH_TOKEN": (
        None,
        "PD shared secret when --disaggregation-auth-token is not given",
    ),
    HOST_IP: (
        None,
        "the address PD peers are told to reach this server at (needed with a wildcard "
        "--disaggregation-bootstrap-host; set, it always wins: NAT, multi-homed hosts)",
    ),
    CAPTURE: (True, "prefill: capture the DSpark taps"),
    LAYER_IDS: (None, "comma-separated tap layers (default: the drafter config's)"),
    TAIL_TOKENS: (8, "rows of the `tail` handoff"),
    "SPARKRELAY_TEST_DISAGG_FAILURE_PROB": (
        0.0,
        "prefill, tests only: fail this fraction of rooms before sending",
    ),
}


def _default(name: str):
    return ENV_VARS[name][0]


def env_help() -> str:
    """The table above as --help text: the name, its SGLANG_ alias and default; the meaning on the
    next line."""
    lines = []
    for name, (default, meaning) in ENV_VARS.items():
        alias = "SGLANG_" + name.removeprefix("SPARKRELAY_")
        shown = (
            "unset"
            if default is None
            else str(default).lower()
            if isinstance(default, bool)
            else default
        )
        lines += [f"  {name}, {alias} (default {shown})", f"      {meaning}"]
    return "\n".join(lines)


@dataclass(frozen=True)
class DisaggEnv:
    bootstrap_timeout: (
        float  # prefill: a room whose decode peer never shows up fails after this (s)
    )
    waiting_timeout: float  # decode: a room whose KV never arrives fails after this (s)
    heartbeat_interval: (
        float  # decode: GET /health on each prefill bootstrap address this often (s)
    )
    heartbeat_max_failures: int  # misses in a row before that prefill's rooms fail
    prefill_capture: bool  # prefill: capture the DSpark taps (on when layer ids resolve)
    target_layer_ids: Optional[tuple[int, ...]]  # overrides the drafter config's target_layer_ids
    tail_tokens: (
        int  # rows of the `tail` handoff (0 means the fixed default, 8; at most the context)
    )
    # when --disaggregation-auth-token is not given
    auth_token: Optional[str] = field(default=None, repr=False)
    test_failure_prob: float = (
        0.0  # prefill: fail this fraction of rooms just before their data is sent (tests)
    )
    # the address the transfer agents and the bootstrap server advertise (None: their bind address)
    host_ip: Optional[str] = None
    # knob -> the variable actually set
    names: dict = field(default_factory=dict, repr=False, compare=False)

    def var(self, name: str) -> str:
        """The variable the user set for knob `name` (its SGLANG_ alias when that was the one), for
        messages."""
        return self.names.get(name, name)

    def token(self, flag: Optional[str]) -> Optional[str]:
        """--disaggregation-auth-token when given, else SPARKRELAY_DISAGGREGATION_AUTH_TOKEN (None:
        no auth)."""
        return flag or self.auth_token or None

    @classmethod
    def read(cls) -> "DisaggEnv":
        tail = env_int(TAIL_TOKENS, 0)  # 0: the default
        failure_prob = env_float(
            "SPARKRELAY_TEST_DISAGG_FAILURE_PROB",
            _default("SPARKRELAY_TEST_DISAGG_FAILURE_PROB"),
            0.0,
        )
        if failure_prob > 1.0:
            var = _raw("SPARKRELAY_TEST_DISAGG_FAILURE_PROB")[0]
            raise ConfigError(f"{var}={failure_prob!r} must be a probability in [0, 1]")
        return cls(
            bootstrap_timeout=env_float(
                "SPARKRELAY_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
                _default("SPARKRELAY_DISAGGREGATION_BOOTSTRAP_TIMEOUT"),
                0.1,
            ),
            waiting_timeout=env_float(
                "SPARKRELAY_DISAGGREGATION_WAITING_TIMEOUT",
                _default("SPARKRELAY_DISAGGREGATION_WAITING_TIMEOUT"),
                0.1,
            ),
            heartbeat_interval=max(
                env_float(
                    "SPARKRELAY_DISAGGREGATION_HEARTBEAT_INTERVAL",
                    _default("SPARKRELAY_DISAGGREGATION_HEARTBEAT_INTERVAL"),
                    0.1,
                ),
                0.1,
            ),
            heartbeat_max_failures=env_int(
                "SPARKRELAY_DISAGGREGATION_HEARTBEAT_MAX_FAILURE",
                _default("SPARKRELAY_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"),
                1,
            ),
            prefill_capture=env_bool(CAPTURE, _default(CAPTURE)),
            target_layer_ids=env_int_list(LAYER_IDS),
            tail_tokens=tail or _default(TAIL_TOKENS),
            auth_token=env_str("SPARKRELAY_DISAGGREGATION_AUTH_TOKEN"),
            test_failure_prob=failure_prob,
            host_ip=env_host(HOST_IP),
            names={**{name: _raw(name)[0] for name in ENV_VARS}, LAYER_IDS: _set(LAYER_IDS)[0]},
        )
