"""The error a request is answered with, on its own so that every part of the server
can raise it: the API shapes (exokv.serve.api) build on the tool calling
(exokv.serve.tools), which must refuse requests too, and neither may import the other
both ways."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "invalid_request_error",
        413: "invalid_request_error",
        499: "client_closed_request",
        500: "server_error",
        503: "server_overloaded",
    }

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def doc(self) -> dict[str, Any]:
        kind = self.TYPES.get(self.status, "invalid_request_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }
