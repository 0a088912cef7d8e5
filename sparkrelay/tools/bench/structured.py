"""Structured outputs end to end, and what a grammar costs (docs/structured_outputs.md):

    python -m sparkrelay.tools.bench.structured --out-dir benchmarks/results/structured

Per model (the bundled one and SmolLM2 with their drafters), the twenty JSON schemas of
tools/bench/schemas.py as chat requests, greedy: aggregated plain, aggregated DSpark and PD (a PP = 2
prefill without a drafter, a DSpark decode with `draft-kv`, sparkrelay's router, through
/v1/chat/completions with `response_format`). Every answer is validated with `jsonschema`, the
greedy tokens are compared across the three, and DSpark's acceptance is reported with and without
the grammar. Per grammar backend: the tokenizer tables' build, a schema's compile, and the masks of a
batch-8 DSpark round (8 requests; the drafter's 7 slots masked as they are sampled, then the 8 verify
rows masked with the same masks; matchers halfway through real answers): the work a grammar adds to
one engine step.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Optional

from sparkrelay import LLM, SamplingParams
from sparkrelay.grammar.backends import BACKENDS
from sparkrelay.tools.bench import common as bc
from sparkrelay.tools.bench.schemas import SCHEMAS, request_text
from sparkrelay.tools.bench.structured_costs import BATCH, MAX_TOKENS, MODELS, ROWS, backend_costs
from sparkrelay.tools.cluster import PDSettings, start_pd
from sparkrelay.tools.train.chat_data import chat_ids


def _params(schema: Optional[dict]) -> SamplingParams:
    extra = {} if schema is None else {"json_schema": json.dumps(schema)}
    return SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0, **extra)


def offline(model: str, drafter: Optional[str], grammar: bool, backend: str) -> dict:
    """The twenty requests one at a time (batch 1); -> ids, texts, acceptance."""
    kw = dict(grammar_backend=backend, max_total_tokens=8192)
    if drafter:
        kw |= dict(speculative_algorithm="DSPARK", speculative_draft_model_path=drafter)
    llm = LLM(model, **kw)
    outs = [
        llm.generate(
            chat_ids(llm.tokenizer, request_text(what)), _params(schema if grammar else None)
        )
        for what, schema in SCHEMAS
    ]
    stats = llm.engine.spec_stats.summary() if drafter else {}
    llm.engine.close()
    return {
        "ids": [o["output_ids"] for o in outs],
        "texts": [o["text"] for o in outs],
        "stopped": [o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs],
        "tau": stats.get("spec_accept_length"),
    }


def _post(url: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def pd_texts(model: str, drafter: str, log_dir: str) -> dict:
    """The twenty requests through a PD deployment's router, as chat completions."""
    cluster = start_pd(PDSettings(model=model, drafter=drafter, handoff="draft-kv"), log_dir)
    try:
        texts, stopped, deadline = [], [], time.monotonic() + 60
        for what, schema in SCHEMAS:
            body = {
                "messages": [{"role": "user", "content": request_text(what)}],
                "temperature": 0,
                "max_tokens": MAX_TOKENS,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema},
                },
            }
            while True:
                status, out = _post(cluster.url + "/v1/chat/completions", body)
                if status != 503 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            if status != 200:
                raise RuntimeError(
                    f"PD answered {status}: {out}; decode log: {cluster.decode.log_tail()}"
                )
            texts.append(out["choices"][0]["message"]["content"])
            stopped.append(out["choices"][0]["finish_reason"] == "stop")
        return {"texts": texts, "stopped": stopped}
    finally:
        cluster.stop()


def valid(run: dict) -> dict:
    """How many answers validate against their schema, and how many the grammar ended (the rest ran
    out of tokens: a cut answer is not JSON, whatever the grammar)."""
    import jsonschema

    ok = []
    for text, (_, schema) in zip(run["texts"], SCHEMAS):
        try:
            jsonschema.validate(json.loads(text), schema)
            ok.append(True)
        except (ValueError, jsonschema.ValidationError):
            ok.append(False)
    stopped = run["stopped"]
    return {
        "valid": sum(ok),
        "stopped": sum(stopped),
        "valid_of_stopped": sum(v for v, st in zip(ok, stopped) if st),
    }


def measure_model(key: str, args) -> dict:
    model, drafter = MODELS[key]
    print(f"[{key}] plain, then DSpark with and without the grammar ...", flush=True)
    plain = offline(model, None, True, args.backend)
    spec = offline(model, drafter, True, args.backend)
    free = offline(model, drafter, False, args.backend)
    print(f"[{key}] PD ...", flush=True)
    pd = (
        pd_texts(model, drafter, tempfile.mkdtemp(prefix=f"structured-{key}-")) if args.pd else None
    )
    print(f"[{key}] the backends' costs ...", flush=True)
    return {
        "model": key,
        "valid": {"plain": valid(plain), "dspark": valid(spec), "pd": valid(pd) if pd else None},
        "dspark_equals_plain": sum(a == b for a, b in zip(plain["ids"], spec["ids"])),
        "pd_equals_plain": sum(a == b for a, b in zip(plain["texts"], pd["texts"])) if pd else None,
        "tau_grammar": spec["tau"],
        "tau_free": free["tau"],
        "backends": backend_costs(model, drafter, plain["ids"], args.repeats),
        "examples": plain["texts"][:3],
    }


def _valid_cell(v: Optional[dict], n: int) -> str:
    """'valid/n (valid of the stopped/stopped)'."""
    if v is None:
        return "-"
    return f"{v['valid']}/{n} ({v['valid_of_stopped']}/{v['stopped']})"


def _engine_cell(e: dict) -> str:
    """'median / max; masks' of engine_rounds' figures."""
    if not e["rounds"]:
        return "-"
    return f"{bc.fmt(e['ms_median'], 2)} / {bc.fmt(e['ms_max'], 2)}; {bc.fmt(e['masks_median'], 0)}"


def report(args, record: dict) -> None:
    out = Path(args.out_dir)
    n = len(SCHEMAS)
    rows = [
        [
            m["model"],
            _valid_cell(m["valid"]["plain"], n),
            _valid_cell(m["valid"]["dspark"], n),
            _valid_cell(m["valid"]["pd"], n),
            f"{m['dspark_equals_plain']}/{n}",
            "-" if m["pd_equals_plain"] is None else f"{m['pd_equals_plain']}/{n}",
            bc.fmt(m["tau_grammar"], 2),
            bc.fmt(m["tau_free"], 2),
        ]
        for m in record["models"]
    ]
    table = bc.markdown_table(
        [
            "model",
            "valid plain",
            "valid DSpark",
            "valid PD",
            "DSpark = plain",
            "PD = plain",
            "tau with grammar",
            "tau without",
        ],
        rows,
    )
    cost_rows = [
        [
            m["model"],
            b["backend"],
            bc.fmt(b["tables_s"], 2),
            bc.fmt(b["compile_ms"], 2),
            f"{bc.fmt(b['step_ms_median'], 2)} / {bc.fmt(b['step_ms_max'], 2)}",
            _engine_cell(b["engine_greedy"]),
            _engine_cell(b["engine_sampled"]),
        ]
        for m in record["models"]
        for b in m["backends"]
    ]
    costs = bc.markdown_table(
        [
            "model",
            "backend",
            "tokenizer tables (s)",
            "compile (ms, median)",
            "every row masked (ms, median / max)",
            "engine, greedy (ms, median / max; masks)",
            "engine, T=1 (ms, median / max; masks)",
        ],
        cost_rows,
    )
    notes = [
        f"Greedy, at most {MAX_TOKENS} new tokens, one request at a time; PD = PP=2 prefill without a drafter, "
        "DSpark decode (`draft-kv`), sparkrelay's router, `/v1/chat/completions` with `response_format`. "
        "valid: answers that validate with `jsonschema`; in brackets, of the answers the grammar ended "
        "(finish_reason stop; the others ran out of tokens). "
        "tau: DSpark's mean acceptance length over the twenty requests (bonus token included).",
        "",
        f"What a grammar adds to one engine step at batch {BATCH}, per backend. Every row masked: a "
        f"synthetic DSpark round of {BATCH} requests, the drafter's {ROWS - 1} slots masked as they are "
        f"sampled and the {ROWS} verify rows with the same masks (matchers halfway through real "
        "answers), what a sampled round must do. Engine: the grammar's part (the drafter's slots, the "
        "verify rows' masks, the matchers' walk) of each DSpark round of the engine that ran "
        f"{BATCH} constrained requests at once (the twenty requests, {BATCH} decoding, the rest "
        "queued), with the masks it computed: a greedy row is masked only where the grammar refuses "
        "its argmax (grammar/rows.py).",
        "",
        costs,
    ]
    bc.write_markdown(
        out / "structured.md", "Structured outputs", bc.header_lines(record), table, notes
    )
    bc.write_json(out / "structured.json", record)
    groups = [
        f"{m['model']}\n{b['backend'].split()[0]}" for m in record["models"] for b in m["backends"]
    ]
    bc.bar_chart(
        out / "structured.png",
        groups,
        {
            "every row masked": [
                b["step_ms_median"] for m in record["models"] for b in m["backends"]
            ],
            "engine, greedy": [
                b["engine_greedy"]["ms_median"] for m in record["models"] for b in m["backends"]
            ],
            "engine, T=1": [
                b["engine_sampled"]["ms_median"] for m in record["models"] for b in m["backends"]
            ],
        },
        f"grammar work of a batch-{BATCH} DSpark round (median)",
        "ms per step",
    )
    print((out / "structured.md").read_text())


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--models", default="tiny-qwen3,smollm2", help=f"comma-separated: {', '.join(MODELS)}"
    )
    p.add_argument(
        "--backend", default="llguidance", choices=BACKENDS, help="the servers' grammar backend"
    )
    p.add_argument("--no-pd", dest="pd", action="store_false", help="skip the PD deployment")
    p.add_argument("--repeats", type=int, default=40, help="timed verify steps per backend")
    p.add_argument("--out-dir", default="benchmarks/results/structured")
    args = p.parse_args(argv)
    record = bc.provenance("sparkrelay.tools.bench.structured", argv)
    record["models"] = [measure_model(k, args) for k in args.models.split(",")]
    report(args, record)


if __name__ == "__main__":
    main()
