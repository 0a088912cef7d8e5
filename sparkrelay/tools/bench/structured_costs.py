"""What a grammar costs the engine (docs/structured_outputs.md), the cost half of
tools/bench/structured.py, and alone:

    python -m sparkrelay.tools.bench.structured_costs --out-dir benchmarks/results/structured-kernels

Alone it times the grammar's part of the engine's own batch-8 DSpark rounds on SmolLM2 (the twenty
schemas' requests, 8 decoding at once), per backend, greedy and at temperature 1, with sparkrelay's
CPU kernels (the row argmax, the token bitmask, the draw: the AVX-512 build or the AVX2 one) and
with them forced off (torch's argmax and unpack-and-fill), interleaved and repeated in one process,
so the machine's load falls on both alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch

from sparkrelay import LLM, SamplingParams
from sparkrelay.grammar import rows as grammar_rows
from sparkrelay.grammar.backends import BACKENDS, Grammar, backend_class, version
from sparkrelay.grammar.bitmask import constrain
from sparkrelay.grammar.rows import Deferred, DraftGuide, Masks
from sparkrelay.models import cpu_kernels
from sparkrelay.tools.bench import common as bc
from sparkrelay.tools.bench.schemas import SCHEMAS, request_text
from sparkrelay.tools.train.chat_data import chat_ids

MODELS = {
    "tiny-qwen3": ("models/tiny-qwen3", "models/tiny-qwen3-dspark"),
    "smollm2": ("models/smollm2-135m-instruct", "models/smollm2-135m-instruct-dspark"),
}
MAX_TOKENS = 160
BATCH, ROWS = 8, 8  # the verify step whose masks are timed: 8 requests, anchor + 7 drafts each
POOL_TOKENS = 8192  # KV pool of each engine built here: enough for 8 requests, ~0.2 GB


def guided_round(matchers: list, drafts: list[list[int]], vocab: int) -> float:
    """Seconds of one DSpark round's grammar work: the drafter's slots masked as they are sampled
    (the drafts given), then the verify rows masked with the same masks."""
    d = torch.tensor(drafts)  # [R, B]
    t0 = time.perf_counter()
    guide = DraftGuide(matchers, d.shape[1], vocab)
    prev = torch.zeros(len(matchers), dtype=torch.long)
    for k in range(d.shape[1]):
        guide(k, prev, torch.zeros(len(matchers), vocab))
        prev = d[:, k]
    guide.finish(d)
    masks = guide.verify_masks([d.shape[1]] * len(matchers))
    constrain(torch.zeros(masks.bitmask.shape[0], vocab), masks.bitmask, masks.rows)
    return time.perf_counter() - t0


@contextmanager
def grammar_clock() -> Iterator[dict]:
    """While open: the seconds spent in the grammar's part of each DSpark round (the guide's slots,
    its finish, the verify rows' masks) and the masks computed, summed into the dict it yields."""
    acc = {"s": 0.0, "masks": 0}
    timed = [(DraftGuide, n) for n in ("__init__", "__call__", "finish", "verify_masks")]
    timed.append((Masks, "apply"))
    saved = [(cls, n, getattr(cls, n)) for cls, n in timed]
    fill_rows, fill_one = grammar_rows._fill, Deferred.fill

    def clocked(f):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc["s"] += time.perf_counter() - t0

        return run

    def fill_counted(entries, bitmask):
        acc["masks"] += len(entries)
        fill_rows(entries, bitmask)

    def one_counted(self, bitmask):
        acc["masks"] += 1
        fill_one(self, bitmask)

    for cls, n, f in saved:
        setattr(cls, n, clocked(f))
    grammar_rows._fill, Deferred.fill = fill_counted, one_counted
    try:
        yield acc
    finally:
        for cls, n, f in saved:
            setattr(cls, n, f)
        grammar_rows._fill, Deferred.fill = fill_rows, fill_one


def engine_rounds(model: str, drafter: str, backend: str, temperature: float) -> dict:
    """The twenty schemas' requests through the DSpark engine, BATCH decoding at once (the rest
    queued): the grammar's ms and masks in each decode round that ran BATCH of them (median and
    max), and how many such rounds there were."""
    llm = LLM(
        model,
        grammar_backend=backend,
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=drafter,
        max_running_requests=BATCH,
        max_total_tokens=POOL_TOKENS,
    )
    prompts = [chat_ids(llm.tokenizer, request_text(what)) for what, _ in SCHEMAS]
    params = [
        SamplingParams(
            max_new_tokens=MAX_TOKENS, temperature=temperature, json_schema=json.dumps(schema)
        )
        for _, schema in SCHEMAS
    ]
    llm.generate(prompts[:1], params[:1])  # warm-up: the backend's tokenizer tables
    runner, per_round = llm.engine.runner, []
    run = runner.run

    def timed_run(batch):
        with grammar_clock() as acc:
            out = run(batch)
        if batch.kind == "decode" and len(batch.seqs) == BATCH:
            per_round.append((1e3 * acc["s"], acc["masks"]))
        return out

    runner.run = timed_run
    llm.generate(prompts, params)
    llm.engine.close()
    del llm, runner, timed_run  # a cycle through runner.run: collected now, not at some later gc
    gc.collect()
    ms, masks = [r[0] for r in per_round], [r[1] for r in per_round]
    return {
        "rounds": len(per_round),
        "ms_median": statistics.median(ms) if ms else None,
        "ms_max": max(ms) if ms else None,
        "masks_median": statistics.median(masks) if masks else None,
    }


