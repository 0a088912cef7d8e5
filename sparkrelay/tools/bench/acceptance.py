"""DSpark acceptance in the paper's protocol, and DSpark against plain decoding, on a chat model and
its drafter.

    python -m sparkrelay.tools.bench.acceptance --target models/smollm2-135m-instruct \\
        --drafter models/smollm2-135m-instruct-dspark --prompts ../shared/data/prompts [--limit N] \\
        [--token-map models/smollm2-135m-instruct-dspark/token_map.json]

Protocol (DSpark paper, Table 1): per prompt set, the evaluation split only (tools/corpus.py
prompt_split: the drafter never trained on it), the first user turn alone under the chat template
with no system message, fixed blocks of 7 drafts (no confidence cut), at most 256 new tokens, greedy
and temperature 1.0. Reported per set: the mean acceptance length per verify round (accepted drafts
+ the bonus token), the rate at which each draft position is accepted, and, greedy, whether every
DSpark output equals plain greedy decoding token for token (float32). `--token-map`: every DSpark
engine drafts among that vocabulary (--speculative-token-map), the deployed configuration.

Speed: decode tokens per second of DSpark against plain decoding, batch 1 (one request at a time)
and batch 8 (8 concurrent requests), in bfloat16 and float32, on `--speed-prompts` evaluation
prompts, the variants interleaved over `--rounds` rounds (min and median reported); one DSpark
engine per `--speed-draft-weights` entry (the drafter's linears as the target's dtype, `unquant`,
or `int8wo`). Decode time is
from a request's first token to its last. PD (`--pd-modes hidden,draft-kv`): for each mode, router +
prefill (`--pp-size 2`, no drafter) + DSpark decode as subprocesses; every greedy evaluation prompt
goes through the router (`--pd-concurrency` at a time), and its tokens and verify rounds must equal
the aggregated DSpark engine's for that prompt (equal tokens and rounds: equal acceptance). Writes
acceptance.md, acceptance.json and acceptance.png under --out-dir, headed by host, commit and
command. Each set's row is also appended to acceptance_sets.jsonl as the set ends, and each chunk of
32 prompts to acceptance_chunks.jsonl as it ends, so a run over whole splits (hours on 2 cores) that
is stopped keeps what it measured; `--resume` takes those rows and chunks back when its settings are
the same and measures the rest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

from sparkrelay.config import DRAFT_QUANTIZATIONS
from sparkrelay.tools.bench.common import (
    bar_chart,
    header_lines,
    line_chart,
    markdown_table,
    provenance,
    write_json,
    write_markdown,
)
from sparkrelay.tools.corpus import PROMPT_SETS, read_prompt_set

PAPER_TABLE1 = {
    "gsm8k": 6.11,
    "math500": 5.70,
    "humaneval": 5.38,
    "mbpp": 5.13,
    "mt-bench": 3.64,
    "livecodebench": 4.86,
}  # Qwen3-4B + its DSpark drafter, temperature 1.0 (DSpark paper, Table 1)


def engine(
    args: argparse.Namespace, dtype: str, dspark: bool, batch: int, draft_weights: str = "unquant"
):
    """An offline engine of the target, plain or DSpark (its drafter's linears `draft_weights`:
    --speculative-draft-model-quantization)."""
    from sparkrelay import LLM

    spec = (
        dict(
            speculative_algorithm="DSPARK",
            speculative_draft_model_path=args.drafter,
            speculative_token_map=args.token_map,
            speculative_draft_model_quantization=draft_weights,
        )
        if dspark
        else {}
    )
    return LLM(
        args.target,
        dtype=dtype,
        max_running_requests=batch,
        max_total_tokens=args.kv_tokens,
        **spec,
    )


def chat_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    from sparkrelay.tools.train.chat_data import chat_ids

    return [chat_ids(tokenizer, t) for t in texts]


def run_timed(llm, prompts: list[list[int]], params) -> list[dict]:
    """Generate (`params` one SamplingParams or one per prompt), recording each request's first- and
    last-token times (the engine stepped here, not by LLM)."""
    rids = [f"bench-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    per = params if isinstance(params, list) else [params] * len(prompts)
    for rid, ids, p in zip(rids, prompts, per):
        llm.engine.add_request(rid, ids, p)
    first, out, pending = {}, {}, set(rids)
    while pending:
        for o in llm.engine.step():
            now = time.monotonic()
            if o.rid in pending and o.new_ids and o.rid not in first:
                first[o.rid] = now
            if o.finished and o.rid in pending:
                pending.discard(o.rid)
                out[o.rid] = {
                    "ids": o.output_ids,
                    "first": first.get(o.rid, now),
                    "end": now,
                    "rounds": o.spec_verify_ct,
                }
    return [out[r] for r in rids]


def stats_delta(llm, before: dict) -> dict:
    s = llm.engine.spec_stats
    return {
        "rounds": s.rounds - before["rounds"],
        "committed": s.committed - before["committed"],
        "proposed_at": [a - b for a, b in zip(s.proposed_at, before["proposed_at"])],
        "accepted_at": [a - b for a, b in zip(s.accepted_at, before["accepted_at"])],
    }


def snapshot(llm) -> dict:
    s = llm.engine.spec_stats
    return {
        "rounds": s.rounds,
        "committed": s.committed,
        "proposed_at": list(s.proposed_at),
        "accepted_at": list(s.accepted_at),
    }


CHUNK_PROMPTS = 32  # prompts per recorded chunk of a set (--resume restarts at a chunk)


def measure_chunk(args, spec_llm, plain_llm, prompts: list[list[int]], first: int) -> dict:
    """Prompts first.. of one set: the sums a set's row is made of (`set_row`), greedy DSpark (against
    plain greedy) and temperature-1.0 DSpark (prompt i seeded 1000 + i, i its index in the set)."""
    from sparkrelay import SamplingParams

    sums: dict = {"prompts": len(prompts)}
    greedy = SamplingParams(max_new_tokens=args.max_new, temperature=0.0)
    sampled = [
        SamplingParams(max_new_tokens=args.max_new, temperature=1.0, seed=1000 + first + i)
        for i in range(len(prompts))
    ]
    for label, params in (("greedy", greedy), ("t1", sampled)):
        before = snapshot(spec_llm)
        outs = run_timed(spec_llm, prompts, params)
        sums[label] = stats_delta(spec_llm, before)
        if label == "greedy":
            plain = run_timed(plain_llm, prompts, params)
            sums["greedy_equal"] = sum(a["ids"] == b["ids"] for a, b in zip(outs, plain))
            sums["greedy_runs"] = [{"ids": o["ids"], "rounds": o["rounds"]} for o in outs]
    return sums


def set_row(name: str, chunks: list[dict]) -> dict:
    """A set's row from its chunks' sums, in prompt order."""
    row: dict = {"set": name, "prompts": sum(c["prompts"] for c in chunks)}
    for label in ("greedy", "t1"):
        rounds = sum(c[label]["rounds"] for c in chunks)
        committed = sum(c[label]["committed"] for c in chunks)
        proposed = [sum(v) for v in zip(*(c[label]["proposed_at"] for c in chunks))]
        accepted = [sum(v) for v in zip(*(c[label]["accepted_at"] for c in chunks))]
        row[f"tau_{label}"] = round(committed / max(rounds, 1), 3)
        row[f"accept_rate_{label}"] = [
            round(a / p, 3) if p else 0.0 for a, p in zip(accepted, proposed)
        ]
        row[f"rounds_{label}"] = rounds
    runs = [r for c in chunks for r in c["greedy_runs"]]
    row["greedy_equal"] = sum(c["greedy_equal"] for c in chunks)
    row["tokens"] = sum(len(r["ids"]) for r in runs)
    row["greedy_runs"] = runs
    return row


def acceptance_run(args, spec_llm, plain_llm, name: str, prompts: list[list[int]]) -> dict:
    """One set, CHUNK_PROMPTS prompts at a time, each chunk recorded as it ends (CHUNKS_FILE) and
    taken back by --resume: a whole split that takes hours on 2 cores survives a stopped session."""
    done, chunks = finished_chunks(args, name), []
    for first in range(0, len(prompts), CHUNK_PROMPTS):
        part = prompts[first : first + CHUNK_PROMPTS]
        if first in done and done[first]["prompts"] == len(part):
            chunks.append(done[first])
            continue
        chunks.append(measure_chunk(args, spec_llm, plain_llm, part, first))
        record(args, CHUNKS_FILE, {"set": name, "first": first, "sums": chunks[-1]})
        print(
            f"{name}: prompts {first}..{first + len(part) - 1} of {len(prompts)} done", flush=True
        )
    row = set_row(name, chunks)
    print(
        f"{name}: {row['prompts']} prompts, tau greedy {row['tau_greedy']}, T=1 {row['tau_t1']}, "
        f"greedy equal to plain {row['greedy_equal']}/{row['prompts']}",
        flush=True,
    )
    return row


def pd_runs(args, rows: list[dict], prompts: dict[str, list[list[int]]]) -> list[dict]:
    """Each PD mode against the aggregated greedy runs: per set, prompts whose tokens and verify
    rounds are equal."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from sparkrelay.tools.cluster import PDSettings, generate_ids, start_pd

    out = []
    for mode in args.pd_modes:
        with tempfile.TemporaryDirectory() as logs:
            token_map = ["--speculative-token-map", args.token_map] if args.token_map else []
            settings = PDSettings(
                model=args.target,
                drafter=args.drafter,
                pp_size=2,
                handoff=mode,
                decode_args=token_map,
            )
            cluster = start_pd(settings, logs)
            try:
                for row in rows:
                    with ThreadPoolExecutor(args.pd_concurrency) as pool:
                        got = list(
                            pool.map(
                                lambda ids: generate_ids(cluster.url, ids, args.max_new),
                                prompts[row["set"]],
                            )
                        )
                    ref = row["greedy_runs"]
                    same_tokens = sum(g["ids"] == r["ids"] for g, r in zip(got, ref))
                    same_accept = sum(
                        g["ids"] == r["ids"] and g["rounds"] == r["rounds"]
                        for g, r in zip(got, ref)
                    )
                    out.append(
                        {
                            "mode": mode,
                            "set": row["set"],
                            "prompts": len(ref),
                            "same_tokens": same_tokens,
                            "same_acceptance": same_accept,
                        }
                    )
                    print(
                        f"PD {mode} {row['set']}: tokens equal {same_tokens}/{len(ref)}, acceptance equal "
                        f"{same_accept}/{len(ref)}",
                        flush=True,
                    )
            finally:
                cluster.stop()
    return out


