"""What every message is made of: the base Struct, the protocol version, and the errors and
finish reasons that requests carry."""

from __future__ import annotations

import enum

import msgspec

PROTOCOL_VERSION = 22


class Message(msgspec.Struct, gc=False):
    """The base of every message. NOTE: messages hold primitives, lists, dicts and other
    messages, never a reference back to themselves, so they cannot form a cycle; untracked by
    the garbage collector, the thousands the engine makes each step cost it nothing."""


class ParameterError(ValueError):
    """A request parameter is invalid; `param` names it (OpenAI's error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message


class NotFoundError(ParameterError):
    """A request names something the server does not have (a model, a LoRA adapter)."""


def require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParameterError(param, message)


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queued-requests; the client should retry later."""


class ErrorKind(enum.StrEnum):
    """Why a request failed. The HTTP edge maps each kind to one status code."""

    INVALID_REQUEST = "invalid_request"  # the client's: a bad parameter or prompt (400)
    NOT_FOUND = "not_found"  # the client's: it names a model or adapter the server lacks (404)
    QUEUE_FULL = "queue_full"  # the waiting queue is full: retry later (429)
    UNAVAILABLE = "unavailable"  # the engine is starting, draining, or lost a component (503)
    INTERNAL = "internal"  # a fault in kvflow or the device (500)


class RequestError(Message, kw_only=True):
    """One request's error, as every message that can carry one nests it."""

    kind: ErrorKind
    message: str
    param: str | None = None  # the invalid request parameter, for INVALID_REQUEST

    @classmethod
    def of(cls, exc: Exception) -> RequestError:
        """The error an exception raised while handling a request stands for."""
        if isinstance(exc, NotFoundError):
            return cls(kind=ErrorKind.NOT_FOUND, message=str(exc), param=exc.param)
        if isinstance(exc, ParameterError):
            return cls(kind=ErrorKind.INVALID_REQUEST, message=str(exc), param=exc.param)
        if isinstance(exc, QueueFullError):
            return cls(kind=ErrorKind.QUEUE_FULL, message=str(exc))
        return cls(kind=ErrorKind.INTERNAL, message=f"{type(exc).__name__}: {exc}")

    @classmethod
    def unavailable(cls, reason: str) -> RequestError:
        return cls(kind=ErrorKind.UNAVAILABLE, message=reason)


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
