"""gRPC messages and services of splitserve.v1, generated from splitserve.proto
by the one codegen step, `python -m protos.codegen` (scripts/setup.sh and the
Dockerfile run it; importing this package generates nothing)."""

try:
    from protos import splitserve_pb2 as pb
    from protos import splitserve_pb2_grpc as pb_grpc
except ImportError as e:  # a fresh checkout before setup
    raise ImportError("protos: the generated modules are missing; run `python -m protos.codegen`") from e

__all__ = ["pb", "pb_grpc"]
