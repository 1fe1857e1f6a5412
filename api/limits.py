"""Request body size limit as plain ASGI middleware: a declared Content-Length over the limit is
refused before any byte is read, and a body streamed without one (chunked) is counted as it
arrives and refused as soon as it crosses the limit. Both answer 413."""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException

Scope = dict[str, Any]
Message = dict[str, Any]


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, detail=f"request body over this server's limit of {limit} bytes "
                         "(the server's PIPEPLAN_MAX_BODY_BYTES); send a profile once with "
                         "POST /v1/profiles and then refer to it by profile_id")


class BodySizeLimit:
    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, scope: Scope, send: Any) -> None:
        rid = scope.get("state", {}).get("request_id", "")
        body = json.dumps({"detail": BodyTooLarge(self.max_bytes).detail, "request_id": rid}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0  # the server itself rejects a malformed length
                if declared > self.max_bytes:
                    await self._refuse(scope, send)
                    return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, watched_send)
        except BodyTooLarge:
            if started:
                raise
            await self._refuse(scope, send)
