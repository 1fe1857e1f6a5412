"""`/docs` (Swagger UI) and `/openapi.json`, usable in a browser on an air-gapped cluster.

The Swagger UI files come from the `swagger-ui-bundle-v2` package and are served by this server
under `/docs/assets/` (no CDN). The page and the schema need no API key: they hold no data, and a
browser cannot send a Bearer header when it opens a page; the "Authorize" button of the page
takes the key for the calls made from it.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs/assets"


def assets_dir() -> Path | None:
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        return None
    return Path(str(swagger_ui_path))


def install(app: FastAPI) -> None:
    folder = assets_dir()

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def swagger(request: Request) -> HTMLResponse:
        if folder is None:
            return HTMLResponse("<p>Swagger UI is not installed on this server (pip install "
                                "swagger-ui-bundle-v2); the schema is at <a href='/openapi.json'>"
                                "/openapi.json</a>.</p>", status_code=200)
        return get_swagger_ui_html(
            openapi_url="/openapi.json", title="pipeplan API",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js", swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
            oauth2_redirect_url="/docs/oauth2-redirect",
            swagger_ui_parameters={"persistAuthorization": True},
        )

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    if folder is not None:
        app.mount(ASSETS, StaticFiles(directory=folder), name="swagger-assets")
