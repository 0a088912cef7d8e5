"""Real network namespaces for multi-host tests on one machine (root and iproute2 only).

`with Hosts(["a", "b"]) as hosts:` makes one namespace per host and a "hub" namespace holding a
Linux bridge; each host has `lo` up and a veth (`eth0`) into that bridge with an address in a
private /24. The rules, and why:
- Only 127.0.0.1 and addresses inside the kit's own namespaces are used, and the bridge lives in
  the hub namespace: the root namespace gets no interface, address or route, so a test cannot
  disturb the machine's network.
- Namespace names are `srk-<pid>-<seq>[-<host>]`: unique per run, and the pid lets
  `remove_stale()` find what a killed run left. Interface names (`br0`, `eth0`, `p<i>`) exist only
  inside the kit's namespaces, so they cannot clash and stay far below the 15-character limit.
- Everything is undone on exit, also on an exception or Ctrl-C (`finally`), with an atexit hook as
  the last resort: processes killed and reaped, namespaces deleted (which deletes their veths).
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import re
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

PREFIX = "srk-"
NETNS_DIR = "/var/run/netns"  # where `ip netns add` mounts the namespaces it names
RELAY = Path(__file__).with_name("netns_relay.py")
_OWNER = re.compile(rf"^{PREFIX}(\d+)-")
_seq = itertools.count()
_live: set[Hosts] = set()


def _ip(*args: str, check: bool = True) -> str:
    """Runs `ip ARGS`; a failure raises with ip's own message, since that names the cause."""
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


