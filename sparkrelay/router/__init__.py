"""PD router: an sglang-router-compatible load balancer for prefill/decode disaggregation.

`rewrite` holds the pure request-rewriting helpers (bootstrap fields, batch detection, worker
specs); `app` holds the FastAPI app that forwards each request to a (prefill, decode) pair with
aiohttp. Start it with `python -m sparkrelay.launch_router --pd-disaggregation --prefill URL [PORT]
--decode URL`.
"""
