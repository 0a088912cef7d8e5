"""The workload and the reporting shared by the benchmarks (bench_offline, bench_serving, ...).

Workload: prompts are fixed-length token windows of held-out Python code: the running Python's
standard-library files that `corpus.stdlib_files` keeps out of training, so the bundled model is not
timed on text it memorised. Files are taken in sorted order with a fixed stride; when the prompts
outnumber the files, later prompts take the next window of each file. Everything is deterministic
for one Python install and tokenizer.

Reporting: `markdown_table` / `write_markdown` for the table, `bar_chart` for the PNG, `write_json`
for the raw figures, `provenance` for what every result records (command, commit, machine) and
`header_lines` for the header every results .md starts with.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from sparkrelay.tools.corpus import stdlib_files

DEFAULT_MODEL = "models/tiny-qwen3"
DEFAULT_OUT_DIR = "benchmarks/results"
DTYPE_NAMES = ("float32", "bfloat16", "float16")
SECRET_FLAGS = ("--api-key",)  # their values never go into a result


# -- workload --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One prompt of the workload: its token ids and where they come from (file relative to the
    stdlib, window)."""

    ids: list[int]
    source: str
    window: int


def held_out_files() -> list[Path]:
    """The stdlib files the bundled model never trained on (sorted); the training split if none is
    held out."""
    train, held = stdlib_files()
    return sorted(held) or sorted(train)


def load_prompts(tokenizer, num_prompts: int, prompt_len: int, stride: int = 3) -> list[Prompt]:
    """`num_prompts` windows of exactly `prompt_len` tokens of held-out stdlib code (see the module
    docstring).

    Prompt i reads file `(i * stride) % F` of the F usable files (stride coprime with F, so the
    first F prompts are F different files), window `i // F` (tokens [w * prompt_len, (w + 1) *
    prompt_len))."""
    if num_prompts <= 0 or prompt_len <= 0:
        raise ValueError("num_prompts and prompt_len must be positive")
    root = Path(sysconfig.get_paths()["stdlib"])
    encoded: list[tuple[str, list[int]]] = []
    for path in held_out_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        # whole files exceed model_max_length
        ids = tokenizer.encode(text, add_special_tokens=False, verbose=False)
        if len(ids) >= prompt_len:
            encoded.append((str(path.relative_to(root)), ids))
    if not encoded:
        raise RuntimeError(f"no stdlib file under {root} has {prompt_len} tokens")
    n_files = len(encoded)
    while math.gcd(stride, n_files) != 1:
        stride += 1
    prompts = []
    for i in range(num_prompts):
        # a short file may lack window w; try the next files
        for step in range(n_files * num_prompts + 1):
            name, ids = encoded[(i * stride + step) % n_files]
            w = i // n_files
            if (w + 1) * prompt_len <= len(ids):
                prompts.append(Prompt(ids[w * prompt_len : (w + 1) * prompt_len], name, w))
                break
        else:
            raise RuntimeError(
                f"held-out code too short for {num_prompts} prompts of {prompt_len} tokens"
            )
    return prompts


def batches(items: Sequence[Any], size: int) -> list[list[Any]]:
    """Consecutive groups of `size` (the last may be shorter)."""
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


# -- timing ----------------------------------------------------------------------------------------


