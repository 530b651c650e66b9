"""The compiled CPU prefill attention kernel (engine/layers/csrc/paged_attention_cpu.cpp):
causal attention of a step's prompt tokens over the paged cache, against a dense
softmax(QK^T)V written out per sequence; the same bits however a prompt is
chunked or batched; keys out of every query's sight never read."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from engine.layers.attention import paged_attention
from engine.layers.cpu_attention import load_cpu_kernel
from engine.layers.kv_quant import FP8_DTYPES, dequantize, quantize
from tests.unit.test_triton_attention import LAYER, _make_step


@pytest.fixture(scope="module")
def kernel() -> ModuleType:
    k = load_cpu_kernel()
    assert k is not None, "the CPU attention kernel must build here"
    return k


def run(kernel: ModuleType, seqs: list[tuple[int, int]], block_size: int, hq: int, hkv: int, d: int,
        window: int | None = None, seed: int = 0, dtype: torch.dtype = torch.float32,
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's output, the dense reference) for prefills `seqs` of (q_len, seq_len)."""
    gen = torch.Generator().manual_seed(seed)
    q, _, _, kv_cache, meta, expected = _make_step(seqs, block_size, hq, hkv, d, gen, window)
    out = kernel.paged_prefill_attention(q.to(dtype), kv_cache.to(dtype), LAYER, meta.block_tables,
                                         meta.query_lens, meta.seq_lens_host, d ** -0.5, window or 0)
    assert out.dtype == dtype and out.shape == q.shape
    return out, expected


# Prompts with and without a cached prefix, shorter and longer than a 64-key
# block and a 96-row task, ending on and off block edges.
SEQS = [(5, 5), (64, 64), (65, 65), (200, 200), (33, 97), (1, 12), (130, 400), (2, 129)]


