"""Transfer agents on loopback for the tests: a bootstrap server, prefill stages and a decode, with
fake parts."""

from __future__ import annotations

import random
import threading
import time

import torch

from sparkrelay.transfer.backends import get_backend
from sparkrelay.transfer.base import KVPoll, Part, PartSpec, PrefillTransfer
from sparkrelay.transfer.bootstrap import BootstrapServer, http_request
from sparkrelay.transfer.landing import Landing

SCHEMA = {
    "version": 1,
    "page_size": 16,
    "dtype": "bfloat16",
    "num_layers": 4,
    "hidden": 8,
    "pp_size": 2,
}
HOST = "127.0.0.1"
SAME = object()  # Cluster(decode_token=SAME): the decode uses the prefill's token


def compare(a: dict, b: dict) -> list[str]:
    return [
        f"{k}: prefill={a.get(k)!r} decode={b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]


def expected_parts(schema: dict, prompt_len: int, prefix: int = 0) -> dict[int, list[PartSpec]]:
    """Each stage sends its layers' KV [layers, 2, prompt_len, hidden]; the last stage also a meta
    row."""
    if prompt_len <= 0:
        raise ValueError(f"prompt_len {prompt_len}: nothing to transfer")
    pp, per = schema["pp_size"], schema["num_layers"] // schema["pp_size"]
    out = {
        s: [
            PartSpec(
                "kv",
                tuple(range(s * per, (s + 1) * per)),
                "bfloat16",
                (per, 2, prompt_len, schema["hidden"]),
            )
        ]
        for s in range(pp)
    }
    out[pp - 1].append(PartSpec("meta", (), "int64", (4,)))
    return out


def make_parts(pp_rank: int, room: int, prompt_len: int = 5) -> list[Part]:
    rng = random.Random(room * 10 + pp_rank)
    return [
        Part(spec, rng.randbytes(spec.nbytes))
        for spec in expected_parts(SCHEMA, prompt_len)[pp_rank]
    ]


def wait_for(pred, timeout: float = 5.0, what: str = "condition"):
    """pred()'s first truthy value, polled every 2 ms; AssertionError naming `what` after `timeout`
    seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.002)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Cluster:
    def __init__(
        self,
        bootstrap_timeout=10.0,
        waiting_timeout=10.0,
        hb_interval=0.2,
        hb_failures=2,
        decode_schema=None,
        decode_compare=compare,
        max_part_bytes=1 << 20,
        n_prefills=2,
        token=None,
        decode_token=SAME,
        failure_prob=0.0,
        backend="zmq",
        prefill_backend=None,
    ):
        self.token, self.failure_prob = token, failure_prob
        self.prefill_cls = get_backend(prefill_backend or backend).prefill
        decode_cls = get_backend(backend).decode
        self.server = BootstrapServer(
            HOST, 0, 2, SCHEMA, 30000, SCHEMA["page_size"], SCHEMA["dtype"], token
        )
        self.server.start()
        self.statuses: dict[tuple[int, int], list[tuple[KVPoll, str]]] = {}
        self._lock = threading.Lock()
        self.prefills = [self.make_prefill(pp, bootstrap_timeout) for pp in range(n_prefills)]
        for p in self.prefills:
            p.start()
        self.decode = decode_cls(
            decode_schema or SCHEMA,
            decode_compare,
            expected_parts,
            HOST,
            bootstrap_timeout,
            waiting_timeout,
            hb_interval,
            hb_failures,
            self.server.port,
            max_part_bytes,
            token if decode_token is SAME else decode_token,
        )
        self.memory = Memory()  # what a one-sided backend writes into
        self.decode.register(self.memory.regions())
        self.decode.start()

    def make_prefill(self, pp: int, bootstrap_timeout: float) -> PrefillTransfer:
        def on_status(room, state, reason):
            with self._lock:
                self.statuses.setdefault((pp, room), []).append((state, reason))

        return self.prefill_cls(
            pp,
            2,
            SCHEMA,
            compare,
            self.server.url,
            HOST,
            bootstrap_timeout,
            on_status,
            auth_token=self.token,
            failure_prob=self.failure_prob,
        )

    def threads_alive(self) -> bool:
        return (
            self.decode.threads_alive()
            and all(p.threads_alive() for p in self.prefills)
            and self.server.threads_alive()
        )

    def close(self):
        self.decode.close()
        for p in self.prefills:
            p.close()
        self.server.stop()

    def add(self, room: int, prompt_len: int = 5):
        for p in self.prefills:
            p.add_room(room, prompt_len)

    def send(self, room: int, pp: int, prompt_len: int = 5):
        self.prefills[pp].send(room, make_parts(pp, room, prompt_len))

    def decode_state(self, room: int, state: KVPoll, timeout: float = 5.0):
        return wait_for(
            lambda: self.decode.poll(room).state == state and self.decode.poll(room),
            timeout,
            f"decode room {room} -> {state.name} (now {self.decode.poll(room)})",
        )

    def prefill_state(self, pp: int, room: int, state: KVPoll, timeout: float = 5.0):
        p = self.prefills[pp]
        return wait_for(
            lambda: p.poll(room).state == state and p.poll(room),
            timeout,
            f"prefill {pp} room {room} -> {state.name} (now {p.poll(room)})",
        )

    def begin(self, room: int, port=None, prompt_len: int = 5, pages=None):
        """decode.begin, with a landing at `pages` (default: every other page, backwards) on
        one-sided backends."""
        landing = (
            self.memory.landing(pages or self.memory.pages_for(room, prompt_len))
            if self.decode.one_sided
            else None
        )
        self.decode.begin(room, HOST, port, prompt_len, landing)

    def received(self, room: int, got: dict, prompt_len: int = 5) -> dict:
        """pp -> name -> the bytes that arrived (one-sided: read back from the landing)."""
        if not self.decode.one_sided:
            return {pp: {n: p.data for n, p in parts.items()} for pp, parts in got.items()}
        return {
            pp: {
                n: self.memory.read(p.spec, self.memory.pages_for(room, prompt_len))
                for n, p in parts.items()
            }
            for pp, parts in got.items()
        }

    def run_good_room(self, room: int):
        self.add(room)
        self.begin(room, self.server.port)
        self.send(room, 0)
        self.send(room, 1)
        self.decode_state(room, KVPoll.Success)
        got = self.received(room, self.decode.take(room))
        for pp in (0, 1):
            assert got[pp] == {p.spec.name: p.data for p in make_parts(pp, room)}
            self.prefill_state(pp, room, KVPoll.Success)


class Memory:
    """A decode's registered memory in SCHEMA's shapes: KV planes [2 * layers, slots, hidden] bf16
    and meta rows."""

    PAGES, PAGE = 64, SCHEMA["page_size"]

    def __init__(self):
        self.kv = torch.zeros(
            2 * SCHEMA["num_layers"], self.PAGES * self.PAGE, SCHEMA["hidden"], dtype=torch.bfloat16
        )
        self.meta = torch.zeros(self.PAGES, 32, dtype=torch.uint8)

    def regions(self) -> list[tuple[int, int]]:
        return [(t.data_ptr(), t.numel() * t.element_size()) for t in (self.kv, self.meta)]

    def pages_for(self, room: int, prompt_len: int) -> tuple[int, ...]:
        """Pages out of order, some consecutive: [p, p+1] then a gap, so writes split and merge."""
        n = -(-prompt_len // self.PAGE)
        base = room % (self.PAGES // 2 - n - 1)
        return tuple(base + 2 * i + (i % 2) for i in range(n))[::-1]

    def landing(self, pages: tuple[int, ...]) -> Landing:
        row = SCHEMA["hidden"] * 2
        planes = {
            layer: (self.kv[2 * layer].data_ptr(), self.kv[2 * layer + 1].data_ptr())
            for layer in range(SCHEMA["num_layers"])
        }
        return Landing(
            "-",
            b"",
            self.PAGE,
            pages,
            planes,
            row,
            meta=self.meta[pages[0]].data_ptr(),
            meta_bytes=32,
        )

    def read(self, spec: PartSpec, pages: tuple[int, ...]) -> bytes:
        if spec.name == "meta":
            return self.meta[pages[0], : spec.nbytes].numpy().tobytes()
        n = spec.shape[2]
        slots = torch.tensor([pages[t // self.PAGE] * self.PAGE + t % self.PAGE for t in range(n)])
        planes = [
            self.kv[2 * layer + j].index_select(0, slots)
            for layer in spec.layer_ids
            for j in (0, 1)
        ]
        return torch.stack(planes).view(-1).view(torch.uint8).numpy().tobytes()


def route(
    server: BootstrapServer, dp="-1", cp="-1", tp="-1", pp="-1", **extra
) -> tuple[int, bytes]:
    params = dict(
        prefill_dp_rank=dp, prefill_cp_rank=cp, target_tp_rank=tp, target_pp_rank=pp, **extra
    )
    query = "&".join(f"{k}={v}" for k, v in params.items() if v is not None)
    return http_request("GET", f"{server.url}/route?{query}")
