"""Which address a PD server tells its peers, and the loopback checks that keep a remote peer from
being told one (docs/pd_across_hosts.md).

    bound on        SPARKRELAY_HOST_IP   advertised to peers
    127.0.0.1       unset                127.0.0.1 (one host, as before)
    10.0.0.1        unset                10.0.0.1
    0.0.0.0 / ::    unset                refused at start: which of the host's addresses peers reach is unknown
    anything        203.0.113.7          203.0.113.7 (set explicitly it always wins: NAT, multi-homed hosts)

A wildcard bind is reached locally at loopback (local_host); a peer on another host must never be
told a loopback or wildcard address: it would dial itself (dials_itself).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from typing import Optional

from sparkrelay.config import ConfigError
from sparkrelay.transfer.wire.auth import is_loopback

WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}  # -> its local address
HOST_IP = "SPARKRELAY_HOST_IP"


def is_wildcard(host: str) -> bool:
    """0.0.0.0, :: (or empty): a socket bound there listens on every interface of the host."""
    return host.strip("[]") in WILDCARD_HOSTS


def local_host(bind_host: str) -> str:
    """The address a process on this host dials for a socket bound on bind_host (a wildcard:
    loopback)."""
    host = bind_host.strip("[]")
    return WILDCARD_HOSTS.get(host, host)


def advertised_host(bind_host: str, host_ip: Optional[str]) -> Optional[str]:
    """What peers are told for a socket bound on bind_host: host_ip (SPARKRELAY_HOST_IP) when set,
    always (behind NAT or on a multi-homed host the bind address is not what peers reach); else the
    bind address itself; None for a wildcard without host_ip (no rule can pick the right one of the
    host's addresses)."""
    if host_ip:
        return host_ip.strip("[]")
    return None if is_wildcard(bind_host) else bind_host.strip("[]")


def check_advertised(bind_host: str, host_ip: Optional[str]) -> str:
    """advertised_host, or a ConfigError for a wildcard without host_ip, naming the flag and the
    variable: a server must never tell a remote peer a loopback address, which silently reaches the
    peer itself."""
    host = advertised_host(bind_host, host_ip)
    if host is None:
        raise ConfigError(
            f"--disaggregation-bootstrap-host {bind_host or repr(bind_host)} is a wildcard address "
            f"and {HOST_IP} is not set: the PD peers must be told this host's address, and which "
            f"of its addresses they reach cannot be known. Set {HOST_IP} (or SGLANG_HOST_IP) to "
            "the address the peers reach this host at, or give --disaggregation-bootstrap-host "
            "that address"
        )
    return host


def resolves_to_loopback(host: str) -> bool:
    """is_loopback, or a host name whose every address is loopback (a hosts-file alias of
    localhost); False for a name that does not resolve. Asks the resolver: call it from start-up
    or bootstrap threads, never per message."""
    host = host.strip("[]")
    if is_loopback(host):
        return True
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return False  # an address, not loopback
    except ValueError:
        pass
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return False
    return bool(found) and all(is_loopback(addr.split("%", 1)[0]) for addr in found)


def dials_itself(host: str, resolve: bool = False) -> bool:
    """A peer told `host` would reach its own host: a wildcard or loopback address (resolve: or a
    name that resolves only to loopback)."""
    return is_wildcard(host) or (resolves_to_loopback(host) if resolve else is_loopback(host))


SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def interface_of(host: str) -> Optional[str]:
    """The name of this host's network interface that holds `host` (an IP address), or None (a name, an
    address of another host, a NAT address, not Linux). Transfer engines that pick interfaces themselves
    (UCX) are pinned to it, so they listen on the address they were given, not on every device."""
    try:
        want = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    for _, name in socket.if_nameindex():
        if want in _addresses_of(name):
            return name
    return None


def _addresses_of(name: str) -> set:
    found = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            found.add(ipaddress.ip_address(raw[20:24]))
        except OSError:
            pass  # no IPv4 address on it
    try:
        with open("/proc/net/if_inet6") as f:  # hex address, index, prefix, scope, flags, name
            for line in f:
                cols = line.split()
                if len(cols) == 6 and cols[5] == name:
                    found.add(ipaddress.ip_address(bytes.fromhex(cols[0])))
    except OSError:
        pass
    return found
