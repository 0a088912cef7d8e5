"""The PD router's own routes besides generation: health, info (both sides), cache flush, metrics.

GET /server_info (and /get_server_info) answers for the whole deployment: the router's own settings,
each prefill's and each decode's /server_info (a worker that does not answer appears as {"url",
"error"}), and `internal_states` taken from the decode workers, where the DSpark figures (acceptance
length, verify rounds) live, so tools that read `internal_states[0]` of a server read the decode's.
Model information is the same on every worker and is taken from the first prefill.
"""

from __future__ import annotations

import asyncio
import json
from typing import Callable

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import sparkrelay
from sparkrelay.router.metrics import RouterMetrics
from sparkrelay.router.rewrite import PrefillWorker, RouterConfig, error_body
from sparkrelay.router.upstream import Reply, send

MODEL_ROUTES = ("/model_info", "/get_model_info", "/v1/models")


def _worker_info(url: str, reply: Reply) -> dict:
    if reply.ok:
        try:
            info = json.loads(reply.body)
        except ValueError:
            info = None
        if isinstance(info, dict):
            return {"url": url, **info}
    return {"url": url, "error": reply.error or f"HTTP {reply.status}"}


async def deployment_info(client: aiohttp.ClientSession, config: RouterConfig) -> dict:
    """The router's settings and every worker's /server_info, fetched at once."""
    p_urls, d_urls = [p.url for p in config.prefill], list(config.decode)
    replies = await asyncio.gather(
        *(send(client, "GET", u + "/server_info") for u in p_urls + d_urls)
    )
    infos = [_worker_info(u, r) for u, r in zip(p_urls + d_urls, replies)]
    prefill, decode = infos[: len(p_urls)], infos[len(p_urls) :]
    states = [
        s for info in decode for s in (info.get("internal_states") or []) if isinstance(s, dict)
    ]
    router = {
        "version": sparkrelay.__version__,
        "mode": "pd-disaggregation",
        "max_retries": config.max_retries,
        "request_timeout_secs": config.request_timeout_secs,
        "prefill": [{"url": p.url, "bootstrap_port": p.bootstrap_port} for p in config.prefill],
        "decode": d_urls,
    }
    return {
        "role": "router",
        "router": router,
        "prefill": prefill,
        "decode": decode,
        "internal_states": states,
    }


def add_admin_routes(
    app: FastAPI,
    config: RouterConfig,
    session: Callable[[], aiohttp.ClientSession],
    pick: Callable[[], tuple[PrefillWorker, str]],
    metrics: RouterMetrics,
) -> None:
    """session(): the router's client session (open while the app serves)."""

    async def health() -> Response:
        return Response(status_code=200)

    async def health_generate() -> Response:
        p, d = pick()
        replies = await asyncio.gather(
            send(session(), "GET", p.url + "/health"), send(session(), "GET", d + "/health")
        )
        report = {"prefill": replies[0].status, "decode": replies[1].status}
        return JSONResponse(report, 200 if all(r.ok for r in replies) else 503)

    async def server_info() -> JSONResponse:
        return JSONResponse(await deployment_info(session(), config))

    async def model_info(request: Request) -> Response:
        reply = await send(session(), "GET", config.prefill[0].url + request.url.path)
        if reply.status is None:
            return JSONResponse(
                error_body(f"prefill server: {reply.error}", "prefill_server_error", 502), 502
            )
        return Response(reply.body, reply.status, media_type=reply.media_type)

    async def flush_cache() -> JSONResponse:
        urls = [p.url for p in config.prefill] + list(config.decode)
        replies = await asyncio.gather(*(send(session(), "POST", u + "/flush_cache") for u in urls))
        return JSONResponse(
            {
                "results": [
                    {"url": u, "status": r.status, "error": r.error or None}
                    for u, r in zip(urls, replies)
                ]
            }
        )

    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/health_generate", health_generate, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    for path in MODEL_ROUTES:
        app.add_api_route(path, model_info, methods=["GET"])
    app.add_api_route("/flush_cache", flush_cache, methods=["POST"])
    app.add_api_route("/metrics", prometheus, methods=["GET"])
