"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from shared.protocol import ParameterError


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