def decode_rate(outs: list[dict]) -> float:
    """Decode tokens per second: tokens after each request's first, over the span from the first
    first-token to the last last-token (batch 1: requests run one after another, so their spans
    add)."""
    tokens = sum(len(o["ids"]) - 1 for o in outs)
    return tokens / max(sum(o["end"] - o["first"] for o in outs), 1e-9)


def timed_wave(llm, wave: list[list[int]], params) -> dict:
    """One wave of concurrent requests (batch 1: a single prompt) -> its decode tokens and span as one
    decode_rate record."""
    outs = run_timed(llm, wave, params)
    return {
        "ids": [0] * (sum(len(o["ids"]) - 1 for o in outs) + 1),
        "first": min(o["first"] for o in outs),
        "end": max(o["end"] for o in outs),
    }


def speed_runs(args, prompts: list[list[int]]) -> list[dict]:
    """Per (dtype, batch): plain and a DSpark engine per --speed-draft-weights alternate wave by wave
    (batch 1: prompt by prompt), so that the shared machine's load falls on all alike, after one
    untimed warm-up wave each (the first products of a shape build oneDNN's primitives); min and
    median tok/s over the rounds, each DSpark engine's ratio to plain per round."""
    from sparkrelay import SamplingParams

    greedy = SamplingParams(max_new_tokens=args.max_new, temperature=0.0)
    warm = SamplingParams(max_new_tokens=min(32, args.max_new), temperature=0.0)
    modes = ["plain"] + [f"dspark {w}" for w in args.speed_draft_weights]
    engines = {}
    rates: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        for dt in ("bfloat16", "float32"):
            for m in modes:
                if (dt, m) not in engines:
                    w = m.split()[-1]
                    engines[(dt, m)] = engine(args, dt, m != "plain", 8, w)
                    for b in (1, 8):
                        run_timed(engines[(dt, m)], prompts[:b], warm)
            for b in (1, 8):
                waves = [prompts[i : i + b] for i in range(0, len(prompts), b)]
                outs: dict[str, list[dict]] = {m: [] for m in modes}
                for wave in waves:
                    for m in modes:
                        outs[m].append(timed_wave(engines[(dt, m)], wave, greedy))
                for m in modes:
                    rates.setdefault((dt, b, m), []).append(decode_rate(outs[m]))
                    print(
                        f"round {r + 1}: {dt} batch {b} {m} {rates[(dt, b, m)][-1]:.1f} tok/s",
                        flush=True,
                    )
    rows = []
    for dt in ("bfloat16", "float32"):
        for b in (1, 8):
            plain = rates[(dt, b, "plain")]
            for w in args.speed_draft_weights:
                spec = rates[(dt, b, f"dspark {w}")]
                ratios = [s / p for s, p in zip(spec, plain)]
                rows.append(
                    {
                        "dtype": dt,
                        "batch": b,
                        "draft_weights": w,
                        "plain_min": min(plain),
                        "plain_median": statistics.median(plain),
                        "dspark_min": min(spec),
                        "dspark_median": statistics.median(spec),
                        "speedup_min": min(ratios),
                        "speedup_median": statistics.median(ratios),
                    }
                )
    return rows


