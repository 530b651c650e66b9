import grpc
import pytest

from services.frontend import errors
from services.frontend.errors import APIError


class FakeRpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_openai_json_shape() -> None:
    e = errors.bad_request("must be >= 1", "n")
    assert e.to_json() == {"error": {"message": "n: must be >= 1", "type": "invalid_request_error",
                                     "param": "n", "code": None}}
    assert e.grpc_code == grpc.StatusCode.INVALID_ARGUMENT


def test_value_error_keeps_the_field() -> None:
    e = errors.from_value_error(ValueError("top_p: must be in (0, 1], got 2"))
    assert (e.status, e.param) == (400, "top_p")
    assert errors.from_value_error(ValueError("messages[0].content: bad")).param == "messages[0].content"
    assert errors.from_value_error(ValueError("no field here")).param is None


@pytest.mark.parametrize(("status", "code"), [
    (400, grpc.StatusCode.INVALID_ARGUMENT), (404, grpc.StatusCode.NOT_FOUND),
    (413, grpc.StatusCode.RESOURCE_EXHAUSTED), (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (503, grpc.StatusCode.UNAVAILABLE), (500, grpc.StatusCode.INTERNAL),
])
def test_http_to_grpc(status: int, code: grpc.StatusCode) -> None:
    assert APIError(status, "x").grpc_code == code


def test_model_not_found_and_no_worker() -> None:
    e = errors.model_not_found("gpt-9")
    assert (e.status, e.param, e.code) == (404, "model", "model_not_found")
    assert errors.no_worker().status == 503


@pytest.mark.parametrize(("code", "status", "retry"), [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, False), (grpc.StatusCode.NOT_FOUND, 404, False),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, True), (grpc.StatusCode.UNAVAILABLE, 503, True),
    (grpc.StatusCode.INTERNAL, 500, True),
])
def test_worker_errors(code: grpc.StatusCode, status: int, retry: bool) -> None:
    err = FakeRpcError(code, "max_tokens: too many")
    e = errors.from_worker_error(err)
    assert e.status == status and errors.retryable(err) is retry
    if status == 400:
        assert e.param == "max_tokens"
