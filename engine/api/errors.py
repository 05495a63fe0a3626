"""OpenAI-style error objects: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from starlette.responses import JSONResponse

TYPE_INVALID = "invalid_request_error"
TYPE_NOT_FOUND = "not_found_error"
TYPE_AUTH = "authentication_error"
TYPE_RATE = "rate_limit_error"
TYPE_SERVER = "server_error"


class APIError(Exception):
    """A request the API refuses; becomes a JSON error with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = TYPE_INVALID, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)
