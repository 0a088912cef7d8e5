"""PD across hosts (docs/pd_across_hosts.md): the address each server advertises to its peers
(SPARKRELAY_HOST_IP with a wildcard bind, the bind address otherwise, SPARKRELAY_HOST_IP always when
set), the start-up refusal of a wildcard bind without it, and the two run-time refusals of a
loopback address told to a remote peer. "Remote" hosts are documentation addresses (10.0.0.x,
203.0.113.x) nobody dials: where a test must reach one, its bootstrap reads are sent to loopback."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
import zmq

from sparkrelay.config import ConfigError
from sparkrelay.transfer import decode_bootstrap, wire
from sparkrelay.transfer.base import KVPoll
from sparkrelay.transfer.bootstrap import BootstrapServer, bootstrap_url, prefill_book
from sparkrelay.transfer.decode_agent import DecodeAgent
from sparkrelay.transfer.frames import FramesCarrier
from sparkrelay.transfer.prefill_agent import PrefillAgent
from sparkrelay.transfer.protocol import TransferInfo
from testkit.transfer import HOST, SCHEMA, compare, expected_parts, make_parts, route, wait_for

WILDCARD_REFUSAL = "--disaggregation-bootstrap-host 0.0.0.0 is a wildcard address"


class Recording(FramesCarrier):
    """The zmq carrier, remembering the host its engine would be opened on."""

    host = None

    def open(self, host: str) -> None:
        self.host = host


@pytest.fixture
def server():
    made = []

    def make(host=HOST, pp_size=1, host_ip=None) -> BootstrapServer:
        s = BootstrapServer(host, 0, pp_size, SCHEMA, None, 16, "bfloat16", host_ip=host_ip)
        s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


@pytest.fixture
def stage():
    made = []

    def make(srv, bind, pp=0, pp_size=1, host_ip=None, statuses=None) -> PrefillAgent:
        def on_status(room, state, reason):
            if statuses is not None:
                statuses.append((room, state, reason))

        p = PrefillAgent(
            pp,
            pp_size,
            SCHEMA,
            compare,
            srv.url,
            bind,
            5.0,
            on_status,
            carrier=Recording(),
            host_ip=host_ip,
        )
        made.append(p)
        p.start()
        return p

    yield make
    for p in made:
        p.close()


def decode_agent(bind: str, host_ip=None, carrier=None) -> DecodeAgent:
    return DecodeAgent(
        SCHEMA, compare, expected_parts, bind, 1.0, 1.0, 1.0, 2, 1, carrier=carrier, host_ip=host_ip
    )


def endpoint(srv: BootstrapServer, pp: int) -> dict:
    code, body = route(srv, "0", "0", "0", str(pp))
    assert code == 200, body
    return json.loads(body)


# ---- which address is advertised -----------------------------------------------------------------


@pytest.mark.parametrize(
    "bind,host_ip,advertised",
    [
        ("127.0.0.1", None, "127.0.0.1"),  # one host, as before
        ("10.0.0.1", None, "10.0.0.1"),  # an explicit bind address is what peers dial
        ("0.0.0.0", "10.0.0.1", "10.0.0.1"),  # a wildcard needs SPARKRELAY_HOST_IP
        ("::", "fd00::1", "fd00::1"),
        ("10.0.0.1", "203.0.113.7", "203.0.113.7"),  # set explicitly it wins (NAT, multi-homed)
        ("127.0.0.1", "[fd00::1]", "fd00::1"),
    ],
)
def test_the_advertised_address(bind, host_ip, advertised):
    assert wire.advertised_host(bind, host_ip) == advertised
    assert wire.check_advertised(bind, host_ip) == advertised


@pytest.mark.parametrize("bind", ["0.0.0.0", "::", "[::]", ""])
def test_a_wildcard_without_host_ip_is_refused_naming_the_flag_and_the_variable(bind):
    assert wire.advertised_host(bind, None) is None
    with pytest.raises(ConfigError) as e:
        wire.check_advertised(bind, None)
    msg = str(e.value)
    assert "--disaggregation-bootstrap-host" in msg and "is a wildcard address" in msg, msg
    assert "Set SPARKRELAY_HOST_IP (or SGLANG_HOST_IP)" in msg, msg


def test_the_decode_tells_and_names_its_engine_by_the_advertised_address():
    for bind, host_ip, advertised in [
        ("0.0.0.0", "10.0.0.2", "10.0.0.2"),
        ("127.0.0.1", "203.0.113.9", "203.0.113.9"),
        ("127.0.0.1", None, "127.0.0.1"),
    ]:
        carrier = Recording()
        decode = decode_agent(bind, host_ip, carrier)
        assert decode.host == advertised and carrier.host == advertised
        decode.close()
    with pytest.raises(ConfigError, match=WILDCARD_REFUSAL):
        decode_agent("0.0.0.0")  # refused before any socket is bound


def test_the_bootstrap_server_advertises_host_ip_for_a_wildcard(server, stage):
    with pytest.raises(ConfigError, match=WILDCARD_REFUSAL):
        BootstrapServer("0.0.0.0", 0, 1, SCHEMA, None, 16, "bfloat16")
    srv = server("0.0.0.0", pp_size=2, host_ip="10.0.0.1")
    assert srv.advertised == "10.0.0.1" and srv.url.startswith("http://127.0.0.1:")
    # a stage with its own SPARKRELAY_HOST_IP registers it, and its engine is named by it
    p0 = stage(srv, "0.0.0.0", 0, 2, host_ip="10.0.0.5")
    assert p0._carrier.host == "10.0.0.5"
    # one without (a wildcard registered as is, from this host): the server's advertised address
    p1 = stage(srv, "0.0.0.0", 1, 2)
    assert endpoint(srv, 0) == {"rank_ip": "10.0.0.5", "rank_port": p0.port}
    assert endpoint(srv, 1) == {"rank_ip": "10.0.0.1", "rank_port": p1.port}
    # a wildcard registered from another host: the address it came from
    assert srv._stage_host("0.0.0.0", "10.0.0.7") == "10.0.0.7"


def test_an_explicit_host_ip_wins_over_the_bind_address(server, stage):
    srv = server(HOST, host_ip="203.0.113.7")
    p = stage(srv, HOST)  # a stage of this server, given no SPARKRELAY_HOST_IP of its own
    assert endpoint(srv, 0) == {"rank_ip": "203.0.113.7", "rank_port": p.port}
    assert srv._stage_host("10.9.9.9", "127.0.0.1") == "10.9.9.9"  # another address, as given
    # bound to an address (never started here): its own stages register it from it
    nat = BootstrapServer("10.0.0.1", 0, 1, SCHEMA, None, 16, "bfloat16", host_ip="203.0.113.7")
    assert nat._stage_host("10.0.0.1", "10.0.0.1") == "203.0.113.7"
    assert nat._stage_host("0.0.0.0", "10.0.0.8") == "10.0.0.8"  # a stage on another host


# ---- run time: never a loopback address to a remote peer -----------------------------------------


def test_a_decode_refuses_a_remote_prefill_that_advertised_loopback(make_cluster, monkeypatch):
    """The room names the prefill at 10.0.0.1, whose stages registered 127.0.0.1 (a prefill bound to
    loopback): the decode fails the room with the reason, and dials none of them, not even for an
    ABORT. The test reaches that "remote" bootstrap server on loopback."""
    c = make_cluster()

    def via_loopback(host, port):
        return bootstrap_url(HOST, port)

    monkeypatch.setattr(prefill_book, "bootstrap_url", via_loopback)
    monkeypatch.setattr(decode_bootstrap, "bootstrap_url", via_loopback)
    room = 31
    c.add(room)
    c.decode.begin(room, "10.0.0.1", c.server.port, 5)
    res = c.decode_state(room, KVPoll.Failed)
    assert res.permanent, res  # a 400: the same prefill fails every room the same way
    assert res.reason.startswith(
        f"the prefill at 10.0.0.1:{c.server.port} advertised 127.0.0.1:{c.prefills[0].port} for "
        "pp_rank 0, a loopback address"
    ), res.reason
    assert "SPARKRELAY_HOST_IP (or --disaggregation-bootstrap-host)" in res.reason, res.reason
    time.sleep(0.3)  # no TRANSFER_INFO, no ABORT reached a stage
    assert [p.poll(room).state for p in c.prefills] == [KVPoll.Bootstrapping] * 2
    # loopback to loopback is one host, as before: a name that resolves to loopback included
    c.add(32)
    c.decode.begin(32, "localhost", c.server.port, 5)
    c.send(32, 0)
    c.send(32, 1)
    c.decode_state(32, KVPoll.Success)
    assert c.decode.take(32)[1]["meta"].data == make_parts(1, 32)[1].data
    assert c.threads_alive()


@contextlib.contextmanager
def pull_socket():
    """(a PULL socket on loopback standing for a decode, its port)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port(f"tcp://{HOST}")
    try:
        yield sock, port
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_prefill_beyond_loopback_refuses_a_decode_that_advertised_loopback(server, stage):
    """A stage bound to every interface (advertised as 10.0.0.1) gets a TRANSFER_INFO naming a
    loopback decode: the room fails with the reason and nothing goes to that address, whether the
    message came before the room or after; a decode at a real address is accepted."""
    statuses: list = []
    srv = server()
    p = stage(srv, "0.0.0.0", host_ip="10.0.0.1", statuses=statuses)
    assert endpoint(srv, 0) == {"rank_ip": "10.0.0.1", "rank_port": p.port}
    with pull_socket() as (sink, port), wire_to(p.port) as send:
        p.add_room(41, 5)
        send(TransferInfo(41, HOST, port, 5, SCHEMA).encode())
        send(TransferInfo(42, "localhost", port, 5, SCHEMA).encode())  # before its room exists
        send(TransferInfo(43, "10.0.0.2", port, 5, SCHEMA).encode())
        p.add_room(43, 5)
        wait_for(lambda: p.poll(41).state == KVPoll.Failed, what="room 41 failed")
        p.add_room(42, 5)
        for room, host in ((41, HOST), (42, "localhost")):
            res = wait_for(lambda: p.poll(room).state == KVPoll.Failed and p.poll(room))
            assert res.reason.startswith(
                f"the decode advertised {host}:{port}, a loopback address, and this prefill stage "
                "is bound to 0.0.0.0"
            ), res.reason
            assert "SPARKRELAY_HOST_IP (or --disaggregation-bootstrap-host)" in res.reason
        wait_for(lambda: p.poll(43).state == KVPoll.WaitingForInput, what="room 43 accepted")
        p.send(41, make_parts(0, 41))  # a failed room sends nothing
        assert sink.poll(300) == 0
    assert wait_for(lambda: sorted(r for r, _, _ in statuses) == [41, 42] and statuses)


