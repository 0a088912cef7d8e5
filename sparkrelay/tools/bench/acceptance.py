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
import sys
from pathlib import Path

from sparkrelay.config import DRAFT_QUANTIZATIONS
from sparkrelay.tools.bench.acceptance_record import (
    CHUNKS_FILE,
    SETS_FILE,
    finished_chunks,
    finished_sets,
    record,
)
from sparkrelay.tools.bench.acceptance_report import report
from sparkrelay.tools.bench.acceptance_runs import (
    chat_prompts,
    engine,
    run_timed,
    snapshot,
    stats_delta,
)
from sparkrelay.tools.bench.acceptance_speed import speed_runs
from sparkrelay.tools.corpus import PROMPT_SETS, read_prompt_set

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