def report(args, rows: list[dict], speed: list[dict], pd: list[dict], argv: list[str]) -> None:
    out = Path(args.out_dir)
    record = provenance("sparkrelay.tools.bench.acceptance", argv)
    header = [
        *header_lines(record),
        f"target {args.target}, drafter {args.drafter}, token map {args.token_map or 'none'}, block 7, "
        f"at most {args.max_new} new tokens, evaluation split, chat template, no system message; "
        "acceptance in float32",
    ]
    acc = markdown_table(
        [
            "set",
            "prompts",
            "tau greedy",
            "tau T=1",
            "paper DSpark (Qwen3-4B, T=1)",
            "greedy = plain",
            "accept rate by position, greedy",
        ],
        [
            [
                r["set"],
                r["prompts"],
                f"{r['tau_greedy']:.2f}",  # two decimals: a mean of 2.48 is not 2.5
                f"{r['tau_t1']:.2f}",
                PAPER_TABLE1.get(r["set"], "-"),
                f"{r['greedy_equal']}/{r['prompts']}",
                " ".join(f"{x:.2f}" for x in r["accept_rate_greedy"]),
            ]
            for r in rows
        ]
        + [
            [
                "mean of sets",
                sum(r["prompts"] for r in rows),
                f"{statistics.fmean(r['tau_greedy'] for r in rows):.2f}",
                f"{statistics.fmean(r['tau_t1'] for r in rows):.2f}",
                round(statistics.fmean(PAPER_TABLE1[r["set"]] for r in rows), 2),
                "",
                "",
            ]
        ],
    )
    spd = markdown_table(
        [
            "dtype",
            "batch",
            "drafter's linears",
            "plain tok/s (min / median)",
            "DSpark tok/s (min / median)",
            "DSpark / plain (min / median)",
        ],
        [
            [
                s["dtype"],
                s["batch"],
                s.get("draft_weights", "unquant"),
                f"{s['plain_min']:.1f} / {s['plain_median']:.1f}",
                f"{s['dspark_min']:.1f} / {s['dspark_median']:.1f}",
                f"{s['speedup_min']:.2f}x / {s['speedup_median']:.2f}x",
            ]
            for s in speed
        ],
    )
    pdt = markdown_table(
        [
            "PD mode (PP=2 prefill, no drafter)",
            "set",
            "prompts",
            "tokens = aggregated",
            "acceptance = aggregated",
        ],
        [[r["mode"], r["set"], r["prompts"], r["same_tokens"], r["same_acceptance"]] for r in pd],
    )
    curve = learning_curve(args.drafter, out)
    parts = [acc, spd if speed else "", pdt if pd else "", curve]
    body = "\n\n".join(p for p in parts if p)
    write_markdown(out / "acceptance.md", "DSpark acceptance and speed", header, body)
    slim = [{k: v for k, v in r.items() if k != "greedy_runs"} for r in rows]
    write_json(
        out / "acceptance.json",
        {**record, "sets": slim, "speed": speed, "pd": pd, "paper_table1": PAPER_TABLE1},
    )
    bar_chart(
        out / "acceptance.png",
        [r["set"] for r in rows],
        {
            "greedy": [r["tau_greedy"] for r in rows],
            "T=1": [r["tau_t1"] for r in rows],
            "paper (Qwen3-4B, T=1)": [PAPER_TABLE1.get(r["set"]) for r in rows],
        },
        "DSpark acceptance length per verify round (incl. bonus)",
        "tokens per round",
    )
    print(body)


