"""Transfer backends alone: bytes/s of one room from a prefill stage to a decode, per backend and
room size.

    python -m sparkrelay.tools.bench.transfer [--backends zmq,mooncake,nixl] [--sizes-mib 1,16,64]
                                              [--repeats 5] [--out benchmarks/results/transfer]

A real bootstrap server, one prefill stage agent and one decode agent on 127.0.0.1, in this process
(each agent's threads; the engines' own threads for Mooncake and NIXL). A room carries one `kv` part
of the given size laid out as a real KV part ([layers, 2, tokens, 8 heads x 128] bf16, 16-token
pages, the decode's pages in one stretch); the time is from the prefill's send() to the decode's
Success (TRANSFER_INFO already there, as when the prefill finishes after the decode admitted the
room). The first room per backend and size is a warm-up, not counted. Writes transfer.json,
transfer.md and transfer.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from sparkrelay.tools.bench import common as bc
from sparkrelay.transfer.backends import get_backend
from sparkrelay.transfer.base import KVPoll, Part, PartSpec
from sparkrelay.transfer.bootstrap import BootstrapServer
from sparkrelay.transfer.landing import Landing

HOST, PAGE, HEADS, HEAD_DIM, LAYERS = "127.0.0.1", 16, 8, 128, 4
ROW = HEADS * HEAD_DIM * 2  # bytes per token per layer per K or V (bf16)


def _schema(tokens: int) -> dict:
    return {"version": 1, "page_size": PAGE, "dtype": "bfloat16", "tokens": tokens}


def _compare(a: dict, b: dict) -> list[str]:
    return [
        f"{k}: prefill={a.get(k)!r} decode={b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]


def _spec(n: int) -> PartSpec:
    return PartSpec("kv", tuple(range(LAYERS)), "bfloat16", (LAYERS, 2, n, HEADS, HEAD_DIM))


def _expected(schema: dict, n: int) -> dict[int, list[PartSpec]]:
    return {0: [_spec(n)]}


class Pair:
    """A bootstrap server, one prefill stage and a decode of one backend, with the decode's pool
    registered."""

    def __init__(self, backend: str, tokens: int) -> None:
        chosen = get_backend(backend)
        prefill_cls, decode_cls = chosen.prefill, chosen.decode
        schema = _schema(tokens)
        self.server = BootstrapServer(HOST, 0, 1, schema, 30000, PAGE, "bfloat16", None)
        self.server.start()
        self.done: dict[int, KVPoll] = {}
        self.prefill = prefill_cls(
            0,
            1,
            schema,
            _compare,
            self.server.url,
            HOST,
            60.0,
            lambda room, state, why: self.done.__setitem__(room, state),
        )
        self.prefill.start()
        self.decode = decode_cls(
            schema, _compare, _expected, HOST, 60.0, 60.0, 5.0, 3, self.server.port, 1 << 31
        )
        # [2L, slots, h, d]
        self.pool = torch.zeros(2 * LAYERS, tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        self.decode.register([(self.pool.data_ptr(), self.pool.numel() * 2)])
        self.decode.start()
        self.tokens = tokens

    def landing(self) -> Landing | None:
        if not self.decode.one_sided:
            return None
        planes = {
            i: (self.pool[2 * i].data_ptr(), self.pool[2 * i + 1].data_ptr()) for i in range(LAYERS)
        }
        return Landing("-", b"", PAGE, tuple(range(self.tokens // PAGE)), planes, ROW)

    def room(self, room: int, payload: bytes) -> float:
        """Seconds from send() to the decode's Success."""
        self.prefill.add_room(room, self.tokens)
        self.decode.begin(room, HOST, self.server.port, self.tokens, self.landing())
        while self.prefill.poll(room).state != KVPoll.WaitingForInput:
            time.sleep(0.0005)
        t0 = time.perf_counter()
        self.prefill.send(room, [Part(_spec(self.tokens), payload)])
        while (state := self.decode.poll(room).state) not in (KVPoll.Success, KVPoll.Failed):
            time.sleep(0.0002)
        seconds = time.perf_counter() - t0
        if state != KVPoll.Success:
            raise RuntimeError(f"room {room} failed: {self.decode.poll(room).reason}")
        self.decode.take(room)
        self.decode.clear(room)
        self.prefill.clear(room)
        return seconds

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()
        self.server.stop()


def bench(backend: str, mib: int, repeats: int) -> dict:
    tokens = (mib << 20) // (2 * LAYERS * ROW)
    payload = (
        torch.randint(0, 255, (tokens * 2 * LAYERS * ROW,), dtype=torch.uint8).numpy().tobytes()
    )
    pair = Pair(backend, tokens)
    try:
        times = [pair.room(100 + i, payload) for i in range(repeats + 1)][1:]
        if pair.decode.one_sided:  # the last room's bytes are in the decode's pool, at its pages
            got = (
                pair.pool.view(2 * LAYERS, tokens, -1).view(-1).view(torch.uint8).numpy().tobytes()
            )
            assert got == payload, "the decode's pool does not hold the bytes sent"
    finally:
        pair.close()
    best, median = min(times), statistics.median(times)
    return {
        "backend": backend,
        "mib": mib,
        "bytes": len(payload),
        "median_s": median,
        "best_s": best,
        "median_gb_s": len(payload) / median / 1e9,
        "best_gb_s": len(payload) / best / 1e9,
    }


def report(rows: list[dict], out: Path, args, record: dict) -> None:
    """transfer.json, .md (headed by `record`, common.provenance) and .png under `out`; prints the
    .md."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "transfer.json").write_text(
        json.dumps({"args": vars(args), **record, "rows": rows}, indent=1)
    )
    lines = [
        *bc.header_lines(record),
        "",
        f"One room, prefill send() to decode Success, {args.repeats} rooms after a warm-up, 127.0.0.1, this "
        "machine (no RDMA device: Mooncake and NIXL/UCX over TCP / shared memory).",
        "",
        "| backend | room MiB | median ms | median GB/s | best GB/s |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['backend']} | {r['mib']} | {1000 * r['median_s']:.1f} | {r['median_gb_s']:.2f} | "
        f"{r['best_gb_s']:.2f} |"
        for r in rows
    ]
    (out / "transfer.md").write_text("\n".join(lines) + "\n")
    _plot(rows, out / "transfer.png")
    print("\n".join(lines))


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["backend"] for r in rows):
        rs = [r for r in rows if r["backend"] == name]
        ax.plot([r["mib"] for r in rs], [r["median_gb_s"] for r in rs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("room size (MiB)")
    ax.set_ylabel("GB/s (median)")
    ax.set_title("one room, prefill stage -> decode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sparkrelay.tools.bench.transfer", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--backends", default="zmq,mooncake,nixl")
    ap.add_argument("--sizes-mib", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/transfer")
    args = ap.parse_args(argv)
    record = bc.provenance("sparkrelay.tools.bench.transfer", argv)
    rows = []
    for backend in args.backends.split(","):
        for mib in (int(x) for x in args.sizes_mib.split(",")):
            rows.append(bench(backend, mib, args.repeats))
            print(json.dumps(rows[-1]), flush=True)
    report(rows, Path(args.out), args, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