@functools.cache
def netns_available() -> str | None:
    """None when this machine can run the kit, else the reason (for `pytest.mark.skipif`); it
    really builds a namespace with a bridge and a veth, since root alone does not prove that."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "ss"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
        _ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        return str(e)
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(ns: str) -> None:
    """SIGKILLs whatever still runs in `ns` (a grandchild that left its process group): a
    namespace outlives `ip netns del` while a process holds it."""
    for pid in _ip("netns", "pids", ns, check=False).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def remove_stale() -> list[str]:
    """Deletes the kit's namespaces whose owning pid is gone (a run killed before its cleanup),
    killing what still runs inside; returns their names. A live run's namespaces are kept."""
    removed = []
    for ns in _namespaces():
        owner = _OWNER.match(ns)
        if owner and not _pid_alive(int(owner[1])):
            _kill_inside(ns)
            _ip("netns", "del", ns, check=False)
            removed.append(ns)
    return removed


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group, SIGKILL after 2 s, then reaped: nothing outlives the test."""
    for sig, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
            break
        except subprocess.TimeoutExpired:
            continue
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


class Hosts:
    """Named hosts, one network namespace each, on one bridge; a context manager that undoes all
    it made on exit. Addresses are 10.77.X.1, .2, ... in the order of `names`."""

    def __init__(self, names: list[str]):
        if len(set(names)) != len(names) or not all(re.fullmatch(r"\w{1,16}", n) for n in names):
            raise ValueError(f"host names must be distinct words of 1-16 characters: {names}")
        seq = next(_seq)
        self.hub = f"{PREFIX}{os.getpid()}-{seq}"
        # each group is its own L2 island, so X only has to be readable, not globally unique
        self.subnet = f"10.77.{(os.getpid() + seq) % 254 + 1}"
        self._ns = {n: f"{self.hub}-{n}" for n in names}
        self._addr = {n: f"{self.subnet}.{i}" for i, n in enumerate(names, 1)}
        self._port = {n: f"p{i}" for i, n in enumerate(names, 1)}  # hub side of n's veth
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> Hosts:
        remove_stale()
        _live.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._created.append(ns)

    def _build(self) -> None:
        self._add_ns(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge", "forward_delay", "0")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for name in self._ns:
            self._add_host(name)

    def _add_host(self, name: str) -> None:
        """The veth is made inside the host's namespace with its peer sent to the hub, so it never
        appears in the root namespace, not even for a moment."""
        ns, port = self._ns[name], self._port[name]
        self._add_ns(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip(
            "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.hub
        )
        _ip("-n", ns, "addr", "add", f"{self._addr[name]}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", self.hub, "link", "set", port, "master", "br0", "up")

    def ns(self, name: str) -> str:
        """The namespace's name, as `ip netns` knows it."""
        return self._ns[name]

    def ip(self, name: str) -> str:
        """The host's address on the bridge."""
        return self._addr[name]

    def argv(self, name: str, argv: list[str]) -> list[str]:
        """`argv` prefixed to run inside the host's namespace."""
        return ["ip", "netns", "exec", self._ns[name], *argv]

    def run(self, name: str, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        """Starts `argv` in the host's namespace in a session of its own (so its whole group can be
        killed); it is stopped on exit if still running."""
        popen_kwargs["start_new_session"] = True
        proc = subprocess.Popen(self.argv(name, argv), **popen_kwargs)
        self._procs.append(proc)
        return proc

    def link_down(self, name: str) -> None:
        """Partitions the host: its bridge port goes down, so frames are dropped silently both ways
        (peers see timeouts, as behind a dead switch) while its own address and routes stay."""
        _ip("-n", self.hub, "link", "set", self._port[name], "down")

    def link_up(self, name: str) -> None:
        """Heals `link_down`; connections that were only waiting carry on."""
        _ip("-n", self.hub, "link", "set", self._port[name], "up")

    def listeners(self, name: str) -> list[tuple[str, int]]:
        """(address, port) of each TCP socket listening in the host's namespace, from `ss`."""
        out = subprocess.run(
            self.argv(name, ["ss", "-ltnH"]), capture_output=True, text=True, check=True
        ).stdout
        return [_split_addr(line.split()[3]) for line in out.splitlines() if line.strip()]

    def ping(self, src: str, dst_ip: str, timeout: float = 1.0) -> bool:
        """ICMP echoes from host `src` to `dst_ip` (one per 0.2 s); True when one is answered within
        `timeout`."""
        argv = [sys.executable, str(RELAY), "ping", f"{NETNS_DIR}/{self._ns[src]}", dst_ip]
        return subprocess.run([*argv, str(timeout)], timeout=timeout + 30).returncode == 0

    def forward(self, name: str, port: int, host: str | None = None) -> int:
        """A port on the root namespace's 127.0.0.1 whose connections are relayed to host:port as
        dialled from inside `name`'s namespace (host defaults to `name`'s own address). The test
        process stays in the root namespace, so this is how it reaches a server; pass another
        host's address to go through the bridge (and through a `link_down`)."""
        target = host or self._addr[name]
        argv = [sys.executable, str(RELAY), "relay", f"{NETNS_DIR}/{self._ns[name]}", target]
        proc = subprocess.Popen(
            [*argv, str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self._procs.append(proc)
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline() if ready else b""
        if not line.strip().isdigit():
            raise RuntimeError(f"the relay to {name} did not start (rc={proc.poll()}); see stderr")
        return int(line)

    def close(self) -> None:
        """Stops every process this object started, then deletes its namespaces; safe to repeat."""
        _live.discard(self)
        while self._procs:
            _stop(self._procs.pop())
        while self._created:
            ns = self._created.pop()
            _kill_inside(ns)
            _ip("netns", "del", ns, check=False)


def _split_addr(text: str) -> tuple[str, int]:
    """`10.0.0.1:80`, `[::]:80`, `*:80` or `127.0.0.53%lo:53` -> (address, port)."""
    addr, port = text.rsplit(":", 1)
    return addr.strip("[]").split("%")[0], int(port)


@atexit.register
def _close_all() -> None:
    """The last resort for a run that never reached a `finally` (e.g. sys.exit in a thread)."""
    for hosts in list(_live):
        hosts.close()