def learning_curve(drafter: str, out: Path) -> str:
    """The drafter's learning curve from its train_report.json (offline greedy acceptance on the
    evaluation prompts against training steps and CPU hours): a markdown table, and
    acceptance_curve.png; "" without one."""
    path = Path(drafter) / "train_report.json"
    points = json.loads(path.read_text()).get("learning_curve", []) if path.is_file() else []
    if not points:
        return ""
    sets = [k.removeprefix("tau_") for k in points[0] if k.startswith("tau_")]
    hours = [p["cpu_hours"] for p in points]
    series = {"mean of sets": (hours, [p["tau"] for p in points])}
    series |= {s: (hours, [p[f"tau_{s}"] for p in points]) for s in sets}
    line_chart(
        out / "acceptance_curve.png",
        series,
        f"Learning curve of {drafter} (offline greedy acceptance)",
        "training CPU hours (2 cores)",
        "tokens per round",
    )
    step = max(1, len(points) // 12)  # about a dozen rows; the last point always shown
    shown = points[::step] + ([points[-1]] if (len(points) - 1) % step else [])
    table = markdown_table(
        ["step", "CPU hours", "tau, mean of sets", *(f"tau {s}" for s in sets)],
        [
            [
                p["step"],
                f"{p['cpu_hours']:.2f}",
                *(f"{v:.2f}" for v in (p["tau"], *(p[f"tau_{s}"] for s in sets))),
            ]
            for p in shown
        ],
    )
    return (
        f"Learning curve (`{path}`; offline greedy acceptance on {drafter}'s evaluation prompts, the drafter "
        "tool's own measure; acceptance_curve.png):\n\n" + table
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default="models/smollm2-135m-instruct")
    p.add_argument("--drafter", default="models/smollm2-135m-instruct-dspark")
    p.add_argument(
        "--token-map",
        default=None,
        help="the DSpark engines' --speculative-token-map (e.g. the drafter folder's token_map.json)",
    )
    p.add_argument("--prompts", default="../shared/data/prompts")
    p.add_argument("--sets", nargs="+", default=list(PROMPT_SETS))
    p.add_argument(
        "--limit", type=int, default=0, help="evaluation prompts per set (0: the whole split)"
    )
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--speed-prompts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kv-tokens", type=int, default=32768, help="KV cache tokens of each engine")
    p.add_argument(
        "--pd-modes",
        type=lambda t: [m for m in t.split(",") if m],
        default=[],
        help="comma-separated handoff modes to check through a PD deployment (e.g. hidden,draft-kv)",
    )
    p.add_argument("--pd-concurrency", type=int, default=8)
    p.add_argument("--no-speed", action="store_true", help="skip the speed runs")
    p.add_argument(
        "--speed-draft-weights",
        type=lambda t: [w for w in t.split(",") if w],
        default=["unquant"],
        help="comma-separated --speculative-draft-model-quantization values, a DSpark engine each "
        "in the speed runs (e.g. unquant,int8wo); acceptance and PD use the drafter unquantized",
    )
    p.add_argument("--out-dir", default="benchmarks/results/acceptance")
    p.add_argument(
        "--resume",
        action="store_true",
        help=f"keep the sets already measured with the same settings ({SETS_FILE} under --out-dir)",
    )
    return p


SETS_FILE = "acceptance_sets.jsonl"  # one finished set per line, written as each set ends
CHUNKS_FILE = "acceptance_chunks.jsonl"  # one finished chunk of a set per line
SET_SETTINGS = ("target", "drafter", "token_map", "prompts", "limit", "max_new")


def set_settings(args: argparse.Namespace) -> dict:
    """What a set's figures depend on: a resumed run keeps only rows measured with the same,
    weights included (a drafter trained further keeps its folder's name)."""
    return {**{k: getattr(args, k) for k in SET_SETTINGS}, "weights": weights_digest(args)}


def weights_digest(args: argparse.Namespace) -> str:
    """sha256 (16 hex digits) over the target's and the drafter's *.safetensors files."""
    h = hashlib.sha256()
    for folder in (args.target, args.drafter):
        for path in sorted(Path(folder).glob("*.safetensors")):
            with path.open("rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
    return h.hexdigest()[:16]


def recorded(args: argparse.Namespace, name: str) -> list[dict]:
    """The records of file `name` under --out-dir measured with this run's settings (--resume), else
    []."""
    path = Path(args.out_dir) / name
    if not args.resume or not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    mine = set_settings(args)
    return [r for r in rows if r["settings"] == mine]


def finished_sets(args: argparse.Namespace) -> dict[str, dict]:
    """set -> its row from an earlier run with the same settings (--resume), else {}."""
    return {r["row"]["set"]: r["row"] for r in recorded(args, SETS_FILE)}


def finished_chunks(args: argparse.Namespace, name: str) -> dict[int, dict]:
    """first prompt -> the sums of set `name`'s chunk from an earlier run (--resume), else {}."""
    return {r["first"]: r["sums"] for r in recorded(args, CHUNKS_FILE) if r["set"] == name}


def record(args: argparse.Namespace, name: str, entry: dict) -> None:
    """Append `entry` with this run's settings to file `name` under --out-dir: a long run stopped
    later keeps it (--resume)."""
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (out / name).open("a") as f:
        f.write(json.dumps({"settings": set_settings(args), **entry}) + "\n")


def measure_sets(args, spec_llm, plain_llm, prompts: dict[str, list[list[int]]]) -> list[dict]:
    """Every set's row, in --sets order: kept from an earlier run (--resume) or measured now and
    recorded at once."""
    done, rows = finished_sets(args), []
    if not args.resume:
        for name in (SETS_FILE, CHUNKS_FILE):
            (Path(args.out_dir) / name).unlink(missing_ok=True)
    for name in args.sets:
        if name in done:
            print(f"{name}: kept from the run being resumed", flush=True)
            rows.append(done[name])
            continue
        rows.append(acceptance_run(args, spec_llm, plain_llm, name, prompts[name]))
        record(args, SETS_FILE, {"row": rows[-1]})
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    bad = [w for w in args.speed_draft_weights if w not in DRAFT_QUANTIZATIONS]
    if bad or not args.speed_draft_weights:
        parser.error(f"--speed-draft-weights {bad}: each must be one of {DRAFT_QUANTIZATIONS}")
    texts = {s: read_prompt_set(args.prompts, s, "eval") for s in args.sets}
    texts = {s: t[: args.limit] if args.limit else t for s, t in texts.items()}
    spec_llm, plain_llm = engine(args, "float32", True, 8), engine(args, "float32", False, 8)
    prompts = {s: chat_prompts(spec_llm.tokenizer, t) for s, t in texts.items()}
    rows = measure_sets(args, spec_llm, plain_llm, prompts)
    del spec_llm, plain_llm
    pd = pd_runs(args, rows, prompts) if args.pd_modes else []
    mixed = [p for group in zip(*prompts.values()) for p in group][
        : args.speed_prompts
    ]  # the sets interleaved
    report(args, rows, [] if args.no_speed else speed_runs(args, mixed), pd, argv)


if __name__ == "__main__":
    main()
