"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`.

A client's mistake is a 4xx with a message that says what to fix; the server's own failure
is a 5xx. Handlers below make sure nothing leaves the app as a bare HTML/plain-text error or
as FastAPI's 422 validation format.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_MAX_VALIDATION_ERRORS_SHOWN = 4


class APIError(Exception):
    """An error to return to the client as OpenAI-style JSON with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error: the client must change the request."""
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def _default_type(status: int) -> str:
    if status == HTTPStatus.UNAUTHORIZED:
        return "authentication_error"
    if status == HTTPStatus.NOT_FOUND:
        return "not_found_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def from_validation_error(exc: RequestValidationError) -> APIError:
    """Turn FastAPI's validation error (bad JSON, wrong types, ranges) into a 400."""
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = errors[0].get("ctx", {}).get("error", "")
        return bad_request(f"The request body is not valid JSON: {detail}".rstrip(": "))
    if any(tuple(e.get("loc", ())) == ("body",) for e in errors):
        return bad_request(
            "The request body must be a JSON object (Content-Type: application/json)."
        )
    parts, param = [], None
    for err in errors[:_MAX_VALIDATION_ERRORS_SHOWN]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
    more = len(errors) - _MAX_VALIDATION_ERRORS_SHOWN
    if more > 0:
        parts.append(f"and {more} more")
    return bad_request("Invalid request: " + "; ".join(parts), param=param)


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return from_validation_error(exc).response()


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors: unknown route (404), wrong method (405)."""
    assert isinstance(exc, StarletteHTTPException)
    err = APIError(exc.status_code, str(exc.detail))
    return err.response(headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug in the server: log it with its traceback, answer a JSON 500."""
    log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    err = APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"Internal server error: {exc!r}")
    return err.response()


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app returns OpenAI-style JSON."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)


# Deeper JSON than any OpenAI request needs (a chat body is ~6 levels; tool schemas add some)
# is refused: the decoder recurses, and 1,000 levels used to end in a 500 (RecursionError).
MAX_JSON_DEPTH = 64


async def read_json_object(request: Request) -> dict[str, Any]:
    """The request's body as a JSON object, or a 400 saying what is wrong with it."""
    try:
        body = msgspec.json.decode(await request.body())
    except msgspec.DecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:  # nested deeper than the decoder goes
        raise _too_deep() from None
    if json_depth(body) > MAX_JSON_DEPTH:
        raise _too_deep()
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object")
    return body


def _too_deep() -> APIError:
    return bad_request(f"The request body is nested deeper than {MAX_JSON_DEPTH} levels")


def json_depth(value: object) -> int:
    """How deeply lists and objects nest in a decoded JSON value (a scalar is 0); walks
    iteratively, so any depth the decoder produced is measured without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return deepest
