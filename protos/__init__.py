"""gRPC messages and services of splitserve.v1 (generated from splitserve.proto)."""

from protos import codegen as _codegen

if _codegen.stale():
    _codegen.generate()

from protos import splitserve_pb2 as pb  # noqa: E402
from protos import splitserve_pb2_grpc as pb_grpc  # noqa: E402

__all__ = ["pb", "pb_grpc"]
