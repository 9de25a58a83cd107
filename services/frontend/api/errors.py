"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from shared.constants import QUEUE_FULL_RETRY_AFTER_S
from shared.protocol import ErrorKind, ParameterError, RequestError


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

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


def queue_full(reason: str) -> APIError:
    """429 with Retry-After, which the OpenAI SDKs honour when they retry."""
    return APIError(
        429,
        f"the server is overloaded: {reason}; retry later",
        "rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
    )


def timed_out(seconds: float | None) -> APIError:
    return APIError(
        504,
        f"the request ran longer than its timeout ({seconds:g} s)",
        "timeout_error",
        code="request_timeout",
    )


def api_error(error: RequestError) -> APIError:
    """The HTTP error a request's error stands for: the one mapping from kinds to statuses."""
    if error.kind is ErrorKind.INVALID_REQUEST:
        return APIError(400, error.message, "invalid_request_error", error.param)
    if error.kind is ErrorKind.NOT_FOUND:
        return APIError(404, error.message, "not_found_error", error.param)
    if error.kind is ErrorKind.QUEUE_FULL:
        return queue_full(error.message)
    if error.kind is ErrorKind.UNAVAILABLE:
        return unavailable(error.message)
    return APIError(500, error.message, "internal_error")
