"""dtype=auto per machine: float32 on CPUs, with or without native bf16 (the
packed kernels won every served workload but long prefills, on a Zen 4 and on
an AMX Xeon alike), bf16 only where no packed kernel runs."""

from __future__ import annotations

import pytest
import torch

import engine.model_runner as mr

CPU = torch.device("cpu")


@pytest.mark.parametrize("native_bf16,kernel,want", [
    (False, True, torch.float32),      # AVX2-only: always float32
    (True, True, torch.float32),       # AVX512-BF16, with or without AMX: float32
    (True, False, torch.bfloat16),     # no packed kernel: float32 would be the slow BLAS path
    (False, False, torch.float32),
])
def test_auto_picks_per_machine(monkeypatch: pytest.MonkeyPatch, native_bf16: bool, kernel: bool,
                                want: torch.dtype) -> None:
    monkeypatch.setattr(mr, "fast_bf16", lambda: native_bf16)
    monkeypatch.setattr(mr, "load_linear_kernel", lambda: object() if kernel else None)
    assert mr.resolve_dtype("auto", CPU) == want


def test_explicit_dtypes_and_gpus_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mr, "fast_bf16", lambda: True)
    assert mr.resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert mr.resolve_dtype("float32", CPU) == torch.float32
    assert mr.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_the_engine_serves_float32_on_a_bf16_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """LLM() of any batch size on a CPU with native bf16 runs float32 (a real engine)."""
    from engine import LLM

    monkeypatch.setattr(mr, "fast_bf16", lambda: True)
    for seqs in (1, 16):
        assert LLM(max_num_seqs=seqs, num_blocks=64, num_threads=1).engine.runner.dtype == torch.float32
