"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from shared.protocol import ErrorKind, ParameterError, RequestError


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(exc: ParameterError | str, param: str | None = None) -> APIError:
    if isinstance(exc, ParameterError):
        return APIError(400, str(exc), "invalid_request_error", exc.param)
    return APIError(400, exc, "invalid_request_error", param)


def unavailable(reason: str) -> APIError:
    return APIError(503, f"the engine is unavailable: {reason}", "service_unavailable")


def api_error(error: RequestError) -> APIError:
    """The HTTP error a request's error stands for: the one mapping from kinds to statuses."""
    if error.kind is ErrorKind.INVALID_REQUEST:
        return APIError(400, error.message, "invalid_request_error", error.param)
    if error.kind is ErrorKind.QUEUE_FULL:
        return APIError(429, error.message, "rate_limit_error", code="queue_full")
    if error.kind is ErrorKind.UNAVAILABLE:
        return unavailable(error.message)
    return APIError(500, error.message, "internal_error")
