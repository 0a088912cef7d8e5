"""Hostile-input fuzzing of a running sparkrelay server or PD router over HTTP.

Two sources of requests, both sent to --url:
  1. schemathesis over the server's own OpenAPI schema (/openapi.json), as `st run --mode all`
     would: the coverage phase (boundary values, wrong types, missing fields, unexpected methods)
     and the fuzzing phase, valid and invalid data, with only the not-a-server-error check;
  2. hand-made hostile requests (`hostile_requests`): deep nesting, 10 MB bodies, invalid UTF-8, wrong content
     types, huge and non-finite numbers in every numeric field, empty and surrogate strings, bad token ids, bad
     bootstrap fields, wrong methods; and streaming requests the client closes after the first chunk.
Every answer's status is counted per route; a 5xx or a transport error (a crash, a hang past the timeout) is
kept with the request that caused it. Exit status 1 if there was any, or if GET /health is not 200 afterwards.

    python -m sparkrelay.tools.fuzz --url http://127.0.0.1:30000 --max-examples 1000

schemathesis is a test dependency (`pip install -e .[test]`); --no-schema runs the hand-made part
without it. This module talks HTTP only; its case tables are sparkrelay/tools/fuzz/cases.py (it
imports nothing else of sparkrelay).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterator, Optional

import httpx

from sparkrelay.tools.fuzz.cases import (
    GENERATE,
    KNOWN_PATHS,
    ROUTES,
    Hostile,
    base_body,
    bootstrap_hostile_requests,
    bootstrap_reads,
    hostile_requests,
)


@dataclass
class Report:
    """Status counts per route; `failures` keeps every 5xx and transport error with the request
    behind it."""

    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    failures: list[str] = field(default_factory=list)

    def record(self, route: str, status: Optional[int], request: str, answer: str = "") -> None:
        self.statuses[route][status if status is not None else "transport error"] += 1
        if status is None or status >= 500:
            self.failures.append(
                f"{route} -> {status or 'transport error'}: {request[:1500]} -> {answer[:500]}"
            )

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in self.statuses.values())

    def count(self, pred) -> int:
        return sum(n for c in self.statuses.values() for s, n in c.items() if pred(s))

    @property
    def num_5xx(self) -> int:
        return self.count(lambda s: isinstance(s, int) and s >= 500)

    @property
    def num_transport_errors(self) -> int:
        return self.count(lambda s: s == "transport error")

    def table(self) -> str:
        lines = [f"{'route':<34} {'requests':>8}  statuses"]
        for route in sorted(self.statuses):
            c = self.statuses[route]
            hist = ", ".join(f"{s}: {n}" for s, n in sorted(c.items(), key=lambda kv: str(kv[0])))
            lines.append(f"{route:<34} {sum(c.values()):>8}  {hist}")
        lines.append(
            f"total: {self.total} requests, {self.num_5xx} 5xx, {self.num_transport_errors} transport "
            "errors (crashes or hangs)"
        )
        return "\n".join(lines)


def _describe(method: str, url: str, content: bytes, ctype: Optional[str]) -> str:
    body = content[:300].decode("utf-8", "backslashreplace")
    more = f"... ({len(content)} bytes)" if len(content) > 300 else ""
    return f"{method} {url} [{ctype}] {body}{more}"


def send_hostile(client: httpx.Client, report: Report, requests: Iterator[Hostile]) -> None:
    for h in requests:
        headers = {"content-type": h.content_type} if h.content_type else {}
        path = h.path.split("?")[0]
        route = f"{h.method} {path if path in KNOWN_PATHS else '(odd paths)'} (hostile)"
        try:
            r = client.request(h.method, h.path, content=h.content, headers=headers)
            report.record(
                route,
                r.status_code,
                f"{h.name}: " + _describe(h.method, h.path, h.content, h.content_type),
                r.text,
            )
        except httpx.HTTPError as e:
            report.record(
                route,
                None,
                f"{h.name}: " + _describe(h.method, h.path, h.content, h.content_type),
                f"{type(e).__name__}: {e}",
            )


def stream_and_leave(
    client: httpx.Client, report: Report, path: str, max_tokens: int, times: int = 3
) -> None:
    """Streaming requests the client closes after the first chunk; the server must abort them and
    free their KV."""
    body = {**base_body(path, max_tokens), "stream": True}
    if path == GENERATE:
        body["sampling_params"]["ignore_eos"] = True
    else:
        body["ignore_eos"] = True
    for _ in range(times):
        try:
            with client.stream("POST", path, json=body) as r:
                for _chunk in r.iter_bytes():
                    break
            report.record(f"POST {path} (stream, left early)", r.status_code, json.dumps(body))
        except httpx.HTTPError as e:
            report.record(
                f"POST {path} (stream, left early)",
                None,
                json.dumps(body),
                f"{type(e).__name__}: {e}",
            )


def run_schema(
    url: str,
    report: Report,
    max_examples: int,
    phases: tuple[str, ...] = ("coverage", "fuzzing"),
    seed: Optional[int] = None,
    timeout: float = 120.0,
) -> None:
    """schemathesis cases from `url`/openapi.json (valid and invalid), every answer recorded in
    `report`."""
    import schemathesis
    from schemathesis.engine import events, from_schema

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", timeout=timeout)
    schema.config.update(base_url=url, request_timeout=timeout, continue_on_failure=True)
    schema.config.generation.update(
        modes=list(schemathesis.GenerationMode),
        max_examples=max_examples,
        database="none",
        deterministic=seed is None,
    )
    if seed is not None:
        schema.config.seed = seed
    schema.config.phases.update(phases=list(phases))
    schema.config.checks.update(included_check_names=["not_a_server_error"])

    def after_call(_ctx, case, response) -> None:
        report.record(
            case.operation.label,
            response.status_code,
            case.as_curl_command(),
            response.content[:500].decode("utf-8", "replace"),
        )

    def after_network_error(_ctx, case, _request) -> None:
        report.record(case.operation.label, None, case.as_curl_command())

    schema.hooks.hook(after_call)
    schema.hooks.hook(after_network_error)
    for event in from_schema(schema).execute():
        if isinstance(event, (events.NonFatalError, events.FatalError)):
            report.failures.append(f"schemathesis error: {event}")


def final_state(client: httpx.Client, timeout: float = 10.0) -> tuple[int, Optional[dict]]:
    """(GET /health status, the engine's last stats once idle, or None if the server does not report
    them)."""
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        try:
            info = client.get("/server_info")
            state = (
                (info.json().get("internal_states") or [None])[0]
                if info.status_code == 200
                else None
            )
        except (httpx.HTTPError, ValueError, AttributeError):
            state = None
        if not isinstance(state, dict) or (
            state.get("num_running", 0) == 0 and state.get("num_waiting", 0) == 0
        ):
            break
        time.sleep(0.1)
    try:
        health = client.get("/health").status_code
    except httpx.HTTPError:
        health = 0
    return health, state if isinstance(state, dict) else None


def verdict(report: Report, health: int, state: Optional[dict]) -> tuple[bool, str]:
    """(passed, the verdict line): no 5xx, no transport error, /health 200 afterwards, no KV left in
    use."""
    why = [
        f"{n} {what}"
        for n, what in (
            (report.num_5xx, "5xx answers"),
            (report.num_transport_errors, "transport errors (crashes or hangs)"),
        )
        if n
    ]
    # e.g. schemathesis' own errors
    if len(report.failures) > report.num_5xx + report.num_transport_errors:
        why.append(
            f"{len(report.failures) - report.num_5xx - report.num_transport_errors} other failures"
        )
    if health != 200:
        why.append(f"GET /health answered {health or 'nothing'} afterwards")
    if state is not None and state.get("kv_used_tokens"):
        why.append(f"{state['kv_used_tokens']} KV tokens still in use afterwards")
    if why:
        return False, "Verdict: FAIL: " + "; ".join(why)
    return True, (
        f"Verdict: PASS ({report.total} requests: no 5xx, no transport error, /health 200 afterwards"
        + (", no KV left in use)" if state is not None else ")")
    )


def _max_model_len(client: httpx.Client) -> int:
    try:
        return int(client.get("/v1/models").json()["data"][0]["max_model_len"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return 64


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sparkrelay.tools.fuzz", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--url", required=True, help="base URL of a sparkrelay server or PD router")
    ap.add_argument(
        "--max-examples", type=int, default=200, help="schemathesis fuzzing examples per operation"
    )
    ap.add_argument(
        "--seed", type=int, default=None, help="schemathesis seed (default: deterministic run)"
    )
    ap.add_argument(
        "--no-schema", action="store_true", help="hand-made hostile requests only (no schemathesis)"
    )
    ap.add_argument("--no-hostile", action="store_true", help="schemathesis only")
    ap.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, seconds")
    ap.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    ap.add_argument(
        "--bootstrap",
        action="store_true",
        help="--url is a PD prefill bootstrap server: send its hostile requests only",
    )
    args = ap.parse_args(argv)
    url = args.url.rstrip("/")
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    report, start = Report(), time.monotonic()
    with httpx.Client(
        base_url=url, timeout=args.timeout, trust_env=False, headers=headers
    ) as client:
        if args.bootstrap:
            for h in bootstrap_hostile_requests():
                send_hostile(client, report, [h, *bootstrap_reads()])
            print(report.table())
            for f in report.failures[:50]:
                print("FAILURE", f)
            ok, line = verdict(report, client.get("/health").status_code, None)
            print(line)
            return 0 if ok else 1
        if not args.no_hostile:
            send_hostile(client, report, hostile_requests())
            for path in ROUTES:
                stream_and_leave(client, report, path, max(1, _max_model_len(client) // 2))
        if not args.no_schema:
            run_schema(url, report, args.max_examples, seed=args.seed, timeout=args.timeout)
        health, state = final_state(client)
    print(report.table())
    kv = (
        "not reported"
        if state is None
        else f"{state.get('kv_used_tokens')} KV tokens in use, "
        f"{state.get('num_running')} running, {state.get('num_waiting')} waiting"
    )
    print(f"after {time.monotonic() - start:.0f} s: GET /health -> {health}; engine: {kv}")
    for f in report.failures[:50]:
        print("FAILURE", f)
    ok, line = verdict(report, health, state)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
