"""The generated protobuf modules match their .proto: codegen is a build step,
so an edited .proto without `python -m protos.codegen` is caught here."""

from __future__ import annotations

from protos import codegen


def test_generated_code_is_not_older_than_the_proto() -> None:
    assert not codegen.stale(), "run `python -m protos.codegen`"
