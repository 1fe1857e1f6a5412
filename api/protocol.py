"""The HTTP/1.1 protocol the service runs under uvicorn: uvicorn's h11 protocol with the two
things a service open to clients needs and uvicorn does not do.

- **Headers in time.** A connection whose request headers have not all arrived
  `header_timeout_s` after it opened (or after its previous response) is answered 408 and
  closed. uvicorn holds such a connection for as long as the client likes (its keep-alive
  timer stops at the first byte), so a client that sends half a request line holds a socket
  and a file descriptor forever. The body has its own limit (`api.limits`), which answers 408
  where a route reads the body; where none does (`GET /healthz` with a `Content-Length` of a
  megabyte sent a byte at a time, a 404), the connection is closed once the body has not
  arrived `body_timeout_s` (plus a second) after its headers: uvicorn would keep reading it.
- **Responses read in time.** A connection whose client stops reading (the socket's buffers
  full and the transport's write buffer over its high-water mark: uvicorn's flow control pauses
  the response) for `write_timeout_s` is aborted. uvicorn waits for it for ever: a client that
  pipelined 400 requests and read nothing held its connection and 4 MB of responses (an
  outside review).
- **Errors in one shape.** A request that is not valid HTTP gets the JSON error every other
  error gets (`{"detail": ..., "request_id": ...}`), not uvicorn's text/plain 400.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

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
    body_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _write_timer: asyncio.TimerHandle | None = None

    def _start(self, timer: str, delay_s: float, then: Any) -> None:
        """Start the timer held in attribute `timer` unless it runs already."""
        if getattr(self, timer) is None:
            setattr(self, timer, self.loop.call_later(delay_s, then))

    def _stop(self, timer: str) -> None:
        handle = getattr(self, timer)
        if handle is not None:
            handle.cancel()
            setattr(self, timer, None)

    def pause_writing(self) -> None:  # the transport's write buffer is over its high-water mark
        super().pause_writing()
        self._start("_write_timer", self.write_timeout_s, self._unread)

    def resume_writing(self) -> None:
        self._stop("_write_timer")
        super().resume_writing()

    def _unread(self) -> None:
        self._write_timer = None
        if self.transport.is_closing():
            return
        self.logger.warning("the client read none of its response for %g s: connection aborted",
                            self.write_timeout_s)
        self.transport.abort()  # close() would wait to flush what the client does not read

    def _arm(self) -> None:
        self._start("_header_timer", self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        self._stop("_header_timer")

    def _arm_body(self) -> None:  # a second after the route's own 408 (api.limits)
        self._start("_body_timer", self.body_timeout_s + 1.0, self._body_late)

    def _disarm_body(self) -> None:
        self._stop("_body_timer")

    def _body_late(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        self.logger.warning("request body not received within %g s of its headers: connection "
                            "closed", self.body_timeout_s)
        self.transport.close()

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
        state = self.conn.their_state
        if state is h11.IDLE:  # still waiting for the end of the headers
            self._arm()
        else:
            self._disarm()
        if state is h11.SEND_BODY:  # the headers are in, the body is not
            self._arm_body()
        else:
            self._disarm_body()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's headers (uvicorn's keep-alive closes an idle one)
            if self.conn.their_state is h11.SEND_BODY:  # a pipelined request read from the buffer
                self._arm_body()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_body()
        self._stop("_write_timer")
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._disarm()
        self.transport.write(_response(
            400, "Bad Request", "the request is not valid HTTP/1.1 (its request line or headers "
            "could not be parsed); send a well-formed HTTP request"))
        self.transport.close()


def protocol_class(header_timeout_s: float, body_timeout_s: float = 30.0,
                   write_timeout_s: float = 30.0) -> type[H11Protocol]:
    """The protocol class to give uvicorn (`http=`), with these timeouts."""
    return type("PipeplanHTTP", (_Protocol,), {"header_timeout_s": header_timeout_s,
                                               "body_timeout_s": body_timeout_s,
                                               "write_timeout_s": write_timeout_s})
