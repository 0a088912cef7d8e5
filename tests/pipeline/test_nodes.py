"""The pipeline across hosts, in one process on 127.0.0.1: the flags' checks, the wire plan, the stage wire's
authenticated tcp:// links (a forged or replayed frame is dropped, never taken for a step), the node channel's
messages, and a node that joins, beats, is stopped, or is lost. The real thing across network namespaces is
tests/e2e/test_multihost.py."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
import zmq

from sparkrelay.config import Config, ConfigError
from sparkrelay.pipeline.comm import PeerLost, SocketWire, WirePlan
from sparkrelay.pipeline.node_messages import NodeJoin, NodeLink, NodeStatus
from sparkrelay.pipeline.nodes import NodeHub, node_ranks, node_token
from sparkrelay.tools.cluster import free_port

TOKEN = "node-test-token"


def nodes_config(**over) -> Config:
    base = dict(pp_size=4, nnodes=2, dist_init_addr=f"127.0.0.1:{free_port()}", dist_timeout=1.0)
    return Config().replace(**{**base, **over})


@pytest.mark.parametrize(
    "over,flag",
    [
        (dict(pp_size=3), "--pp-size 3 over --nnodes 2"),
        (dict(dist_init_addr=None), "needs --dist-init-addr"),
        (dict(dist_init_addr="host-without-port"), "--dist-init-addr must be HOST:PORT"),
        (dict(node_rank=2), "--node-rank must be in 0..1"),
        (dict(dist_init_port=1234), "--dist-init-port is the one-host rendezvous"),
        (dict(dist_timeout=0.0), "--dist-timeout must be positive"),
    ],
)
def test_node_flags_are_checked(over, flag):
    with pytest.raises(ConfigError, match=flag):
        nodes_config(**over).validate()


def test_stages_split_over_nodes_in_order():
    c = nodes_config()
    assert [c.parallel.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert node_ranks(c, 1) == [2, 3]
    assert nodes_config(dist_init_addr="[::1]:5000").parallel.init_host_port() == ("::1", 5000)


def test_token_is_required_across_hosts(monkeypatch):
    monkeypatch.delenv("SPARKRELAY_DISAGGREGATION_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("SGLANG_DISAGGREGATION_AUTH_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="--disaggregation-auth-token"):
        node_token(nodes_config())
    assert node_token(nodes_config(disaggregation_auth_token=TOKEN)) == TOKEN


def test_wire_plan_puts_tcp_only_where_a_sender_is_on_another_host(tmp_path):
    plan = WirePlan(4, str(tmp_path), (0, 0, 1, 1), ("10.0.0.1", "10.0.0.2"), 5000)
    assert plan.inbox(0) == "tcp://10.0.0.1:5001"  # its sender, rank 3, runs on node 1
    assert plan.inbox(1) == f"ipc://{tmp_path}/rank1"
    assert plan.inbox(2) == "tcp://10.0.0.2:5003"
    assert plan.inbox(3) == f"ipc://{tmp_path}/rank3"
    one_host = WirePlan(2, str(tmp_path))
    assert not any(one_host.remote_inbox(r) for r in range(2))
    assert WirePlan.from_dict(4, str(tmp_path), plan.to_dict()) == plan


def _tcp_pair(tmp_path, token=TOKEN):
    """Rank 1's wire (inbox tcp:// on 127.0.0.1, its sender rank 0 on 'another host') and rank 0's."""
    port = free_port() - 1
    plan = WirePlan(2, str(tmp_path), (0, 1), ("127.0.0.1", "127.0.0.1"), port)
    return SocketWire(plan, 1, token), SocketWire(plan, 0, token), plan


def test_tcp_link_carries_tagged_frames_and_drops_forged_and_replayed(tmp_path):
    rx, tx, plan = _tcp_pair(tmp_path)
    try:
        stranger = zmq.Context.instance().socket(zmq.PUSH)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(plan.inbox(1))
        stranger.send_multipart([b"\0" * 32, (1).to_bytes(8, "big"), b"\1" * 32])  # a forged tag
        sent = torch.arange(8, dtype=torch.int64)
        tx.send(sent, 1)
        got = torch.empty(8, dtype=torch.int64)
        rx.recv(got, 0, lambda: None, time.monotonic() + 10)
        assert torch.equal(got, sent)
        # a recorded genuine message replayed: same tag, an old count
        replay = [bytes(sent.numpy().tobytes()), (1).to_bytes(8, "big")]
        stranger.send_multipart(rx._auth.seal(replay))
        tx.send(sent + 1, 1)
        rx.recv(got, 0, lambda: None, time.monotonic() + 10)
        assert torch.equal(got, sent + 1)
        # ZMQ fair-queues between connections: the stranger's frames may still wait; drain them
        with pytest.raises(PeerLost, match="no message from rank 0"):
            rx.recv(got, 0, lambda: None, time.monotonic() + 0.5)
        assert rx._rejects.counts() == {"auth": 1, "replay": 1}
        stranger.close()
    finally:
        rx.close()
        tx.close()


def test_a_stranger_on_the_stage_wire_is_logged_once(tmp_path, caplog):
    """20 frames from a process without the token: all dropped and counted, one log line naming its
    address; the genuine frame after them is taken."""
    caplog.set_level(logging.WARNING, logger="sparkrelay.pipeline")
    rx, tx, plan = _tcp_pair(tmp_path)
    stranger = zmq.Context.instance().socket(zmq.PUSH)
    stranger.setsockopt(zmq.LINGER, 1000)
    try:
        stranger.connect(plan.inbox(1))
        for i in range(20):
            stranger.send_multipart([b"x" * 8, (i + 1).to_bytes(8, "big"), b"\1" * 32])
        sent = torch.arange(8, dtype=torch.int64)
        tx.send(sent, 1)
        got = torch.empty(8, dtype=torch.int64)
        rx.recv(got, 0, lambda: None, time.monotonic() + 10)
        assert torch.equal(got, sent)
        with pytest.raises(PeerLost):  # ZMQ fair-queues connections: drain the stranger's rest
            rx.recv(got, 0, lambda: None, time.monotonic() + 0.5)
        assert rx._rejects.counts() == {"auth": 20}
        lines = [r.getMessage() for r in caplog.records if "pipeline inbox" in r.getMessage()]
        assert len(lines) == 1 and "from 127.0.0.1" in lines[0], lines
    finally:
        stranger.close()
        rx.close()
        tx.close()


def test_node_link_drops_untagged_replayed_and_stale_messages():
    ctx = zmq.Context.instance()
    port = free_port()
    a, b = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    a.bind(f"tcp://127.0.0.1:{port}")
    b.connect(f"tcp://127.0.0.1:{port}")
    rx, tx = NodeLink(a, TOKEN), NodeLink(b, TOKEN)
    try:
        b.send_multipart(NodeStatus(1, 5, 7, "beat").encode())  # no tag
        tx.send(lambda seq: NodeJoin(1, seq, "10.0.0.2", 42, time.time() - 3600))  # stale
        tx.send(lambda seq: NodeStatus(1, seq, 7, "beat"))
        _, msg = rx.recv(5.0)
        assert isinstance(msg, NodeStatus) and msg.seq == 2
        tx._sent = 1  # a replay of an earlier count
        tx.send(lambda seq: NodeStatus(1, seq, 7, "ready"))
        assert rx.recv(0.5) is None
        assert rx._rejects.counts() == {"node-frame": 1, "stale": 1, "replay": 1}
    finally:
        rx.close()
        tx.close()


def _fake_node(config: Config, node: int, stop_after: float, answers: list) -> threading.Thread:
    """A node R that joins, says ready, beats for `stop_after` s (forever: None) and records what it hears."""

    def run() -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect("tcp://{}:{}".format(*config.parallel.init_host_port()))
        link = NodeLink(sock, TOKEN)
        link.send(lambda seq: NodeJoin(node, seq, "127.0.0.1", 4242, time.time()))
        _, launch = link.recv(10.0)
        answers.append(launch)
        link.send(lambda seq: NodeStatus(node, seq, launch.session, "ready"))
        end = time.monotonic() + (stop_after or 1e9)
        while time.monotonic() < end:
            link.send(lambda seq: NodeStatus(node, seq, launch.session, "beat"))
            got = link.recv(0.1)
            if got is not None and got[1].state == "stop":
                answers.append("stop")
                break
        link.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_hub_launches_a_node_without_secrets_and_stops_it():
    config = nodes_config(api_key="sk-secret", disaggregation_auth_token=TOKEN)
    hub, answers = NodeHub(config, TOKEN), []
    t = _fake_node(config, 1, None, answers)
    assert hub.gather(10.0) == ["127.0.0.1", "127.0.0.1"]
    hub.launch({"config": config.flat(), "partition": [[0, 1]]})
    hub.wait_ready(10.0)
    hub.start()
    time.sleep(1.5)  # longer than --dist-timeout: the beats keep it alive
    hub.check()
    hub.stop()
    t.join(5)
    assert "sk-secret" not in answers[0].record and TOKEN not in answers[0].record
    assert answers[-1] == "stop"


def test_hub_declares_a_silent_node_lost_within_dist_timeout():
    config = nodes_config(disaggregation_auth_token=TOKEN)
    hub, answers = NodeHub(config, TOKEN), []
    _fake_node(config, 1, 0.3, answers)
    hub.gather(10.0)
    hub.launch({"config": config.flat()})
    hub.wait_ready(10.0)
    hub.start()
    deadline = time.monotonic() + 5
    while hub.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        with pytest.raises(RuntimeError, match=r"pipeline node 1 \(127.0.0.1, stages 2..3\) lost"):
            hub.check()
    finally:
        hub.stop()