@pytest.mark.parametrize(("hq", "hkv"), [(9, 3), (4, 1), (2, 2), (16, 2)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_matches_the_dense_reference(kernel: ModuleType, hq: int, hkv: int, block_size: int) -> None:
    out, expected = run(kernel, SEQS, block_size, hq, hkv, 64)
    assert (out - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize(("d", "dtype", "tol"), [(32, torch.float32, 1e-4), (128, torch.float32, 1e-4),
                                                 (64, torch.bfloat16, 3e-2), (64, torch.float16, 5e-3)])
def test_head_sizes_and_dtypes(kernel: ModuleType, d: int, dtype: torch.dtype, tol: float) -> None:
    out, expected = run(kernel, SEQS, 16, 9, 3, d, dtype=dtype)
    assert (out.float() - expected).abs().max().item() < tol


@pytest.mark.parametrize("window", [1, 7, 64, 100, 1000])
def test_sliding_window_and_keys_out_of_sight_are_never_read(kernel: ModuleType, window: int) -> None:
    """Each query sees exactly its last `window` keys; keys out of every query's
    sight are NaN-poisoned and the output does not change by a bit."""
    seqs = [(40, 300), (150, 150), (3, 70)]
    gen = torch.Generator().manual_seed(window)
    q, _, _, kv_cache, meta, expected = _make_step(seqs, 16, 9, 3, 64, gen, window)
    out = kernel.paged_prefill_attention(q, kv_cache, LAYER, meta.block_tables, meta.query_lens,
                                         meta.seq_lens_host, 0.125, window)
    assert (out - expected).abs().max().item() < 1e-4
    for i, (q_len, seq_len) in enumerate(seqs):
        for p in range(max(0, seq_len - q_len - window + 1)):  # before the first query's window
            kv_cache[meta.block_tables[i, p // 16], LAYER, :, p % 16] = float("nan")
    again = kernel.paged_prefill_attention(q, kv_cache, LAYER, meta.block_tables, meta.query_lens,
                                           meta.seq_lens_host, 0.125, window)
    assert torch.equal(again, out)


def test_chunked_batched_or_alone_the_same_bits(kernel: ModuleType) -> None:
    """A prompt's queries come out bit for bit the same in one chunk, in chunks of
    odd sizes after a cached prefix, and beside other sequences in a step."""
    seqs = [(333, 333), (90, 90), (17, 17)]
    gen = torch.Generator().manual_seed(5)
    q, _, _, kv_cache, meta, _ = _make_step(seqs, 16, 9, 3, 64, gen)
    batch = kernel.paged_prefill_attention(q, kv_cache, LAYER, meta.block_tables, meta.query_lens,
                                           meta.seq_lens_host, 0.125)
    whole = kernel.paged_prefill_attention(q[:333], kv_cache, LAYER, meta.block_tables[:1], [333], [333],
                                           0.125)
    assert torch.equal(whole, batch[:333])
    done = 0
    for chunk in (1, 37, 100, 63, 132):  # 333 tokens, chunk by chunk, each after the ones before
        part = kernel.paged_prefill_attention(q[done:done + chunk], kv_cache, LAYER, meta.block_tables[:1],
                                              [chunk], [done + chunk], 0.125)
        assert torch.equal(part, whole[done:done + chunk]), (done, chunk)
        done += chunk
    assert done == 333
    third = kernel.paged_prefill_attention(q[423:], kv_cache, LAYER, meta.block_tables[2:], [17], [17], 0.125)
    assert torch.equal(third, batch[423:])


def test_the_engine_path_uses_it_and_agrees_with_the_torch_path(kernel: ModuleType) -> None:
    """paged_attention sends prefills (and the decodes beside them) through the
    kernels; the pure torch path gives the same within float32 rounding."""
    seqs = [(1, 9), (1, 40), (50, 50), (20, 77)]
    gen = torch.Generator().manual_seed(9)
    q, k_new, v_new, kv_cache, meta, expected = _make_step(seqs, 16, 9, 3, 64, gen)
    fast = paged_attention(q, k_new, v_new, kv_cache, LAYER, meta, 0.125)
    slow = paged_attention(q, k_new, v_new, kv_cache, LAYER, meta, 0.125, use_kernel=False)
    prefill_rows = kernel.paged_prefill_attention(q[2:], kv_cache, LAYER, meta.block_tables[2:],
                                                  meta.query_lens[2:], meta.seq_lens_host[2:], 0.125)
    assert torch.equal(fast[2:], prefill_rows)
    assert (fast - slow).abs().max().item() < 1e-5
    assert (fast - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize(("fmt", "tol"), [("fp8_e4m3", 0.15), ("fp8_e5m2", 0.3)])
def test_an_fp8_cache_reads_as_its_dequantized_values(kernel: ModuleType, fmt: str, tol: float) -> None:
    """An fp8 cache goes through the kernels too, decodes and prefills: the same
    as them over the cache dequantized to float32, and near the dense reference
    over the unquantized keys (fp8's own rounding apart)."""
    seqs = [(1, 30), (1, 70), (60, 60), (25, 90)]
    gen = torch.Generator().manual_seed(11)
    q, k_new, v_new, kv_cache, meta, expected = _make_step(seqs, 16, 9, 3, 64, gen)
    kv8 = quantize(kv_cache, FP8_DTYPES[fmt])
    out = paged_attention(q, k_new, v_new, kv8, LAYER, meta, 0.125)
    prefill_rows = kernel.paged_prefill_attention(q[2:], kv8, LAYER, meta.block_tables[2:],
                                                  meta.query_lens[2:], meta.seq_lens_host[2:], 0.125)
    assert torch.equal(out[2:], prefill_rows)
    wide = paged_attention(q, k_new, v_new, dequantize(kv8, torch.float32), LAYER, meta, 0.125)
    assert (out - wide).abs().max().item() < 1e-5
    err = (out - expected).abs().max().item()
    assert 0 < err < tol  # fp8 rounds the keys: not the unquantized result, but near it


def test_bad_input_is_refused(kernel: ModuleType) -> None:
    gen = torch.Generator().manual_seed(4)
    q, _, _, kv_cache, meta, _ = _make_step([(20, 20)], 16, 9, 3, 64, gen)
    call = kernel.paged_prefill_attention
    with pytest.raises(RuntimeError, match="seq_lens"):
        call(q, kv_cache, LAYER, meta.block_tables, [20], [19], 0.125)
    with pytest.raises(RuntimeError, match="sum of query_lens"):
        call(q, kv_cache, LAYER, meta.block_tables, [19], [19], 0.125)
    with pytest.raises(RuntimeError, match="too few blocks"):
        call(q, kv_cache, LAYER, meta.block_tables, [20], [60], 0.125)
    with pytest.raises(RuntimeError, match="out of range"):
        call(q, kv_cache, LAYER, torch.full_like(meta.block_tables, 10_000), [20], [20], 0.125)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        call(q[:, :8], kv_cache, LAYER, meta.block_tables, [20], [20], 0.125)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        call(q[..., :8], kv_cache[..., :8], LAYER, meta.block_tables, [20], [20], 0.125)
