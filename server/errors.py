"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

Handlers installed by `install_error_handlers` turn request-validation errors (pydantic's, and
malformed JSON) into 400s naming the field, HTTP errors (unknown route, wrong method) into the same
shape, and anything unexpected into a 500 whose message holds no traceback.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("fuselm.server")


class APIError(Exception):
    """A request the server refuses or cannot answer: its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        """The JSON body OpenAI's clients parse."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The error as an HTTP response."""
        return JSONResponse(self.body(), status_code=self.status)


def field_path(loc: tuple) -> str | None:
    """A pydantic error location as the request's field, e.g. ("body", "messages", 0, "content") ->
    "messages[0].content"; None for the body as a whole."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path or None


def validation_error(error: dict) -> APIError:
    """One pydantic error as a 400 naming its field."""
    param, kind = field_path(tuple(error.get("loc", ()))), error.get("type")
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({error.get('ctx', {}).get('error', 'parse error')})")
    if param is None and kind == "missing":
        return APIError(400, "the request has no JSON body (send one with Content-Type: application/json)")
    if param is None:
        return APIError(400, "the request body must be a JSON object")
    if kind == "extra_forbidden":
        return APIError(400, f"{param}: unrecognized or unsupported request field", param)
    if kind == "missing":
        return APIError(400, f"{param} is required", param)
    message = error.get("msg", "invalid value").removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}", param)


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    return validation_error(errors[0] if errors else {}).response()


async def _on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    code = "not_found" if exc.status_code == 404 else None
    return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code).response()


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error in %s %s", request.method, request.url.path)
    return APIError(500, "internal server error", type="server_error").response()


def install_error_handlers(app: FastAPI) -> None:
    """Make every error of `app` an OpenAI-style JSON error."""
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
