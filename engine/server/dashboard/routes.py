"""The dashboard's two routes. The page itself holds no data and is served without the API key
(a browser cannot send a bearer header when it loads a page); its data calls send
``Authorization: Bearer <key>``, the key typed into the page and kept in the tab's
sessionStorage, so /dashboard/data is protected like every other route (http_server.BearerAuth).
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from fastapi import FastAPI
from starlette.responses import HTMLResponse

from engine.server import openapi
from engine.server.dashboard.data import dashboard_data

PAGE = "/dashboard"
DATA = "/dashboard/data"


@cache
def page_html(needs_key: bool) -> str:
    """index.html, told whether the server wants a key (it then asks for one before its first
    data call instead of making one bound to fail)."""
    text = files("engine.server.dashboard").joinpath("index.html").read_text(encoding="utf-8")
    return text.replace('data-needs-key="NEEDS_KEY"', f'data-needs-key="{str(needs_key).lower()}"')


def install(app: FastAPI, llm, model_name: str, rejections, auth: bool) -> None:
    @app.get(PAGE, response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page_html(auth), headers={"Cache-Control": "no-cache"})

    @app.get(DATA, responses=openapi.errors(auth=auth))
    async def dashboard_json() -> dict:
        """What the dashboard at /dashboard draws: queues, KV use, prefix-cache hits, token and
        latency counters, a cluster's workers and the Conductor's recent decisions."""
        return dashboard_data(llm, model_name, rejections.snapshot())
