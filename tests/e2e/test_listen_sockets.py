"""Every listening TCP socket of every process of a deployment binds the loopback by default.

A full PD deployment (sparkrelay router + PP=2 prefill + DSpark decode) and an aggregated PP=2
server are started through the real entry points; after one request through each, the listening
sockets of every process in each server's process tree (the server and its pipeline stage workers)
are read from /proc (no psutil, no `ss`): /proc/<pid>/fd gives the socket inodes a process holds,
/proc/<pid>/net/tcp{,6} the listening sockets of its network namespace with their inodes. Each must
be 127.0.0.1 or ::1.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sparkrelay.tools.cluster import PDSettings, Server, free_port, healthy, server_argv, start_pd

MODEL, DRAFTER = "models/tiny-qwen3", "models/tiny-qwen3-dspark"
TCP_LISTEN = "0A"  # st column of /proc/net/tcp

pytestmark = pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="needs Linux /proc")


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6} 'local_address' host part: 32-bit words in host (little-endian) byte
    order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            out.add(link[8:-1])
    return out


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket `pid` holds in LISTEN state."""
    mine, out = _socket_inodes(pid), []
    for table in ("tcp", "tcp6"):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == TCP_LISTEN and inode in mine:
                host, port = local.split(":")
                out.append((str(_address(host)), int(port, 16)))
    return out


def descendants(root: int) -> list[int]:
    """`root` and every process below it (by parent pid)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        ppid = int(text.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def tree_sockets(root: int) -> dict[int, list[tuple[str, int]]]:
    out = {}
    for pid in descendants(root):
        try:
            out[pid] = listening(pid)
        except FileNotFoundError:  # a short-lived child that exited meanwhile holds nothing
            assert pid != root and not Path(f"/proc/{pid}").exists(), f"cannot read /proc/{pid}"
    return out


def is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def assert_loopback_only(name: str, tree: dict[int, list[tuple[str, int]]]) -> None:
    exposed = {pid: [s for s in socks if not is_loopback(s[0])] for pid, socks in tree.items()}
    exposed = {pid: socks for pid, socks in exposed.items() if socks}
    assert not exposed, (
        f"{name}: sockets listening beyond the loopback (pid: [(address, port)]): {exposed}"
    )


def ports(tree: dict[int, list[tuple[str, int]]]) -> set[int]:
    return {port for socks in tree.values() for _, port in socks}


def generate(url: str, deadline: float) -> dict:
    body = {"text": "def main():", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
    req = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    while True:
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # a router may still be registering its workers
            if e.code != 503 or time.monotonic() > deadline:
                raise


def test_address_parsing_of_proc_net_tcp():
    assert _address("0100007F") == ipaddress.ip_address("127.0.0.1")
    assert _address("00000000") == ipaddress.ip_address("0.0.0.0")
    assert _address("00000000000000000000000001000000") == ipaddress.ip_address("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and is_loopback("::ffff:127.0.0.1")


def test_rendezvous_store_listens_on_loopback_only():
    from sparkrelay.pipeline.launch import rendezvous_store

    store = rendezvous_store(None, 1)  # torch's own TCPStore(host, port) would listen on `*`
    try:
        mine = listening(os.getpid())
        assert ("127.0.0.1", store.port) in mine, mine
        assert all(port != store.port for addr, port in mine if addr != "127.0.0.1"), mine
        with pytest.raises(
            OSError, match=f"--dist-init-port {store.port}: cannot listen on 127.0.0.1"
        ):
            rendezvous_store(store.port, 1)
    finally:
        del store


def test_no_process_listens_beyond_loopback(tmp_path):
    # the aggregated PP=2 server starts alongside the PD deployment (the stages load in parallel)
    agg_port = free_port()
    agg_log = open(tmp_path / "aggregated.log", "w")
    agg = subprocess.Popen(
        server_argv(MODEL, agg_port, ["--pp-size", "2"]),
        stdout=agg_log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    pd_dist = free_port()
    cluster = None
    try:
        cluster = start_pd(
            PDSettings(
                model=MODEL,
                drafter=DRAFTER,
                pp_size=2,
                prefill_args=["--dist-init-port", str(pd_dist)],
            ),
            str(tmp_path),
        )
        agg_url = f"http://127.0.0.1:{agg_port}"
        deadline = time.monotonic() + 120
        while not healthy(agg_url):
            assert agg.poll() is None and time.monotonic() < deadline, (
                tmp_path / "aggregated.log"
            ).read_text()
            time.sleep(0.2)
        # one request through each, so every lazily opened socket exists
        assert generate(cluster.url, time.monotonic() + 60)["meta_info"]["completion_tokens"] == 4
        assert generate(agg_url, time.monotonic())["meta_info"]["completion_tokens"] == 4
        with urllib.request.urlopen(agg_url + "/server_info", timeout=10) as r:
            agg_dist = json.loads(r.read())["dist_init_port"]

        trees = {
            "router": tree_sockets(cluster.router.proc.pid),
            "prefill": tree_sockets(cluster.prefill.proc.pid),
            "decode": tree_sockets(cluster.decode.proc.pid),
            "aggregated": tree_sockets(agg.pid),
        }
        # the lists are not empty by accident: each tree holds its known ports, and the PP trees
        # their stage workers
        assert int(cluster.router.url.rsplit(":", 1)[1]) in ports(trees["router"])
        assert {
            int(cluster.prefill.url.rsplit(":", 1)[1]),
            cluster.bootstrap_port,
        } <= ports(trees["prefill"])
        # CPU stages meet over ipc:// files: --dist-init-port is NCCL's alone, no TCP rendezvous listens
        assert pd_dist not in ports(trees["prefill"]) and agg_dist is None
        assert int(cluster.decode.url.rsplit(":", 1)[1]) in ports(trees["decode"])
        assert agg_port in ports(trees["aggregated"])
        assert len(trees["prefill"]) >= 2 and len(trees["aggregated"]) >= 2, trees
        for name, tree in trees.items():
            assert_loopback_only(name, tree)
    finally:
        if cluster is not None:
            cluster.stop()
        Server("aggregated", "", agg, agg_log.name).stop()
        agg_log.close()
