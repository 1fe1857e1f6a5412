"""Request bodies read strictly, cheapest checks first.

FastAPI on its own decodes a body with `json.loads` (which accepts `NaN`, `Infinity` and any
depth, and answers a non-UTF-8 body with an undocumented 400) and validates it in pydantic's lax
mode (`true` is accepted as the integer 1). `StrictJSONRoute` reads every JSON body first:

0. at most `app.state.max_values` JSON values and objects (`value_limits`), counted on the raw
   bytes (`count_values`), so a body of millions of tiny values is refused before it is parsed;
1. UTF-8, JSON without `NaN`/`Infinity` (nor numbers too large for a float, which read as
   infinity), at most `MAX_DEPTH` levels of nesting, no NUL
   character in any string (each a 422 `json_invalid` naming the problem);
2. size limits that cost nothing to check on the raw document (number of layers, number of
   devices of a cluster: `nodes: 1e9` is refused before anything proportional to it is built);
3. pydantic in strict mode (no booleans for numbers, no strings for numbers).

Before the body is read, the app's client check runs (`app.state.before_body`: API key, request
quota), so a client without a valid key, or over its quota, gets its 401 / 429 without the server
parsing its body (nor learning, field by field, what a valid body looks like). Parsing and
validation then run in a worker thread, not on the event loop: a few bodies of megabytes took
about a second each there, and held every other request (`/healthz` included) meanwhile.
FastAPI's own validation receives the validated model and passes it through.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool

from planner.io import DuplicateKeyError, bad_strings, unique_keys

MAX_DEPTH = 32  # a profile is 4 levels deep; extra fields may nest, but not without bound

Loc = tuple[str | int, ...]


def invalid(loc: Loc, msg: str, kind: str = "json_invalid") -> RequestValidationError:
    return RequestValidationError([{"type": kind, "loc": loc, "msg": msg}])


def _constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows; send finite numbers only")


def _finite(text: str) -> float:
    """A JSON number as a float, refused where it is too large for one: `1e400` reads as
    infinity, which was stored as null where the command line refuses the same file."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is too large for a float (it reads as infinity); "
                         "send finite numbers only")
    return value


def count_values(raw: bytes) -> tuple[int, int]:
    """At least the number of values and of objects in the JSON document `raw` (each value but
    the first follows a comma or opens a container; commas and braces inside strings count
    too, so never fewer), counted on the bytes without parsing them."""
    objects = raw.count(b"{")
    return raw.count(b",") + raw.count(b"[") + objects + 1, objects


def value_limits(max_layers: int, max_edges: int) -> tuple[int, int]:
    """The most values and objects a body may hold: a profile's layer is one object of about
    20 values, and one more of about 10 per TP degree profiled; an edge one object of 4; plus
    room for a cluster, the options and extra fields (a real 6-layer profile with 2 TP degrees:
    53 values and 3 objects a layer)."""
    return 200 * max_layers + 8 * max_edges + 100_000, 12 * max_layers + 2 * max_edges + 10_000


def depth_and_nul(doc: Any, max_depth: int = MAX_DEPTH) -> tuple[Loc, str] | None:
    """The first place where `doc` nests deeper than `max_depth` or a string (or key) holds a NUL
    character or a lone surrogate, with the reason; None if none (`planner.io.bad_strings`,
    which the command line's files are read with too)."""
    return bad_strings(doc, ("body",), max_depth)


def parse(raw: bytes) -> Any:
    """JSON from `raw`, or a RequestValidationError (422) that says what is wrong with it. A
    UTF-8 byte-order mark is ignored (RFC 8259 allows a parser to)."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise invalid(("body",), f"the body is not UTF-8 text (byte {exc.start}); send JSON "
                      "encoded as UTF-8") from None
    try:
        doc = json.loads(text, parse_constant=_constant, parse_float=_finite, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as exc:
        raise invalid(("body", exc.pos), f"JSON decode error: {exc.msg} (line {exc.lineno}, "
                      f"column {exc.colno})") from None
    except DuplicateKeyError as exc:
        raise invalid(("body",), f"{exc}; JSON keeps only the last, so send each key once") from None
    except ValueError as exc:  # NaN, Infinity, -Infinity; an integer of over 4300 digits
        if "integer string conversion" in str(exc):
            raise invalid(("body",), "the body holds an integer of thousands of digits, more than "
                          "any field takes") from None
        raise invalid(("body",), str(exc)) from None
    except RecursionError:
        raise invalid(("body",), f"JSON nested deeper than {MAX_DEPTH} levels") from None
    bad = depth_and_nul(doc)
    if bad is not None:
        raise invalid(*bad)
    return doc


def _is_json(request: Request) -> bool:
    """Whether FastAPI decodes this body as JSON: application/json or application/*+json. Not
    without a content type: FastAPI (strict_content_type) then passes the bytes on undecoded,
    and validation said only that the body was not an object."""
    ctype = request.headers.get("content-type")
    if not ctype:
        return False
    main = ctype.split(";", 1)[0].strip().lower()
    return main.startswith("application/") and (main == "application/json" or main.endswith("+json"))


Precheck = Callable[[Request, Any], None]


class StrictJSONRoute(APIRoute):
    """An APIRoute whose JSON body is parsed by `parse`, checked by the app's cheap prechecks
    (`app.state.prechecks`: body type -> function(request, raw document)) and validated
    strictly before FastAPI's own (lax) validation."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        field = self.body_field
        if field is None:
            return handler
        body_type = field.field_info.annotation
        adapter: TypeAdapter[Any] = TypeAdapter(body_type)

        def read(request: Request, raw: bytes) -> Any:
            limits = getattr(request.app.state, "max_values", None)
            if limits is not None:
                # parsed, a body of millions of small values took seconds and hundreds of MB
                # before its layers could be counted (eight at once: 6 GB)
                for n, most, what in zip(count_values(raw), limits, ("JSON values", "JSON objects"),
                                         strict=True):
                    if n > most:
                        raise invalid(("body",), f"the body holds {n} {what} or more; this server "
                                      f"reads at most {most} (from PIPEPLAN_MAX_LAYERS and "
                                      "PIPEPLAN_MAX_EDGES)", "limit")
            doc = parse(raw)
            check = getattr(request.app.state, "prechecks", {}).get(body_type)
            if check is not None:
                check(request, doc)
            try:
                return adapter.validate_python(doc, strict=True)
            except ValidationError as exc:
                raise RequestValidationError(
                    [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None

        async def strict_handler(request: Request) -> Response:
            # the client check (api.deps.before_body), whose dependency then finds it done
            gate = getattr(request.app.state, "before_body", None)
            if gate is not None:
                await gate(request)
            raw = await request.body()
            coding = request.headers.get("content-encoding", "identity").strip().lower()
            if raw and coding != "identity":
                raise invalid(("body",), f"the body is sent with Content-Encoding {coding!r}; this "
                              "server reads uncompressed JSON only: send it without that header",
                              "content_encoding")
            if raw and not _is_json(request):
                ctype = request.headers.get("content-type")
                sent = f"sent as {ctype!r}" if ctype else "sent without a Content-Type header"
                raise invalid(("body",), f"the body is {sent}; send it as JSON with the header "
                              "Content-Type: application/json", "content_type")
            if raw:
                # FastAPI reads the body from here instead of parsing it again; given the model
                # itself, its validation passes it through
                request._json = await run_in_threadpool(read, request, raw)
            return await handler(request)

        return strict_handler
