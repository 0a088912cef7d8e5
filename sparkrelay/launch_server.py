"""`python -m sparkrelay.launch_server --model-path DIR [--port N ...]`: build the engine and serve HTTP.

Flags are generated from sparkrelay.config; a bad flag or setting prints a message naming it and exits 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

from sparkrelay.config import Config, ConfigError, add_cli_args, config_from_args


def parse_config(argv: Optional[list[str]] = None) -> Config:
    parser = argparse.ArgumentParser(prog="python -m sparkrelay.launch_server",
                                     description="Serve a model over HTTP (SGLang-native and OpenAI APIs).")
    add_cli_args(parser)
    args = parser.parse_args(argv)  # unknown flag or bad value: argparse names it and exits 2
    try:
        return config_from_args(args)
    except ConfigError as e:
        parser.error(str(e))  # exits 2


def serve(config: Config) -> None:
    import uvicorn

    from sparkrelay.engine.disagg_engine import build_engine
    from sparkrelay.server.async_engine import AsyncEngine
    from sparkrelay.server.http_server import build_app

    engine = build_engine(config)
    try:
        app = build_app(AsyncEngine(engine), config)
        uvicorn.run(app, host=config.server.host, port=config.server.port, log_level=config.server.log_level,
                    timeout_graceful_shutdown=5)  # a dying server does not wait on clients that never read
    finally:
        engine.close()  # pipeline stages, bootstrap server, transfer agents


def main(argv: Optional[list[str]] = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(config)
    except (ConfigError, FileNotFoundError, OSError, ValueError) as e:
        print(f"error: cannot start the server: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
