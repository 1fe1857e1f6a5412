"""The HTTP/1.1 protocol the service runs under uvicorn: uvicorn's h11 protocol with the two
things a service open to clients needs and uvicorn does not do.

- **Headers in time.** A connection whose request headers have not all arrived
  `header_timeout_s` after it opened (or after its previous response) is answered 408 and
  closed. uvicorn holds such a connection for as long as the client likes (its keep-alive
  timer stops at the first byte), so a client that sends half a request line holds a socket
  and a file descriptor forever. The body has its own limit (`api.limits`).
- **Errors in one shape.** A request that is not valid HTTP gets the JSON error every other
  error gets (`{"detail": ..., "request_id": ...}`), not uvicorn's text/plain 400.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def _response(status: int, reason: str, detail: str) -> bytes:
    rid = uuid.uuid4().hex
    body = json.dumps({"detail": detail, "request_id": rid}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nx-request-id: {rid}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class _Protocol(H11Protocol):
    header_timeout_s: float = 30.0
    _header_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return  # closed, or a request is in (its body has the body timeout)
        self.logger.warning("request headers not received within %g s: connection closed",
                            self.header_timeout_s)
        self.transport.write(_response(
            408, "Request Timeout", f"the request's headers did not arrive within "
            f"{self.header_timeout_s:g} s (the server's PIPEPLAN_HEADER_TIMEOUT_S); send the "
            "whole request at once"))
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # still waiting for the end of the headers
            self._arm()
        else:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's headers (uvicorn's keep-alive closes an idle one)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._disarm()
        self.transport.write(_response(
            400, "Bad Request", "the request is not valid HTTP/1.1 (its request line or headers "
            "could not be parsed); send a well-formed HTTP request"))
        self.transport.close()


def protocol_class(header_timeout_s: float) -> type[H11Protocol]:
    """The protocol class to give uvicorn (`http=`), with this header timeout."""
    return type("PipeplanHTTP", (_Protocol,), {"header_timeout_s": header_timeout_s})
