"""Where a request's time to first token goes: its events (trace/timeline.py, SPARKRELAY_TRACE)
between the client's send and its first streamed chunk, cut into segments on the critical path. Pure
functions; bench/pd.py runs the deployments and draws the figures.

PD (router + PP prefill + decode), in order:
    to engine     client send -> the prefill engine queued it (client -> router -> prefill HTTP -> engine thread)
    queue         -> stage 0 starts the request's first chunk
    compute       -> the last stage ends its last chunk (every stage, chunks pipelined)
    transfer      -> the decode engine saw every stage's parts in (what the transfer adds after the compute)
    commit        -> the first token left the decode engine (its parts checked; the KV and the drafter's
                     context are written after it, before the request's first decode step)
    to client     -> the client read the first chunk (decode HTTP -> router -> client)
plus, not stacked: the router's own hop (client send -> router), each stage's busy time, the transfer from its
first byte (a stage handed its parts to its agent) to its last (the decode saw them all), and when the router had
the prefill's whole reply, relative to the decode's first token (NaN when it came after the client's first chunk:
the router relays a stream once the prefill's 2xx headers are in and the decode's first chunk carries tokens, so
the rest of the prefill's reply may come later; a mean over requests is NaN if any one's is).
Aggregated: to engine, compute (queue included: no stage events without a pipeline), to client.
"""

from __future__ import annotations

from typing import Optional

SEGMENTS = ("to engine", "queue", "compute", "transfer", "commit", "to client")


def _first(
    events: list[dict], source: str, event: str, room: Optional[int] = None
) -> Optional[dict]:
    for e in events:
        if (
            e["source"] == source
            and e["event"] == event
            and (room is None or e.get("room") == room)
        ):
            return e
    return None


def _ms(a: float, b: float) -> float:
    return 1000.0 * (b - a)


def request_breakdown(events: list[dict], t_send: float, t_first: float) -> Optional[dict]:
    """One request sent alone at t_send whose first chunk arrived at t_first (time.monotonic()) -> segment -> ms,
    or None when its events are missing (no trace, or another request in the window)."""
    window = [e for e in events if t_send <= e["t"] <= t_first]
    router = _first(window, "router", "in")
    if router is None:
        return _aggregated(window, t_send, t_first)
    room = router["rooms"][0]
    queued = _first(window, "prefill", "queued", room)
    chunks = [e for e in window if e["event"] == "chunk" and room in e["rooms"]]
    arrived, out = (
        _first(window, "decode", "arrived", room),
        _first(window, "decode", "first_token", room),
    )
    if queued is None or not chunks or arrived is None or out is None:
        return None
    start, end = min(c["start"] for c in chunks), max(c["end"] for c in chunks)
    sends = [e["t"] for e in window if e["event"] == "send" and e.get("room") == room]
    reply = next(
        (
            e
            for e in window
            if e["source"] == "router"
            and e["event"] == "replied"
            and e["side"] == "prefill"
            and room in e["rooms"]
        ),
        None,
    )
    out = {
        "to engine": _ms(t_send, queued["t"]),
        "queue": _ms(queued["t"], start),
        "compute": _ms(start, end),
        "transfer": max(0.0, _ms(end, arrived["t"])),
        "commit": _ms(arrived["t"], out["t"]),
        "to client": _ms(out["t"], t_first),
        "router hop": _ms(t_send, router["t"]),
        "transfer span": _ms(min(sends), arrived["t"]) if sends else 0.0,
        "prefill reply": _ms(out["t"], reply["t"]) if reply is not None else float("nan"),
    }
    for stage in sorted({c["source"] for c in chunks}):
        out[f"{stage} busy"] = sum(
            _ms(c["start"], c["end"]) for c in chunks if c["source"] == stage
        )
    return out


def _aggregated(window: list[dict], t_send: float, t_first: float) -> Optional[dict]:
    queued, first = (
        _first(window, "aggregated", "queued"),
        _first(window, "aggregated", "first_token"),
    )
    if queued is None or first is None:
        return None
    return {
        "to engine": _ms(t_send, queued["t"]),
        "queue": 0.0,
        "compute": _ms(queued["t"], first["t"]),
        "transfer": 0.0,
        "commit": 0.0,
        "to client": _ms(first["t"], t_first),
    }


def mean_breakdown(rows: list[Optional[dict]]) -> Optional[dict]:
    """The mean of each segment over the requests that have one (None if none has)."""
    rows = [r for r in rows if r is not None]
    if not rows:
        return None
    keys = [k for k in rows[0] if all(k in r for r in rows)]
    return {k: sum(r[k] for r in rows) / len(rows) for k in keys}


def markdown(rows: list[dict]) -> list[str]:
    """rows: bench/pd.py's, each with a "breakdown" (mean_breakdown) -> a table, one line per deployment and
    prompt length."""
    stages = sorted(
        {k for r in rows if r.get("breakdown") for k in r["breakdown"] if k.endswith(" busy")}
    )
    extra = ["router hop", *stages, "transfer span", "prefill reply"]
    lines = [
        "| deployment | prompt len | TTFT ms | "
        + " | ".join(SEGMENTS)
        + " | "
        + " | ".join(extra)
        + " |",
        "|---|---|---|" + "---|" * (len(SEGMENTS) + len(extra)),
    ]
    for r in rows:
        b = r.get("breakdown")
        if not b:
            continue
        cells = [f"{b[k]:.1f}" if k in b else "-" for k in (*SEGMENTS, *extra)]
        head = f"| {r['deployment']} | {r['prompt_len']} | {1000 * r['ttft_s']:.0f} | "
        lines.append(head + " | ".join(cells) + " |")
    return lines


def plot(rows: list[dict], path) -> None:
    """Stacked bars of SEGMENTS per deployment, one group per prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("breakdown")]
    lengths = sorted({r["prompt_len"] for r in rows})
    names = list(dict.fromkeys(r["deployment"] for r in rows))
    fig, axes = plt.subplots(1, len(lengths), figsize=(3.2 * len(lengths) + 1, 4), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, n in zip(axes[0], lengths):
        for i, name in enumerate(names):
            b = next(
                (r["breakdown"] for r in rows if r["prompt_len"] == n and r["deployment"] == name),
                None,
            )
            bottom = 0.0
            for j, seg in enumerate(SEGMENTS):
                v = b.get(seg, 0.0) if b else 0.0
                ax.bar(
                    i,
                    v,
                    bottom=bottom,
                    color=colors[j],
                    label=seg if (n, i) == (lengths[0], 0) else None,
                )
                bottom += v
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=8)
        ax.set_title(f"{n}-token prompts")
        ax.set_ylabel("ms to first token")
    fig.legend(loc="upper right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    fig.savefig(path, dpi=110)
