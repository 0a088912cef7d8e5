"""`python -m sparkrelay.launch_router --pd-disaggregation --prefill URL [BOOTSTRAP_PORT] --decode
URL ...`.

The flags follow sglang-router's (`python -m sglang_router.launch_router`) for the PD mode only. A
bad flag or value prints a message naming it and exits 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

from sparkrelay.router.rewrite import RouterConfig, parse_prefill, worker_url

LOG_LEVELS = {
    "debug": "debug",
    "info": "info",
    "warn": "warning",
    "warning": "warning",
    "error": "error",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sparkrelay.launch_router",
        description="PD router: send each request to a prefill and a decode worker.",
    )
    parser.add_argument(
        "--pd-disaggregation", action="store_true", help="PD mode (the only mode supported)"
    )
    parser.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        default=[],
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="a prefill worker: URL, then its bootstrap port (optional, or 'none'); repeatable",
    )
    parser.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="a decode worker; repeatable"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="port to bind (default: 30000)")
    parser.add_argument(
        "--request-timeout-secs",
        type=float,
        default=1800.0,
        help="timeout of each upstream request, seconds (default: 1800)",
    )
    parser.add_argument(
        "--max-retries",
        "--retry-max-retries",
        dest="max_retries",
        type=int,
        default=2,
        help=(
            "retries after a transport error or a 5xx that is not deterministic (never a 4xx or a "
            "schema mismatch), each with a new room (default: 2)"
        ),
    )
    parser.add_argument("--log-level", choices=sorted(LOG_LEVELS), default="info")
    return parser


def config_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> RouterConfig:
    """Validate the parsed flags; a bad value calls parser.error (exit 2) with the flag's name."""
    if not args.pd_disaggregation:
        parser.error(
            "only PD mode is supported: pass --pd-disaggregation with --prefill and --decode workers"
        )
    if not args.prefill or not args.decode:
        parser.error("PD mode needs at least one --prefill and one --decode worker")
    try:
        prefill = tuple(parse_prefill(values) for values in args.prefill)
    except ValueError as e:
        parser.error(f"argument --prefill: {e}")
    try:
        decode = tuple(worker_url(url) for url in args.decode)
    except ValueError as e:
        parser.error(f"argument --decode: {e}")
    if args.max_retries < 0:
        parser.error("argument --max-retries: must be >= 0")
    if args.request_timeout_secs <= 0:
        parser.error("argument --request-timeout-secs: must be > 0")
    if not 0 <= args.port <= 65535:
        parser.error("argument --port: must be in 0..65535")
    return RouterConfig(prefill, decode, args.request_timeout_secs, args.max_retries)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_from_args(parser, args)
    level = LOG_LEVELS[args.log_level]
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvicorn

    from sparkrelay.router.app import build_app

    logging.getLogger("sparkrelay.router").info(
        "PD router on %s:%d: prefill %s, decode %s",
        args.host,
        args.port,
        [(p.url, p.bootstrap_port) for p in config.prefill],
        config.decode,
    )
    uvicorn.run(build_app(config), host=args.host, port=args.port, log_level=level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
