"""The pipeline across hosts (--nnodes N > 1): node 0, the server, meets nodes 1..N-1 at --dist-init-addr.

    node R (serve_node)                          node 0 (NodeHub, in PipelineRunner's start-up)
    NodeJoin{host, pid}                   -->    waits for every node (LOAD_TIMEOUT_S)
                                          <--    NodeLaunch{session, record}: rank 0's launch record, no secrets
    its stages as local processes (Workers, with a LoadBoard of its own), loaded
    NodeStatus ready | failed{reason}     -->
    NodeStatus beat, every dist_timeout / 5  <->  NodeStatus beat                (also while idle)
                                          <--    NodeStatus stop                  (the server shuts down)

Stages are split over nodes in order (ParallelConfig.node_of); the stage wire between two hosts is tcp://
(pipeline/comm.py WirePlan). A node silent for --dist-timeout is lost: node 0 names it and fails (the engine
loop then fails every request and the server exits non-zero: a pipeline's KV and in-flight micro-batches cannot
be rebuilt, so the server needs a restart, node R's too); node R stops its stages and exits with
PEER_LOST_EXIT. A restarted node R cannot rejoin a running server. Every message is authenticated
(pipeline/node_messages.py), so the token (--disaggregation-auth-token or its variable) is required.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import threading
import time
from typing import Optional

import zmq

from sparkrelay.config import Config, ConfigError
from sparkrelay.envs import DisaggEnv
from sparkrelay.host import socket_folder
from sparkrelay.pipeline.launch import LOAD_TIMEOUT_S, PEER_LOST_EXIT, LoadBoard, Workers
from sparkrelay.pipeline.node_messages import NodeJoin, NodeLaunch, NodeLink, NodeStatus
from sparkrelay.transfer.wire import is_loopback, tcp_endpoint

logger = logging.getLogger(__name__)

SECRET_FIELDS = ("api_key", "disaggregation_auth_token")  # never sent to another host


def node_token(config: Config) -> str:
    """The shared secret of the pipeline's links; a ConfigError naming the flag when none is set."""
    token = DisaggEnv.read().token(config.disagg.disaggregation_auth_token)
    if not token:
        raise ConfigError(
            f"--nnodes {config.parallel.nnodes}: the pipeline's frames between hosts are authenticated; set "
            "--disaggregation-auth-token (or SPARKRELAY_DISAGGREGATION_AUTH_TOKEN) to the same value on every node"
        )
    return token


def node_ranks(config: Config, node: int) -> list[int]:
    """The pipeline ranks that `node` runs."""
    pc = config.parallel
    return [r for r in range(pc.pp_size) if pc.node_of(r) == node]


def beat_interval(config: Config) -> float:
    return config.parallel.dist_timeout / 5


