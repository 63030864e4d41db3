"""``GET /openapi.json``: the reconciler's API (``reconciler.server``), described.

Written by hand from the handlers (the answers are plain dictionaries, not models), and kept
honest by fuzzing the live reconciler from it (``tests/test_reconciler_api_fuzz.py``,
schemathesis): every answer must carry a status listed here and match its schema. Routes that
need the bearer token when one is configured (the wake always; claims and routes with
``--auth-reads``) list a 401; ``/healthz`` and ``/metrics`` are always open.
"""

from __future__ import annotations

from typing import Any

_ERROR = {"type": "object", "required": ["status", "message"],
          "properties": {"status": {"const": "error"}, "message": {"type": "string"}}}
_ROUTE = {"type": "object",
          "required": ["model", "claim", "agent", "host", "port", "state", "reason"],
          "properties": {"model": {"type": "string"}, "claim": {"type": "string"},
                         "agent": {"type": "string"}, "host": {"type": "string"},
                         "port": {"type": "integer"},
                         "state": {"enum": ["active", "sleeping", "activating", "failed"]},
                         "reason": {"type": "string"}, "wakeByRequest": {"type": "boolean"},
                         "wakeRequested": {"type": "boolean"}}}
_CLAIM = {"type": "object", "required": ["metadata", "spec", "status"],
          "properties": {"metadata": {"type": "object"}, "spec": {"type": "object"},
                         "status": {"type": "object"}, "events": {"type": "array"},
                         "route": {"anyOf": [{"$ref": "#/components/schemas/Route"},
                                             {"type": "null"}]}}}
_CLAIMS = {"type": "object", "required": ["items", "problems"],
           "properties": {"items": {"type": "array",
                                    "items": {"$ref": "#/components/schemas/Claim"}},
                          "problems": {"type": "array", "items": {"type": "object"}}}}
_ROUTES = {"type": "object", "required": ["routes"],
           "properties": {"routes": {"type": "array",
                                     "items": {"$ref": "#/components/schemas/Route"}}}}
_MODEL_ROUTES = {"type": "object", "required": ["items"], "properties": {"items": {
    "type": "array", "items": {"type": "object", "required": ["name", "candidates",
                                                               "conditions"],
                               "properties": {"name": {"type": "string"},
                                              "candidates": {"type": "array"},
                                              "conditions": {"type": "array"}}}}}}
_WAKE = {"type": "object", "required": ["status", "model", "claim", "new"],
         "properties": {"status": {"enum": ["accepted", "success"]},
                        "model": {"type": "string"}, "claim": {"type": "string"},
                        "new": {"type": "boolean"}, "requests": {"type": "integer"},
                        "message": {"type": "string"}}}


def _json(schema: str, what: str) -> dict[str, Any]:
    return {"description": what,
            "content": {"application/json": {"schema": {"$ref":
                                                        f"#/components/schemas/{schema}"}}}}


def _refused(*statuses: int) -> dict[str, Any]:
    return {str(s): _json("Error", "refused; the message says what to fix") for s in statuses}


def _path_param(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True,
            "schema": {"type": "string", "minLength": 1}}


_CLOSED: list[dict[str, list[str]]] = [{"bearer": []}, {}]  # the token when one is configured


def openapi_document() -> dict[str, Any]:
    health = {"type": "object", "required": ["status"],
              "properties": {"status": {"const": "ok"}}}
    paths: dict[str, Any] = {
        "/healthz": {"get": {"operationId": "healthz", "summary": "the reconciler answers",
                             "responses": {"200": _json("Health", "ok")}}},
        "/metrics": {"get": {"operationId": "metrics", "summary": "Prometheus exposition",
                             "responses": {"200": {"description": "the exposition", "content": {
                                 "text/plain": {"schema": {"type": "string"}}}}}}},
        "/v1/claims": {"get": {"operationId": "claims", "summary": "every claim's status",
                               "security": _CLOSED,
                               "responses": {"200": _json("Claims", "the claims"),
                                             **_refused(401)}}},
        "/v1/claims/{namespace}/{name}": {"get": {
            "operationId": "claim", "summary": "one claim", "security": _CLOSED,
            "parameters": [_path_param("namespace"), _path_param("name")],
            "responses": {"200": _json("Claim", "the claim"), **_refused(401, 404)}}},
        "/v1/routes": {"get": {"operationId": "routes", "summary": "where each model serves",
                               "security": _CLOSED,
                               "responses": {"200": _json("Routes", "the route table"),
                                             **_refused(401)}}},
        "/v1/modelroutes": {"get": {
            "operationId": "modelroutes", "security": _CLOSED,
            "summary": "each ModelRoute's candidates in order, FailedScheduling on no match",
            "responses": {"200": _json("ModelRoutes", "the routes"), **_refused(401)}}},
        "/openapi.json": {"get": {"operationId": "openapi", "summary": "this document",
                                  "responses": {"200": {"description": "OpenAPI 3.1",
                                                        "content": {"application/json": {
                                                            "schema": {"type": "object"}}}}}}},
        "/v1/routes/{model}/wake": {"post": {
            "operationId": "wake", "summary": "ask for a sleeping model to be woken",
            "security": _CLOSED, "parameters": [_path_param("model")],
            "responses": {"200": _json("Wake", "the model serves already"),
                          "202": _json("Wake", "the wake is recorded"),
                          **_refused(401, 404)}}},
    }
    return {"openapi": "3.1.0",
            "info": {"title": "ModelClaim reconciler", "version": "1",
                     "description": "Claims, routes and wake requests of the warm-pool "
                     "reconciler (port 8081)."},
            "paths": paths,
            "components": {"schemas": {"Error": _ERROR, "Health": health, "Route": _ROUTE,
                                       "Claim": _CLAIM, "Claims": _CLAIMS, "Wake": _WAKE,
                           "Routes": _ROUTES, "ModelRoutes": _MODEL_ROUTES},
                           "securitySchemes": {"bearer": {"type": "http",
                                                          "scheme": "bearer"}}}}