def sync(device: str = "cpu") -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str = "cpu") -> tuple[float, Any]:
    """(seconds, result) of one call, with the device synchronised on both sides."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation (numpy's default); nan for no
    values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def mean(values: Sequence[float]) -> float:
    """The mean; nan for no values."""
    return float(statistics.fmean(values)) if values else float("nan")


# -- machine and arguments -------------------------------------------------------------------------


def machine_info() -> dict:
    """The host, its CPU and GPU, Python and torch, and the date: the machine part of
    `provenance`."""
    import torch

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_cores": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def commit() -> str:
    """`git rev-parse --short HEAD` of the checkout this package runs from, with "+changes" when the
    package's own files differ from it (a figure measured on uncommitted code says so); "unknown"
    outside a git checkout. Asked from the package's folder, not the current one, so a tool started
    elsewhere still names its code."""
    here = Path(__file__).resolve().parents[2]  # sparkrelay/
    try:
        sha = _git(["rev-parse", "--short", "HEAD"], here).stdout.strip()
        changed = _git(["status", "--porcelain", "--", "."], here).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("+changes" if changed else "")) if sha else "unknown"


def _git(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", *args], capture_output=True, text=True, check=True, cwd=cwd, timeout=10
    )


def command(module: str, argv: Optional[Sequence[str]] = None) -> str:
    """The command line that reruns a tool: `python -m <module> <argv>`, shell-quoted (argv None:
    this process's), with the values of SECRET_FLAGS masked: results are shared, keys are not."""
    args = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    for i, a in enumerate(args):
        flag = a.split("=", 1)[0]
        if flag in SECRET_FLAGS and "=" in a:
            args[i] = f"{flag}=REDACTED"
        elif i and args[i - 1] in SECRET_FLAGS:
            args[i] = "REDACTED"
    return shlex.join(["python", "-m", module, *args])


def provenance(module: str, argv: Optional[Sequence[str]] = None) -> dict:
    """What every result records beside its figures: the command that reruns it, the commit and the
    machine. A figure without them cannot be reproduced, nor compared with another host's or
    commit's."""
    return {"command": command(module, argv), "commit": commit(), "machine": machine_info()}


def header_lines(record: Mapping) -> list[str]:
    """The header of every results .md (after its title): the command, then host, cores, torch,
    commit and date. Read from `record` (provenance's keys, as saved in the JSON) so the .md and the
    JSON name the same run."""
    m = record["machine"]
    gpu = f", GPU {m['cuda']}" if m.get("cuda") else ""
    return [
        f"`{record['command']}`",
        f"Host {m['host']} ({m['cpu']}, {m['cpu_cores']} cores{gpu}), torch {m['torch']}, "
        f"commit {record['commit']}, {m['date']}.",
    ]


def int_list(text: str) -> list[int]:
    """'1,8' -> [1, 8] (argparse type)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def require_positive(
    parser: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str]
) -> None:
    """A usage error (exit status 2) for the first of `names` that is set and not > 0."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Flags every benchmark shares: model, dtype, device, workload size, repetitions, output
    folder."""
    parser.add_argument(
        "--model-path", default=DEFAULT_MODEL, help="Hugging Face folder of the model."
    )
    parser.add_argument(
        "--dtype", default="float32", choices=DTYPE_NAMES, help="Weight and activation dtype."
    )
    parser.add_argument("--device", default="cpu", help="Torch device (cpu, cuda, cuda:N).")
    parser.add_argument("--num-prompts", type=int, default=8, help="Prompts in the workload (N).")
    parser.add_argument("--prompt-len", type=int, default=64, help="Tokens per prompt.")
    parser.add_argument(
        "--output-len", type=int, default=128, help="New tokens per prompt (greedy, ignore_eos)."
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="Untimed runs before each measured configuration."
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="Timed runs per configuration; the median is kept."
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)."
    )
    parser.add_argument(
        "--out-dir", default=DEFAULT_OUT_DIR, help="Folder for the .md, .png and .json results."
    )


# -- reporting -------------------------------------------------------------------------------------


def fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; numbers right-aligned, text left-aligned, columns padded for
    plain-text reading."""
    cells = [[str(h) for h in headers]] + [
        [c if isinstance(c, str) else fmt(c) for c in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [
        all(_looks_numeric(r[i]) for r in cells[1:]) and len(cells) > 1 for i in range(len(headers))
    ]
    lines = []
    for n, row in enumerate(cells):
        padded = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)]
        lines.append("| " + " | ".join(padded) + " |")
        if n == 0:
            lines.append(
                "|"
                + "|".join(
                    ("-" * (w + 1) + ":") if num else ("-" * (w + 2))
                    for w, num in zip(widths, numeric)
                )
                + "|"
            )
    return "\n".join(lines)


def _looks_numeric(text: str) -> bool:
    t = text.replace(",", "").rstrip("x%").replace("/", "")
    if t == "-":
        return True
    try:
        float(t)
        return True
    except ValueError:
        return False


def write_markdown(
    path: Path | str, title: str, header_lines: Sequence[str], table: str, notes: Sequence[str] = ()
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = [f"# {title}", "", *header_lines, "", table, ""]
    if notes:
        parts += [*notes, ""]
    path.write_text("\n".join(parts))
    return path


def write_json(path: Path | str, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    return path


def variant_chart(
    path: Path | str,
    rows: list[dict],
    variants: Sequence[str],
    label: Callable[[dict], str],
    value: str,
    title: str,
    unit: str,
) -> None:
    """Bars of `value` per case (the rows of the first variant, named by `label`) and one series per
    variant; nothing when matplotlib is missing (the table and JSON carry the figures)."""
    groups = [label(r) for r in rows if r["variant"] == variants[0]]
    series = {v: [r[value] for r in rows if r["variant"] == v] for v in variants}
    try:
        bar_chart(path, groups, series, title, unit)
    except ImportError:
        pass


def bar_chart(
    path: Path | str,
    groups: Sequence[str],
    series: dict[str, Sequence[Optional[float]]],
    title: str,
    ylabel: str,
    xlabel: str = "",
) -> Path:
    """Grouped bars: one group per entry of `groups`, one bar per series (name -> a value per group, None for a
    missing bar), each bar labelled with its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = max(len(series), 1)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(groups) * n), 4.0))
    for k, (name, values) in enumerate(series.items()):
        xs = [g + (k - (n - 1) / 2) * width for g in range(len(groups))]
        ys = [float("nan") if v is None else v for v in values]
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(
            bars, labels=[fmt(v, 0) if v is not None else "" for v in values], fontsize=8, padding=2
        )
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.15)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def line_chart(
    path: Path | str,
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    title: str,
    xlabel: str,
    ylabel: str,
) -> Path:
    """One line with markers per series (name -> (xs, ys))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7.0, 4.0))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", markersize=3, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