class NodeHub:
    """Node 0's end: a ROUTER on --dist-init-addr; after `start`, a thread sends beats and declares a node lost
    when it has been silent for --dist-timeout (`failure`, `check`)."""

    def __init__(self, config: Config, token: str) -> None:
        self.config, self.nnodes = config, config.parallel.nnodes
        host, port = config.parallel.init_host_port()
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 500)
        try:
            sock.bind(tcp_endpoint(host, port))
        except zmq.ZMQError as e:
            sock.close(0)
            raise ConfigError(
                f"--dist-init-addr {host}:{port}: cannot listen there ({e})"
            ) from None
        self.link = NodeLink(sock, token)
        self.session = secrets.randbits(62)
        self.peers: dict[int, bytes] = {}  # node -> ROUTER identity
        self.hosts: dict[int, str] = {0: host}
        self.last_heard: dict[int, float] = {}
        self.failure: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def gather(self, timeout: float = LOAD_TIMEOUT_S) -> list[str]:
        """Wait for every node's NodeJoin -> the address of each node's pipeline sockets, by node."""
        deadline = time.monotonic() + timeout
        while len(self.peers) < self.nnodes - 1:
            got = self.link.recv(max(0.0, deadline - time.monotonic()))
            if got is None:
                missing = sorted(set(range(1, self.nnodes)) - set(self.peers))
                raise RuntimeError(
                    f"pipeline node(s) {missing} did not join within {timeout:.0f} s"
                )
            self._join(*got)
        return [self.hosts[n] for n in range(self.nnodes)]

    def _join(self, ident: bytes, msg) -> None:
        if not isinstance(msg, NodeJoin) or not 0 < msg.node < self.nnodes:
            logger.warning("pipeline: ignored %s from node %d while nodes join", msg.TYPE, msg.node)
            return
        if msg.node in self.peers:
            logger.warning("pipeline: node %d joined twice; the first one is kept", msg.node)
            return
        self.peers[msg.node], self.hosts[msg.node] = ident, msg.host
        self.last_heard[msg.node] = time.monotonic()
        logger.info("pipeline: node %d joined from %s (pid %d)", msg.node, msg.host, msg.pid)

    def launch(self, record: dict) -> None:
        """Send each node the launch record (without secrets)."""
        shared = dict(
            record, config={k: v for k, v in record["config"].items() if k not in SECRET_FIELDS}
        )
        text = json.dumps(shared)
        for node, ident in self.peers.items():
            self.link.send(lambda seq, n=node: NodeLaunch(n, seq, self.session, text), ident)

    def wait_ready(self, timeout: float = LOAD_TIMEOUT_S) -> None:
        waiting, deadline = set(self.peers), time.monotonic() + timeout
        while waiting:
            got = self.link.recv(max(0.0, deadline - time.monotonic()))
            if got is None:
                raise RuntimeError(
                    f"pipeline node(s) {sorted(waiting)} not loaded after {timeout:.0f} s"
                )
            msg = got[1]
            if not self._ours(msg):
                continue
            self.last_heard[msg.node] = time.monotonic()
            if msg.state == "failed":
                raise RuntimeError(
                    f"pipeline node {msg.node} ({self.hosts[msg.node]}): {msg.reason}"
                )
            if msg.state == "ready":
                waiting.discard(msg.node)

    def _ours(self, msg) -> bool:
        return (
            isinstance(msg, NodeStatus) and msg.session == self.session and msg.node in self.peers
        )

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sparkrelay-pp-nodes", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = beat_interval(self.config)
        while not self._stop.is_set() and self.failure is None:
            for node, ident in self.peers.items():
                self.link.send(lambda seq, n=node: NodeStatus(n, seq, self.session, "beat"), ident)
            until = time.monotonic() + interval
            while time.monotonic() < until and not self._stop.is_set():
                got = self.link.recv(min(0.05, max(0.0, until - time.monotonic())))
                if got is not None and self._ours(got[1]):
                    self._heard(got[1])
            self._check_silence()

    def _heard(self, msg: NodeStatus) -> None:
        self.last_heard[msg.node] = time.monotonic()
        if msg.state == "failed":
            self.failure = f"pipeline node {msg.node} ({self.hosts[msg.node]}): {msg.reason}"

    def _check_silence(self) -> None:
        timeout, now = self.config.parallel.dist_timeout, time.monotonic()
        for node, heard in self.last_heard.items():
            if self.failure is None and now - heard > timeout:
                ranks = node_ranks(self.config, node)
                self.failure = (
                    f"pipeline node {node} ({self.hosts[node]}, stages {ranks[0]}..{ranks[-1]}) lost: no "
                    f"message for {now - heard:.1f} s (--dist-timeout {timeout:g}); the server needs a restart"
                )
                logger.error("%s", self.failure)

    def check(self) -> None:
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def stop(self) -> None:
        """Tell every node to stop (after the pipeline's shutdown descriptor), end the thread, close."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for node, ident in self.peers.items():
            self.link.send(lambda seq, n=node: NodeStatus(n, seq, self.session, "stop"), ident)
        self.link.close()


# ---- node R --------------------------------------------------------------------------------------


def serve_node(config: Config) -> int:
    """`launch_server --node-rank R` (R > 0): join node 0, run this node's stages until told to stop (0) or
    until node 0 is lost (PEER_LOST_EXIT) or a stage fails (1)."""
    pc, host = config.parallel, config.server.host
    if is_loopback(host) or host in ("0.0.0.0", "::", ""):
        raise ConfigError(
            f"--node-rank {pc.node_rank}: --host {host!r} is where this node's pipeline sockets listen and what "
            "node 0 dials; give this host's address on the network node 0 reaches"
        )
    token = node_token(config)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 500)
    sock.connect(tcp_endpoint(*pc.init_host_port()))
    link = NodeLink(sock, token)
    try:
        link.send(lambda seq: NodeJoin(pc.node_rank, seq, host, os.getpid(), time.time()))
        launch = _await_launch(link, pc)
        return _run_stages(config, link, launch, token)
    finally:
        link.close()


def _await_launch(link: NodeLink, pc) -> NodeLaunch:
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while time.monotonic() < deadline:
        got = link.recv(max(0.0, deadline - time.monotonic()))
        if got is not None and isinstance(got[1], NodeLaunch):
            return got[1]
    raise RuntimeError(
        f"no launch record from node 0 at --dist-init-addr {pc.dist_init_addr} in {LOAD_TIMEOUT_S:.0f} s"
    )


def _local_record(config: Config, launch: NodeLaunch, token: str, ipc_dir: str) -> dict:
    """Node 0's record with this host's own settings: where its sockets bind, the secrets, its folder."""
    record = json.loads(launch.record)
    own = config.flat()
    keep = ("host", "disaggregation_bootstrap_host", "log_level", *SECRET_FIELDS)
    record["config"].update({k: own[k] for k in keep})
    threads = max(1, (os.cpu_count() or 1) // config.parallel.stages_per_node)
    return dict(
        record,
        ipc_dir=ipc_dir,
        parent_pid=os.getpid(),
        token=token,
        threads=threads,
        alone_threads=threads,
    )


def _run_stages(config: Config, link: NodeLink, launch: NodeLaunch, token: str) -> int:
    pc = config.parallel
    ranks = node_ranks(config, pc.node_rank)
    ipc_dir = socket_folder("sparkrelay-pp-", f"rank{pc.pp_size - 1}")
    board = LoadBoard(ipc_dir)
    workers = Workers(
        ranks, pc.pp_size, None, json.dumps(_local_record(config, launch, token, ipc_dir))
    )
    status = _Status(link, pc.node_rank, launch.session)
    try:
        try:
            workers.wait_ready(board)
        except RuntimeError as e:
            status.send("failed", str(e))
            return 1
        status.send("ready")
        logger.info(
            "pipeline node %d joined %s: stages %d..%d of %d running",
            pc.node_rank,
            pc.dist_init_addr,
            ranks[0],
            ranks[-1],
            pc.pp_size,
        )
        workers.watch()
        return _beat(config, link, workers, status)
    finally:
        workers.stop(timeout=0 if workers.failure else 10.0)
        board.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)


class _Status:
    def __init__(self, link: NodeLink, node: int, session: int) -> None:
        self.link, self.node, self.session = link, node, session

    def send(self, state: str, reason: str = "") -> None:
        self.link.send(lambda seq: NodeStatus(self.node, seq, self.session, state, reason[:4096]))


def _beat(config: Config, link: NodeLink, workers: Workers, status: _Status) -> int:
    """Beats both ways until node 0 says stop (0), goes silent (PEER_LOST_EXIT) or a stage dies (1)."""
    interval, timeout = beat_interval(config), config.parallel.dist_timeout
    heard = time.monotonic()
    while True:
        status.send("beat")
        until = time.monotonic() + interval
        while time.monotonic() < until:
            if workers.failure is not None:
                status.send("failed", workers.failure)
                logger.error("pipeline node %d: %s", status.node, workers.failure)
                return 1
            got = link.recv(min(0.05, max(0.0, until - time.monotonic())))
            if (
                got is None
                or not isinstance(got[1], NodeStatus)
                or got[1].session != status.session
            ):
                continue
            heard = time.monotonic()
            if got[1].state == "stop":
                logger.info("pipeline node %d: node 0 stopped the pipeline", status.node)
                return 0
        if time.monotonic() - heard > timeout:
            logger.error(
                "pipeline node %d: node 0 (%s) lost: no message for %.1f s (--dist-timeout %g); "
                "stopping this node's stages",
                status.node,
                config.parallel.dist_init_addr,
                time.monotonic() - heard,
                timeout,
            )
            workers.kill()
            return PEER_LOST_EXIT
