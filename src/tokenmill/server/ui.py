"""The web page (chat playground and engine dashboard) and the JSON endpoints it reads.

- ``GET /`` and ``GET /ui``: the page; ``/ui/static/*``: its script and style, shipped in
  the package (no build step, nothing from a CDN). The page holds no data, so it needs
  no API key; everything it shows comes from ``/v1/*``, which does.
- ``GET /v1/engine/state?since=T``: the scheduler's gauges now, one sample per second
  of the last minutes (only those after ``T`` when given), latency percentiles and
  totals (``EngineHistory``).
- ``GET /v1/requests/recent?limit=N``: the newest requests' lifecycles (``RequestLog``).

Both answer ``"stats_enabled": false`` with empty data under ``--disable-log-stats``.
"""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import FastAPI, Query
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from tokenmill.frontend.request_log import RequestLog
from tokenmill.metrics.history import SAMPLE_FIELDS, EngineHistory

STATIC_DIR = Path(__file__).parent / "static"
# The page runs only its own files: an injected inline script or handler cannot run.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; object-src 'none'; base-uri 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def install_ui(app: FastAPI, model_name: str, engine_limits: dict[str, int],
               history: EngineHistory | None, request_log: RequestLog | None) -> None:
    """``engine_limits``: the sizes the dashboard draws against (``max_num_seqs``,
    ``max_num_batched_tokens``, ``max_model_len``, ``kv_cache_tokens_total``)."""
    app.mount("/ui/static", StaticFiles(directory=STATIC_DIR), name="ui-static")

    @app.get("/", include_in_schema=False)
    @app.get("/ui", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers=_PAGE_HEADERS)

    config = dict(engine_limits)

    @app.get("/v1/engine/state")
    async def engine_state(since: float | None = Query(None)) -> dict:  # noqa: B008
        to_wall = time.time() - time.monotonic()
        body = {"object": "engine.state", "model": model_name, "time": round(time.time(), 3),
                "stats_enabled": history is not None, "config": config}
        if history is None:
            return body
        since_second = None if since is None else round(since - to_wall)
        g = history.latest
        body.update({
            "window_s": history.window_s,
            "current": {"running": g.num_running, "waiting": g.num_waiting,
                        "tokens_waiting": g.num_tokens_waiting,
                        "kv_cache_usage": round(g.kv_cache_usage, 4),
                        "kv_cache_tokens_used": g.kv_cache_tokens_used},
            "totals": {"preemptions": history.total_preemptions,
                       "finished": dict(history.finished)},
            "latency": history.latency_percentiles(),
            "fields": SAMPLE_FIELDS,
            "samples": [[round(row[0] + to_wall), *row[1:]]
                        for row in history.samples(since_second)],
        })
        return body

    @app.get("/v1/requests/recent")
    async def recent_requests(limit: int = Query(50, ge=1, le=1000)) -> dict:  # noqa: B008
        data = request_log.recent(limit) if request_log is not None else []
        return {"object": "list", "time": round(time.time(), 3),
                "stats_enabled": request_log is not None,
                "text_included": bool(request_log and request_log.keep_text), "data": data}
