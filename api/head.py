"""HEAD on every route that serves GET (RFC 9110: HEAD is GET without the body), as plain
ASGI middleware: FastAPI's routes answer only the methods they name, so without it `curl -I`
got 405 where GET works. A route that names HEAD itself keeps its own (none does now: `/healthz`
had one, which answered without the GET's Content-Type and Content-Length)."""

from __future__ import annotations

from typing import Any

from starlette.routing import Match, Router

Scope = dict[str, Any]
Message = dict[str, Any]


def serves(router: Router, scope: Scope, method: str) -> bool:
    probe = {**scope, "method": method}
    return any(route.matches(probe)[0] == Match.FULL for route in router.routes)


class HeadAsGet:
    def __init__(self, app: Any, router: Router) -> None:
        self.app, self.router = app, router

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope["method"] != "HEAD" or serves(self.router, scope, "HEAD")
                or not serves(self.router, scope, "GET")):
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)
