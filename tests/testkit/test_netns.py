"""The network-namespace kit itself: hosts reach each other, a server in one is reachable from the
test process through `forward`, `link_down` partitions both ways and `link_up` heals, and nothing
is left behind (also after an exception), with the root namespace's network never touched."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from itertools import permutations
from threading import Thread

import pytest

from testkit.netns import PREFIX, Hosts, netns_available, remove_stale

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(
        netns_available() is not None, reason=f"no network namespaces: {netns_available()}"
    ),
]

PORT = 8080  # any port: each namespace has its own
CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)"
# a server that sends an event and waits for the client's ack before the next one: a relay that
# buffered either way would deadlock it
STEPS = """
import socket, sys, threading
def serve(c):
    with c:
        for i in range(3):
            c.sendall(b"data: %d\\n\\n" % i)
            if c.recv(3) != b"ack":
                return
srv = socket.create_server(("127.0.0.1", int(sys.argv[1])), backlog=64)
while True:
    threading.Thread(target=serve, args=(srv.accept()[0],)).start()
"""


def kit_namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.startswith(PREFIX)}


def root_network() -> str:
    """The root namespace's links and addresses, which the kit must never change."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True)
    return links.stdout + addrs.stdout


def all_names(hosts: Hosts, names: str) -> set[str]:
    return {hosts.hub} | {hosts.ns(n) for n in names}


def wait_listening(hosts: Hosts, name: str, addr: tuple[str, int]) -> None:
    deadline = time.monotonic() + 10
    while addr not in hosts.listeners(name):
        assert time.monotonic() < deadline, f"nothing listens on {addr} in {name}"
        time.sleep(0.05)


def tcp_ok(hosts: Hosts, src: str, ip: str, port: int) -> bool:
    """A TCP connect from inside `src` with a 2 s timeout."""
    argv = hosts.argv(src, [sys.executable, "-c", CONNECT, ip, str(port)])
    return subprocess.run(argv, capture_output=True, timeout=20).returncode == 0


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n and (chunk := sock.recv(n - len(data))):
        data += chunk
    return data


def stepped_client(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for i in range(3):
            assert recv_exactly(s, 9) == b"data: %d\n\n" % i
            s.sendall(b"ack")
        assert s.recv(1) == b""  # the server's close comes through the relay


def test_hosts_serve_partition_heal_and_clean_up(tmp_path):
    root_before = root_network()
    (tmp_path / "hello.txt").write_text("hello from a")
    with Hosts(["a", "b", "c"]) as hosts:
        names, ip_a = all_names(hosts, "abc"), hosts.ip("a")
        assert names <= kit_namespaces()
        for src, dst in permutations("abc", 2):
            assert hosts.ping(src, hosts.ip(dst)), (src, dst)

        server = hosts.run(
            "a",
            [sys.executable, "-m", "http.server", "--bind", ip_a, str(PORT)],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_listening(hosts, "a", (ip_a, PORT))
        assert hosts.listeners("a") == [(ip_a, PORT)]
        assert hosts.listeners("b") == []
        local = hosts.forward("a", PORT)
        with urllib.request.urlopen(f"http://127.0.0.1:{local}/hello.txt", timeout=10) as r:
            assert r.read() == b"hello from a"
        assert tcp_ok(hosts, "b", ip_a, PORT)

        hosts.link_down("a")
        assert not hosts.ping("b", ip_a, 0.5) and not hosts.ping("a", hosts.ip("b"), 0.5)
        started = time.monotonic()
        assert not tcp_ok(hosts, "b", ip_a, PORT)
        assert time.monotonic() - started < 10

        hosts.link_up("a")  # the first packet may wait ~1 s for ARP to retry
        assert hosts.ping("a", hosts.ip("b"), 3) and hosts.ping("b", ip_a, 3)
        assert tcp_ok(hosts, "b", ip_a, PORT)
        assert root_network() == root_before
    assert server.poll() is not None
    assert not names & kit_namespaces()
    assert root_network() == root_before


def test_forward_streams_both_ways_and_many_at_once():
    with Hosts(["a"]) as hosts:
        server = hosts.run("a", [sys.executable, "-c", STEPS, str(PORT)])
        wait_listening(hosts, "a", ("127.0.0.1", PORT))
        local = hosts.forward("a", PORT, host="127.0.0.1")
        errors: list[BaseException] = []

        def client() -> None:
            try:
                stepped_client(local)
            except BaseException as e:  # handed to the main thread's assert
                errors.append(e)

        threads = [Thread(target=client) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors[0]
    assert server.poll() is not None


def test_cleanup_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with Hosts(["x", "y"]) as hosts:
            names = all_names(hosts, "xy")
            sleeper = hosts.run("x", ["sleep", "60"])
            relayed = hosts.forward("y", PORT)
            raise RuntimeError("boom")
    assert sleeper.poll() is not None
    with pytest.raises(ConnectionRefusedError):  # the relay is gone too
        socket.create_connection(("127.0.0.1", relayed), timeout=2)
    assert not names & kit_namespaces()


def test_remove_stale_takes_only_dead_owners():
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is now free: a run that was killed
    stale = f"{PREFIX}{dead.pid}-0-z"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with Hosts(["a"]) as hosts:  # entering already removes the stale one
            assert stale not in kit_namespaces()
            assert remove_stale() == []
            assert all_names(hosts, "a") <= kit_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
