"""python -m services.healthcheck TARGET: exit 0 when the service is healthy
(the compose health checks; the images have no curl or grpcurl).

    http://host:port/health   the frontend: HTTP 200 (a decode worker is up)
    grpc://host:port          a worker: gRPC health SERVING
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.healthcheck")
    p.add_argument("target", help="http://host:port/path or grpc://host:port")
    p.add_argument("--timeout", type=float, default=3.0)
    return p


def check(target: str, timeout: float) -> str | None:
    """None when healthy, else why not."""
    if target.startswith("grpc://"):
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            with grpc.insecure_channel(target.removeprefix("grpc://")) as ch:
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=timeout).status
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"  # type: ignore[attr-defined]
        return None if status == health_pb2.HealthCheckResponse.SERVING else f"status {status}"
    if target.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(target, timeout=timeout) as r:
                return None if r.status == 200 else f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            return f"HTTP {e.code}"
        except OSError as e:
            return str(e)
    raise ValueError(f"target: {target!r} is neither http(s):// nor grpc://")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = check(args.target, args.timeout)
    if problem is not None:
        print(f"unhealthy: {args.target}: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