def backend_costs(model: str, drafter: str, answers: list[list[int]], repeats: int) -> list[dict]:
    """Per backend: tokenizer tables (s), compile (ms, median of the twenty), one synthetic batch-8
    round with every row masked (ms, median and max over `repeats`), and the grammar's part of the
    engine's own batch-8 DSpark rounds, greedy and at temperature 1 (engine_rounds)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    eos = (tok.eos_token_id,)
    out = []
    for name in BACKENDS:
        t0 = time.perf_counter()
        be = backend_class(name)(tok, vocab, eos)
        tables = time.perf_counter() - t0
        compiled, compile_ms = [], []
        for _, schema in SCHEMAS:
            t0 = time.perf_counter()
            compiled.append(be.compile(Grammar("json_schema", json.dumps(schema))))
            compile_ms.append(1e3 * (time.perf_counter() - t0))
        steps = []
        for r in range(repeats):
            picks = [(i + r) % len(SCHEMAS) for i in range(BATCH)]
            matchers, drafts = [], []
            for i in picks:
                m, ids = be.matcher(compiled[i]), answers[i]
                half = len(ids) // 2
                for t in ids[:half]:
                    m.consume(t)
                matchers.append(m)
                drafts.append((ids[half:] + [eos[0]] * ROWS)[: ROWS - 1])
            steps.append(1e3 * guided_round(matchers, drafts, vocab))
        out.append(
            {
                "backend": f"{name} {version(name)}",
                "tables_s": tables,
                "compile_ms": statistics.median(compile_ms),
                "step_ms_median": statistics.median(steps),
                "step_ms_max": max(steps),
                "engine_greedy": engine_rounds(model, drafter, name, 0.0),
                "engine_sampled": engine_rounds(model, drafter, name, 1.0),
            }
        )
    return out


def kernel_pairs(model: str, drafter: str, repeats: int) -> list[dict]:
    """engine_rounds per backend and temperature, kernels on then forced off, `repeats` times."""
    runs = []
    for rep in range(repeats):
        for backend in BACKENDS:
            for temperature in (0.0, 1.0):
                for on in (True, False):
                    if on:
                        r = engine_rounds(model, drafter, backend, temperature)
                    else:
                        with cpu_kernels.forced_off():
                            r = engine_rounds(model, drafter, backend, temperature)
                    row = dict(rep=rep, backend=f"{backend} {version(backend)}", **r)
                    row |= dict(temperature=temperature, kernels=on)
                    print(json.dumps(row), flush=True)
                    runs.append(row)
    return runs


def _pair_cells(runs: list[dict]) -> list[tuple[str, float, tuple, tuple]]:
    """Per (backend, temperature): (median, min) over repeats of each run's median ms, kernels on
    and kernels off."""
    cells = []
    for backend, temperature in sorted({(r["backend"], r["temperature"]) for r in runs}):
        pair = []
        for on in (True, False):
            ms = [
                r["ms_median"]
                for r in runs
                if (r["backend"], r["temperature"], r["kernels"]) == (backend, temperature, on)
            ]
            pair.append((statistics.median(ms), min(ms)))
        cells.append((backend, temperature, *pair))
    return cells


def kernels_report(out: Path, record: dict) -> None:
    """The table (median / min per configuration, kernels on and off, their ratio), JSON and PNG."""
    rows, groups, chart = [], [], {"kernels on": [], "kernels off": []}
    for backend, temperature, on, off in _pair_cells(record["runs"]):
        sampling = "greedy" if temperature == 0 else f"T={temperature:g}"
        rows.append(
            [
                backend,
                sampling,
                f"{bc.fmt(on[0], 2)} / {bc.fmt(on[1], 2)}",
                f"{bc.fmt(off[0], 2)} / {bc.fmt(off[1], 2)}",
                bc.fmt(off[0] / on[0], 2),
            ]
        )
        groups.append(f"{backend.split()[0]}\n{sampling}")
        chart["kernels on"].append(on[0])
        chart["kernels off"].append(off[0])
    table = bc.markdown_table(
        [
            "backend",
            "sampling",
            "kernels on (ms, median / min)",
            "kernels off (ms, median / min)",
            "off / on",
        ],
        rows,
    )
    notes = [
        f"The grammar's part (the drafter's slots, the verify rows' masks, the matchers' walk) of "
        f"each DSpark round of the engine that ran {BATCH} constrained requests at once, SmolLM2 "
        f"with its drafter, float32, the twenty schemas at most {MAX_TOKENS} tokens each; per run "
        "the median over its rounds, then the median / min over the repeats. Kernels off: "
        "`cpu_kernels.forced_off()` (torch's argmax, bitmask unpack-and-fill and draw). "
        f"CPU kernels here: {record['kernels']}.",
    ]
    bc.write_markdown(
        out / "structured_kernels.md",
        "A grammar's work per engine round, with and without the CPU kernels",
        bc.header_lines(record),
        table,
        notes,
    )
    bc.write_json(out / "structured_kernels.json", record)
    bc.bar_chart(
        out / "structured_kernels.png",
        groups,
        chart,
        f"grammar work of a batch-{BATCH} DSpark round (median)",
        "ms per round",
    )
    print((out / "structured_kernels.md").read_text())


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=2, help="runs of each configuration")
    p.add_argument("--out-dir", default="benchmarks/results/structured-kernels")
    args = p.parse_args(argv)
    bc.require_positive(p, args, ["repeats"])
    record = bc.provenance("sparkrelay.tools.bench.structured_costs", argv)
    module = cpu_kernels.portable()
    record["kernels"] = "none" if module is None else module.__name__
    record["runs"] = kernel_pairs(*MODELS["smollm2"], args.repeats)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kernels_report(out, record)


if __name__ == "__main__":
    main()