@contextlib.contextmanager
def wire_to(port: int):
    """send(frames) to a transfer port on loopback, as a decode would."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(wire.tcp_endpoint(HOST, port))
    try:
        yield sock.send_multipart
    finally:
        sock.close()
        ctx.term()


def test_loopback_checks():
    assert all(wire.dials_itself(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "::"))
    assert not any(wire.dials_itself(h) for h in ("10.0.0.1", "fd00::1", "prefill-a.example"))
    assert wire.resolves_to_loopback("localhost") and not wire.resolves_to_loopback("10.0.0.1")
    assert not wire.resolves_to_loopback("no-such-host.invalid")
    assert wire.local_host("0.0.0.0") == "127.0.0.1" and wire.local_host("[::]") == "::1"
    assert wire.local_host("10.0.0.1") == "10.0.0.1"


def test_interface_of_names_the_device_that_holds_an_address():
    """NIXL pins UCX to this device (engines.NixlEngine), so UCX listens only on the given address."""
    assert wire.interface_of("127.0.0.1") == "lo"
    assert wire.interface_of("[::1]") in ("lo", None)  # None where IPv6 is off
    assert wire.interface_of("192.0.2.77") is None  # TEST-NET-1: not on this host
    assert wire.interface_of("decode.example") is None  # a name: the user pins UCX_NET_DEVICES
