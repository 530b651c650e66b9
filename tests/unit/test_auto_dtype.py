"""dtype=auto per machine: float32 unless bf16 is native; with AVX512-BF16
alone float32 still (the packed kernels won every served workload but long
prefills on a Zen 4); with AMX bf16 for engines batching many sequences (few
streams decode faster in float32 on the packed kernels)."""

from __future__ import annotations

import pytest
import torch

import engine.model_runner as mr

CPU = torch.device("cpu")


@pytest.mark.parametrize("native_bf16,amx,max_num_seqs,kernel,want", [
    (False, False, 1, True, torch.float32),      # AVX2-only: always float32
    (False, False, 256, True, torch.float32),
    (True, False, 1, True, torch.float32),       # AVX512-BF16 without AMX: float32 at every size
    (True, False, 256, True, torch.float32),
    (True, False, None, True, torch.float32),
    (True, True, 1, True, torch.float32),        # AMX, one stream: the packed float32 path
    (True, True, mr.AUTO_FLOAT32_MAX_SEQS, True, torch.float32),
    (True, True, mr.AUTO_FLOAT32_MAX_SEQS + 1, True, torch.bfloat16),  # AMX, big batches: bf16
    (True, True, None, True, torch.bfloat16),
    (True, False, 1, False, torch.bfloat16),     # no packed kernel: float32 would be the slow BLAS path
])
def test_auto_picks_per_machine_and_batch(monkeypatch: pytest.MonkeyPatch, native_bf16: bool, amx: bool,
                                          max_num_seqs: int | None, kernel: bool, want: torch.dtype) -> None:
    monkeypatch.setattr(mr, "fast_bf16", lambda: native_bf16)
    monkeypatch.setattr(mr, "amx_bf16", lambda: amx)
    monkeypatch.setattr(mr, "load_linear_kernel", lambda: object() if kernel else None)
    assert mr.resolve_dtype("auto", CPU, max_num_seqs) == want


def test_explicit_dtypes_and_gpus_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mr, "fast_bf16", lambda: True)
    assert mr.resolve_dtype("bfloat16", CPU, 1) == torch.bfloat16
    assert mr.resolve_dtype("float32", CPU, 256) == torch.float32
    assert mr.resolve_dtype("auto", torch.device("cuda"), 1) == torch.bfloat16


def test_the_engine_passes_its_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """LLM(max_num_seqs=1) on an AMX CPU runs float32 (a real engine)."""
    from engine import LLM

    monkeypatch.setattr(mr, "fast_bf16", lambda: True)
    monkeypatch.setattr(mr, "amx_bf16", lambda: True)
    assert LLM(max_num_seqs=1, num_blocks=64, num_threads=1).engine.runner.dtype == torch.float32
    assert LLM(max_num_seqs=16, num_blocks=64, num_threads=1).engine.runner.dtype == torch.bfloat16
