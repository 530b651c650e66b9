"""The cluster secret: every worker RPC carries it, every worker checks it.

Workers answer only the cluster (docs/ARCHITECTURE.md, trust model).  One shared token,
given as `--cluster-token` or `SPLITSERVE_CLUSTER_TOKEN`, travels as call
metadata on every call a cluster member makes to a worker (frontend -> workers,
decode -> prefill, prefill -> decode Info); a worker's server interceptor
refuses any call without it (UNAUTHENTICATED), comparing in constant time.
gRPC health stays open so that probes (compose, Kubernetes) need no secret.

Without a token configured, calls go through as before; a worker that listens
beyond loopback says so at start.  The same token keys the HMAC on Redis
registrations (services/discovery.py), so Redis cannot name a worker either.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from services.secret_env import secret_from_env

log = logging.getLogger("splitserve.cluster_auth")

ENV = "SPLITSERVE_CLUSTER_TOKEN"
FILE_ENV = "SPLITSERVE_CLUSTER_TOKEN_FILE"  # a file holding it (compose secrets: /run/secrets/...)
METADATA_KEY = "x-splitserve-cluster-token"
# Open to anyone: liveness/readiness probes carry no secret and learn only SERVING or not.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


def add_cluster_token_arg(p: argparse._ActionsContainer) -> None:
    p.add_argument("--cluster-token", default=None,
                   help=f"the secret every worker RPC carries and checks (default: ${ENV}, or the "
                        f"file ${FILE_ENV} names; none: workers accept any caller, with a warning "
                        "beyond loopback)")


def cluster_token(args: argparse.Namespace) -> str | None:
    """The token from the flag, else the environment, else the file the environment
    names; None when none is set.  An unreadable or empty file is an error, not 'no token'."""
    token = getattr(args, "cluster_token", None)
    return str(token) if token else secret_from_env(ENV)


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_matches(token: str, presented: str | bytes | None) -> bool:
    if presented is None:
        return False
    given = presented.encode() if isinstance(presented, str) else presented
    return hmac.compare_digest(token.encode(), given)


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_open(token: str | None, host: str, what: str) -> None:
    if token is None and not is_loopback(host):
        log.warning("%s listens on %s without a cluster token: anyone who reaches it can call it "
                    "(set --cluster-token or %s)", what, host, ENV)


# -- server side ---------------------------------------------------------------


class ClusterTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health's without the cluster token (UNAUTHENTICATED)."""

    def __init__(self, token: str) -> None:
        self._token = token
        self._refuse_unary = grpc.unary_unary_rpc_method_handler(_refuse)
        self._refuse_stream = grpc.unary_stream_rpc_method_handler(_refuse_streaming)
        self.num_refused = 0

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        if details.method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(details)
        presented = dict(details.invocation_metadata or ()).get(METADATA_KEY)
        if token_matches(self._token, presented):
            return await continuation(details)
        self.num_refused += 1
        handler = await continuation(details)
        if handler is not None and handler.response_streaming:
            return self._refuse_stream
        return self._refuse_unary


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        f"cluster token missing or wrong: worker RPCs need {METADATA_KEY} metadata")


async def _refuse_streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await _refuse(request, context)
    yield  # pragma: no cover - an async generator, as streaming handlers are


def server_interceptors(token: str | None) -> Sequence[grpc.aio.ServerInterceptor]:
    return [ClusterTokenInterceptor(token)] if token else []


# -- client side ---------------------------------------------------------------


def _with_token(details: Any, token: str) -> Any:
    metadata = [m for m in (details.metadata or ()) if m[0] != METADATA_KEY]
    metadata.append((METADATA_KEY, token))
    return details._replace(metadata=metadata)


# grpc.aio files each interceptor under the first kind it is an instance of, so one
# object per kind (a class of both kinds would never see a streaming call).
class _AioUnaryToken(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(_with_token(details, self._token), request)


class _AioStreamToken(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(_with_token(details, self._token), request)


class _AioBidiToken(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_stream_stream(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(_with_token(details, self._token), request_iterator)


def aio_channel(address: str, token: str | None,
                options: Sequence[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
    """A channel to a worker whose every call carries the cluster token (when there is one)."""
    interceptors: list[grpc.aio.ClientInterceptor] | None = (
        [_AioUnaryToken(token), _AioStreamToken(token), _AioBidiToken(token)] if token else None)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


class _SyncTokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(_with_token(details, self._token), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(_with_token(details, self._token), request)


def sync_channel(address: str, token: str | None) -> grpc.Channel:
    """A blocking channel (benchmarks, tests) whose calls carry the cluster token."""
    channel = grpc.insecure_channel(address)
    return grpc.intercept_channel(channel, _SyncTokenInterceptor(token)) if token else channel
