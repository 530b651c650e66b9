"""gRPC messages and services of splitserve.v1, generated from splitserve.proto
by the one codegen step, `python -m protos.codegen` (scripts/setup.sh and the
Dockerfile run it; importing this package generates nothing).

`pb` and `pb_grpc` load on first use, so that the codegen step itself (a module
of this package) runs before they exist."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protos import splitserve_pb2 as pb
    from protos import splitserve_pb2_grpc as pb_grpc
else:
    _GENERATED = {"pb": "splitserve_pb2", "pb_grpc": "splitserve_pb2_grpc"}

    def __getattr__(name: str):
        if name not in _GENERATED:
            raise AttributeError(f"module 'protos' has no attribute {name!r}")
        import importlib

        try:
            module = importlib.import_module(f"protos.{_GENERATED[name]}")
        except ImportError as e:  # a fresh checkout before setup
            raise ImportError("protos: the generated modules are missing; "
                              "run `python -m protos.codegen`") from e
        globals()[name] = module
        return module

__all__ = ["pb", "pb_grpc"]
