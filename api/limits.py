"""Request body limits as plain ASGI middleware.

- Size: a declared Content-Length over the limit is refused before any byte is read, and a body
  streamed without one (chunked) is counted as it arrives and refused as soon as it crosses the
  limit. Both answer 413.
- Draining: a client that sends its whole body before reading the answer (Python's
  http.client, requests and httpx do, where curl waits on `Expect: 100-continue`) met a closed
  connection, a reset, instead of the 413 that says why. So up to DRAIN_FACTOR x the limit
  (at most DRAIN_MAX_BYTES) of a refused body is read and dropped first, within the body's
  time limit (or DRAIN_S); beyond that the connection is closed at once.
- Time: a body that has not fully arrived `timeout_s` after its first read (a client that sends
  the headers and then stalls, or trickles bytes) is answered 408 and its connection closed,
  instead of holding a connection and a request task for as long as the client likes.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import HTTPException

Scope = dict[str, Any]
Message = dict[str, Any]


# The rest of the body is never read, so the connection cannot carry another request: the
# answer closes it. Raised where a route reads the body, the error becomes a response through
# the app's exception handler, not `_refuse`; without the header the server kept reading (and
# discarding) what a trickling client sent, for as long as it went on sending.
CLOSE = {"connection": "close"}


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, detail=f"request body over this server's limit of {limit} bytes "
                         "(the server's PIPEPLAN_MAX_BODY_BYTES): a plan request can send its "
                         "profile once with POST /v1/profiles and then refer to it by profile_id; "
                         "a profile that is itself this large needs a server started with a larger "
                         "PIPEPLAN_MAX_BODY_BYTES", headers=CLOSE)


class BodyTimeout(HTTPException):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, detail=f"the request body did not arrive within {timeout_s:g} s "
                         "(the server's PIPEPLAN_BODY_TIMEOUT_S); send the whole body at once",
                         headers=CLOSE)


class Unauthorized(HTTPException):
    def __init__(self) -> None:
        super().__init__(401, detail="missing or wrong API key: send 'Authorization: Bearer <key>'",
                         headers={"WWW-Authenticate": "Bearer"})


DRAIN_FACTOR = 4  # of the limit: the most of a refused body read (and dropped) before the 413
DRAIN_MAX_BYTES = 256 * 1024 * 1024
DRAIN_S = 10.0  # the longest a drain takes where bodies have no time limit


class BodySizeLimit:
    """`authorized(headers)`: whether a request may be answered about its body at all (its API
    key is right, or the server has none): a declared body over the limit with a wrong or
    missing key on a /v1 route is a 401, not the 413 that tells a stranger the limit (the key
    is checked before the body everywhere else)."""

    def __init__(self, app: Any, max_bytes: int, timeout_s: float | None = None,
                 authorized: Any = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.authorized = authorized

    async def _refuse(self, scope: Scope, send: Any, error: HTTPException) -> None:
        rid = scope.get("state", {}).get("request_id", "")
        body = json.dumps({"detail": error.detail, "request_id": rid}).encode()
        extra = [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()
                 if k.lower() != "connection"]
        await send({"type": "http.response.start", "status": error.status_code,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close"), *extra]})
        await send({"type": "http.response.body", "body": body})

    def _drain_bytes(self) -> int:
        return min(DRAIN_FACTOR * self.max_bytes, max(DRAIN_MAX_BYTES, self.max_bytes))

    async def _drain(self, receive: Any, most: int) -> None:
        """Read and drop up to `most` bytes of the body, until its end, within the body's time
        limit (or DRAIN_S): then the client that sends all before it reads gets the answer."""
        left = max(most, 0)
        end = time.monotonic() + (self.timeout_s if self.timeout_s is not None else DRAIN_S)
        while left > 0:
            try:
                message = await asyncio.wait_for(receive(), max(end - time.monotonic(), 0.0))
            except TimeoutError:
                return
            if message["type"] != "http.request":
                return  # the client went away
            left -= len(message.get("body", b""))
            if not message.get("more_body", False):
                return

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
                    if declared <= self._drain_bytes():
                        await self._drain(receive, declared)
                    error: HTTPException = BodyTooLarge(self.max_bytes)
                    path, root = str(scope.get("path", "")), str(scope.get("root_path", ""))
                    if root and path.startswith(root):  # (served under a prefix: mounted, --root-path)
                        path = path[len(root):]
                    if (self.authorized is not None and path.startswith("/v1")
                            and not self.authorized(scope.get("headers", []))):
                        error = Unauthorized()
                    await self._refuse(scope, send, error)
                    return
        received = 0
        started = False
        complete = False  # the body's last chunk has arrived: later reads wait for a disconnect
        deadline: float | None = None

        async def limited_receive() -> Message:
            nonlocal received, complete, deadline
            if complete or self.timeout_s is None:
                message = await receive()
            else:
                if deadline is None:
                    deadline = time.monotonic() + self.timeout_s
                try:
                    message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
                except TimeoutError:
                    raise BodyTimeout(self.timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > self.max_bytes:
                    if not complete:
                        await self._drain(receive, self._drain_bytes() - received)
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, watched_send)
        except (BodyTooLarge, BodyTimeout) as error:
            if started:
                raise
            await self._refuse(scope, send, error)
