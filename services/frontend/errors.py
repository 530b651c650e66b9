"""The one error mapping: validation failures, worker RPC errors -> OpenAI JSON and gRPC codes.

Every error the frontend returns is an APIError: an HTTP status, a message that
names the offending field, and the field itself (OpenAI's `param`).
"""

from __future__ import annotations

import re
from typing import Any

import grpc

_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "server_error", 504: "timeout"}
_GRPC_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
               404: grpc.StatusCode.NOT_FOUND,
               413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
               500: grpc.StatusCode.INTERNAL, 503: grpc.StatusCode.UNAVAILABLE,
               504: grpc.StatusCode.DEADLINE_EXCEEDED}
# Worker status -> frontend status.  A worker's INVALID_ARGUMENT means the frontend
# let something through that the engine refused: still the client's fault.
_FROM_WORKER = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
                grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
                grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 503,
                grpc.StatusCode.CANCELLED: 503, grpc.StatusCode.ABORTED: 503}
# Worker errors that a retry on another decode worker cannot fix.
_NOT_RETRYABLE = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                            grpc.StatusCode.NOT_FOUND})
# "field: message" (engine.vocab.sampling_params style); the field may carry indices: messages[0].content
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after  # seconds; REST sends it as Retry-After

    @property
    def type(self) -> str:
        return _ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _GRPC_CODES.get(self.status, grpc.StatusCode.INVALID_ARGUMENT
                               if self.status < 500 else grpc.StatusCode.INTERNAL)

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400; the message starts with the field's name so it reads on its own."""
    if param is not None and not message.startswith(param):
        message = f"{param}: {message}"
    return APIError(400, message, param, code)


def from_value_error(err: ValueError, param: str | None = None) -> APIError:
    """engine.vocab.sampling_params raises ValueError("field: why"); keep the field as `param`."""
    message = str(err)
    m = _FIELD_PREFIX.match(message)
    return APIError(400, message, param or (m.group(1) if m else None))


def model_not_found(model: str) -> APIError:
    return APIError(404, f"model: the model `{model}` does not exist", "model", "model_not_found")


def no_worker(role: str = "decode") -> APIError:
    return APIError(503, f"no healthy {role} worker is available; try again later", None,
                    "no_healthy_worker")


def from_worker_error(err: grpc.aio.AioRpcError) -> APIError:
    code = err.code()
    status = _FROM_WORKER.get(code, 500)
    details = err.details() or code.name
    if status == 400:
        return from_value_error(ValueError(details))
    return APIError(status, f"worker: {details}", None, code.name.lower())


def retryable(err: grpc.aio.AioRpcError) -> bool:
    return err.code() not in _NOT_RETRYABLE
