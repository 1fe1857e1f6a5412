"""The OpenAPI document, made to say exactly what the server does.

FastAPI's generated schema is completed with what the models cannot say on their own: the two
forms of a cluster (the uniform form requires `devices_per_node` and `device_memory_gb`, the
list form forbids them), this server's size limits (layers, edges, devices) as `maxItems` /
`maximum`, the error responses every `/v1` route can give (401 only when the server has API
keys, 413, 429, and 500 as JSON `ErrorOut`), and links from a created resource to the routes
that read it (for clients and for stateful testing).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from api.settings import Settings

ERROR_TEXT = {
    401: "missing or wrong API key",
    413: "request body over the size limit, or over the client's stored-bytes quota",
    429: "over the client's request quota; retry after Retry-After seconds",
    500: "a bug in the server (the detail gives the request id it was logged with)",
}

# (source path, method) -> link name -> (target method, target path, parameter, source field)
LINKS: dict[tuple[str, str], dict[str, tuple[str, str, str, str]]] = {
    ("/v1/profiles", "post"): {
        "GetProfile": ("get", "/v1/profiles/{profile_id}", "profile_id", "id"),
        "DeleteProfile": ("delete", "/v1/profiles/{profile_id}", "profile_id", "id"),
        "ListPlansOfProfile": ("get", "/v1/plans", "profile_id", "id"),
    },
    ("/v1/plans", "post"): {
        "GetPlan": ("get", "/v1/plans/{plan_id}", "plan_id", "id"),
        "GetTimelineSvg": ("get", "/v1/plans/{plan_id}/timeline.svg", "plan_id", "id"),
        "GetTimelinePng": ("get", "/v1/plans/{plan_id}/timeline.png", "plan_id", "id"),
        "GetTrace": ("get", "/v1/plans/{plan_id}/trace.json", "plan_id", "id"),
        "DeletePlan": ("delete", "/v1/plans/{plan_id}", "plan_id", "id"),
        "GetProfile": ("get", "/v1/profiles/{profile_id}", "profile_id", "profile_id"),
    },
}
JOB_LINKS = {
    "GetJob": ("get", "/v1/jobs/{job_id}", "job_id", "id"),
    "DeleteJob": ("delete", "/v1/jobs/{job_id}", "job_id", "id"),
}


def _links(doc: dict[str, Any], spec: dict[str, tuple[str, str, str, str]]) -> dict[str, Any]:
    out = {}
    for name, (method, path, param, source) in spec.items():
        op_id = doc["paths"].get(path, {}).get(method, {}).get("operationId")
        if op_id:
            out[name] = {"operationId": op_id, "parameters": {param: f"$response.body#/{source}"}}
    return out


def _schemas(doc: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    comps = doc.get("components", {}).get("schemas", {})
    return [s for name, s in comps.items() if name == prefix or name.startswith(prefix + "-")]


def _limit_cluster(schema: dict[str, Any], settings: Settings) -> None:
    props = schema.get("properties", {})
    n = settings.max_devices
    for option in props.get("nodes", {}).get("anyOf", []):
        if option.get("type") == "integer":
            option["maximum"] = n
        elif option.get("type") == "array":
            option["maxItems"] = n
    for option in [props.get("devices_per_node", {}), *props.get("devices_per_node", {}).get("anyOf", [])]:
        if option.get("type") == "integer":
            option["maximum"] = n
    schema["oneOf"] = [
        {"title": "uniform", "properties": {"nodes": {"type": "integer"}},
         "required": ["nodes", "devices_per_node", "device_memory_gb"]},
        {"title": "list of nodes", "properties": {"nodes": {"type": "array"},
                                                  "devices_per_node": {"type": "null"},
                                                  "device_memory_gb": {"type": "null"}}},
    ]


def _complete(doc: dict[str, Any], settings: Settings) -> None:
    for schema in _schemas(doc, "Cluster"):
        _limit_cluster(schema, settings)
    for schema in _schemas(doc, "NodeSpec"):
        schema.setdefault("properties", {}).get("devices", {})["maximum"] = settings.max_devices
    for schema in _schemas(doc, "Profile"):
        props = schema.get("properties", {})
        props.get("layers", {})["maxItems"] = settings.max_layers
        props.get("edges", {})["maxItems"] = settings.max_edges
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            responses = op.setdefault("responses", {})
            codes = [500]
            if path.startswith("/v1/"):
                codes += [413, 429]
                if settings.keyed:
                    codes.append(401)
            for code in codes:
                responses.setdefault(str(code), {
                    "description": ERROR_TEXT[code],
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorOut"}}}})
            if not settings.keyed:
                responses.pop("401", None)
            spec = LINKS.get((path, method))
            for status in ("200", "201"):
                if spec and status in responses:
                    responses[status]["links"] = _links(doc, spec)
            if "202" in responses:
                responses["202"]["links"] = _links(doc, JOB_LINKS)


def install(app: FastAPI, settings: Settings) -> None:
    def custom_openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description,
                              routes=app.routes)
            _complete(doc, settings)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = custom_openapi  # type: ignore[method-assign]
