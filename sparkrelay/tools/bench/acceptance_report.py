"""The acceptance tool's report (python -m sparkrelay.tools.bench.acceptance): the acceptance table
beside the DSpark paper's Table 1, the speed and PD tables, the drafter's learning curve; markdown,
JSON and PNG under --out-dir."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from sparkrelay.tools.bench.common import (
    bar_chart,
    header_lines,
    line_chart,
    markdown_table,
    provenance,
    write_json,
    write_markdown,
)

PAPER_TABLE1 = {
    "gsm8k": 6.11,
    "math500": 5.70,
    "humaneval": 5.38,
    "mbpp": 5.13,
    "mt-bench": 3.64,
    "livecodebench": 4.86,
}  # Qwen3-4B + its DSpark drafter, temperature 1.0 (DSpark paper, Table 1)


def acceptance_table(rows: list[dict]) -> str:
    """One row per set and their mean: tau greedy and at T=1 (two decimals: a mean of 2.48 is not
    2.5), the paper's figure, greedy = plain, the accept rate by draft position."""
    head = ["set", "prompts", "tau greedy", "tau T=1", "paper DSpark (Qwen3-4B, T=1)"]
    head += ["greedy = plain", "accept rate by position, greedy"]
    body = [
        [
            r["set"],
            r["prompts"],
            f"{r['tau_greedy']:.2f}",
            f"{r['tau_t1']:.2f}",
            PAPER_TABLE1.get(r["set"], "-"),
            f"{r['greedy_equal']}/{r['prompts']}",
            " ".join(f"{x:.2f}" for x in r["accept_rate_greedy"]),
        ]
        for r in rows
    ]
    mean = [
        "mean of sets",
        sum(r["prompts"] for r in rows),
        f"{statistics.fmean(r['tau_greedy'] for r in rows):.2f}",
        f"{statistics.fmean(r['tau_t1'] for r in rows):.2f}",
        round(statistics.fmean(PAPER_TABLE1[r["set"]] for r in rows), 2),
        "",
        "",
    ]
    return markdown_table(head, body + [mean])


def speed_table(speed: list[dict]) -> str:
    head = ["dtype", "batch", "drafter's linears", "plain tok/s (min / median)"]
    head += ["DSpark tok/s (min / median)", "DSpark / plain (min / median)"]
    body = [
        [
            s["dtype"],
            s["batch"],
            s.get("draft_weights", "unquant"),
            f"{s['plain_min']:.1f} / {s['plain_median']:.1f}",
            f"{s['dspark_min']:.1f} / {s['dspark_median']:.1f}",
            f"{s['speedup_min']:.2f}x / {s['speedup_median']:.2f}x",
        ]
        for s in speed
    ]
    return markdown_table(head, body)


def pd_table(pd: list[dict]) -> str:
    head = ["PD mode (PP=2 prefill, no drafter)", "set", "prompts", "tokens = aggregated"]
    body = [[r["mode"], r["set"], r["prompts"], r["same_tokens"], r["same_acceptance"]] for r in pd]
    return markdown_table(head + ["acceptance = aggregated"], body)


def report(args, rows: list[dict], speed: list[dict], pd: list[dict], argv: list[str]) -> None:
    """acceptance.md, acceptance.json and acceptance.png under --out-dir, headed by host, commit
    and command; the tables printed."""
    out = Path(args.out_dir)
    record = provenance("sparkrelay.tools.bench.acceptance", argv)
    header = [
        *header_lines(record),
        f"target {args.target}, drafter {args.drafter}, token map {args.token_map or 'none'}, block 7, "
        f"at most {args.max_new} new tokens, evaluation split, chat template, no system message; "
        "acceptance in float32",
    ]
    parts = [
        acceptance_table(rows),
        speed_table(speed) if speed else "",
        pd_table(pd) if pd else "",
    ]
    body = "\n\n".join(p for p in [*parts, learning_curve(args.drafter, out)] if p)
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
