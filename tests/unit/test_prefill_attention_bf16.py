"""Prompt rows attending in bfloat16 (the CPU prefill kernel's `bf16_rows`,
used under --prefill-dtype bfloat16): the scaled q, keys, values and the
softmax's p rounded to bfloat16, products summed in float32.  Against the
float32 kernel over the rounded q, keys and values (it differs by p's rounding
alone); rows past a sequence's bf16_rows bit for bit the float32 kernel's; the
same bits however a prompt is chunked or batched; keys out of sight never read."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from engine.layers.attention import paged_attention
from engine.layers.cpu_attention import attention_isa, load_cpu_kernel
from engine.layers.cpu_features import has
from engine.layers.packed_linear import leading_rows
from tests.unit.test_triton_attention import LAYER, _make_step

pytestmark = [
    pytest.mark.skipif(not has("avx512_bf16"),
                       reason="this CPU lacks AVX512-BF16 (lscpu: no avx512_bf16), which bf16_rows need"),
    pytest.mark.skipif(attention_isa() == "avx2", reason="SPLITSERVE_ATTENTION_ISA=avx2: the attention is an "
                                                         "AVX2 machine's build, without bf16_rows"),
]

SCALE = 0.125  # a power of two: q * SCALE rounded, then divided by it, is exact
SEQS = [(5, 5), (64, 64), (65, 65), (200, 200), (33, 97), (1, 12), (130, 400), (2, 129)]


@pytest.fixture(scope="module")
def kernel() -> ModuleType:
    k = load_cpu_kernel()
    assert k is not None and k.prefill_bf16_supported(), "the kernel must build with AVX512-BF16 here"
    return k


def test_amx_where_the_cpu_has_it(kernel: ModuleType) -> None:
    """On CPUs with AMX the bfloat16 rows' products run on AMX tiles (the
    tests here then check that path): the CPU's flags, not the build's luck."""
    assert kernel.prefill_amx() == (has("amx_bf16") and has("amx_tile"))


def rounded(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


def step(seqs: list[tuple[int, int]], block_size: int, hq: int, hkv: int, d: int, seed: int = 0,
         window: int | None = None):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    return _make_step(seqs, block_size, hq, hkv, d, gen, window)


@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (4, 1, 64), (2, 2, 32), (16, 2, 128), (3, 3, 48)])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16])
def test_bf16_rows_are_the_rounded_inputs_attention(kernel: ModuleType, hq: int, hkv: int, d: int,
                                                     block_size: int, cache: torch.dtype) -> None:
    q, _, _, kv, meta, _ = step(SEQS, block_size, hq, hkv, d)
    kv = kv.to(cache)
    args = (kv, LAYER, meta.block_tables, meta.query_lens, meta.seq_lens_host, SCALE, 0)
    out = kernel.paged_prefill_attention(q, *args, [n for n, _ in SEQS])
    exact = kernel.paged_prefill_attention(q, *args)
    # the float32 kernel over q, keys and values as rounded: p's rounding apart, the same
    ref = kernel.paged_prefill_attention(rounded(q * SCALE) / SCALE, rounded(kv.float()), *args[1:])
    err = (out - ref).abs().max().item()
    assert err < 5e-3, err
    assert 1e-5 < (out - exact).abs().max().item() < 5e-2  # bfloat16 arithmetic, near float32's


def test_rows_past_bf16_rows_are_the_float32_kernels_bits(kernel: ModuleType) -> None:
    seqs = [(130, 400), (64, 64), (33, 97), (7, 7)]
    q, _, _, kv, meta, _ = step(seqs, 16, 9, 3, 64, seed=3)
    args = (kv, LAYER, meta.block_tables, meta.query_lens, meta.seq_lens_host, SCALE, 0)
    lead = [100, 0, 33, 1]
    mixed = kernel.paged_prefill_attention(q, *args, lead)
    exact = kernel.paged_prefill_attention(q, *args)
    bf16 = kernel.paged_prefill_attention(q, *args, [n for n, _ in seqs])
    start = 0
    for (n, _), k in zip(seqs, lead, strict=True):
        assert torch.equal(mixed[start:start + k], bf16[start:start + k])
        assert torch.equal(mixed[start + k:start + n], exact[start + k:start + n])
        assert k == 0 or not torch.equal(mixed[start:start + k], exact[start:start + k])
        start += n
    assert torch.equal(kernel.paged_prefill_attention(q, *args, [0] * len(seqs)), exact)


@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16])
def test_chunked_batched_or_alone_the_same_bits(kernel: ModuleType, cache: torch.dtype) -> None:
    seqs = [(333, 333), (90, 90), (17, 17)]
    q, _, _, kv, meta, _ = step(seqs, 16, 9, 3, 64, seed=5)
    kv = kv.to(cache)
    call = kernel.paged_prefill_attention
    batch = call(q, kv, LAYER, meta.block_tables, meta.query_lens, meta.seq_lens_host, SCALE, 0,
                 [333, 90, 17])
    whole = call(q[:333], kv, LAYER, meta.block_tables[:1], [333], [333], SCALE, 0, [333])
    assert torch.equal(whole, batch[:333])
    done = 0
    for chunk in (1, 37, 100, 63, 132):  # chunk by chunk, each after the ones before
        part = call(q[done:done + chunk], kv, LAYER, meta.block_tables[:1], [chunk], [done + chunk], SCALE, 0,
                    [chunk])
        assert torch.equal(part, whole[done:done + chunk]), (done, chunk)
        done += chunk
    third = call(q[423:], kv, LAYER, meta.block_tables[2:], [17], [17], SCALE, 0, [17])
    assert torch.equal(third, batch[423:])


@pytest.mark.parametrize("window", [1, 7, 64, 100])
def test_sliding_window_and_keys_out_of_sight_are_never_read(kernel: ModuleType, window: int) -> None:
    seqs = [(40, 300), (150, 150), (3, 70)]
    q, _, _, kv, meta, expected = step(seqs, 16, 9, 3, 64, seed=window, window=window)
    lead = [n for n, _ in seqs]
    out = kernel.paged_prefill_attention(q, kv, LAYER, meta.block_tables, meta.query_lens,
                                         meta.seq_lens_host, SCALE, window, lead)
    assert (out - expected).abs().max().item() < 5e-2
    for i, (q_len, seq_len) in enumerate(seqs):
        for p in range(max(0, seq_len - q_len - window + 1)):  # before the first query's window
            kv[meta.block_tables[i, p // 16], LAYER, :, p % 16] = float("nan")
    again = kernel.paged_prefill_attention(q, kv, LAYER, meta.block_tables, meta.query_lens,
                                           meta.seq_lens_host, SCALE, window, lead)
    assert torch.equal(again, out)


def test_the_engine_path_passes_the_metadatas_rows(kernel: ModuleType) -> None:
    seqs = [(1, 9), (1, 40), (50, 50), (20, 77)]
    q, k_new, v_new, kv, meta, _ = step(seqs, 16, 9, 3, 64, seed=9)
    meta.bf16_rows = [0, 0, 50, 12]
    out = paged_attention(q, k_new, v_new, kv, LAYER, meta, SCALE)
    rows = kernel.paged_prefill_attention(q[2:], kv, LAYER, meta.block_tables[2:], meta.query_lens[2:],
                                          meta.seq_lens_host[2:], SCALE, 0, [50, 12])
    assert torch.equal(out[2:], rows)
    meta.bf16_rows = []
    assert not torch.equal(paged_attention(q, k_new, v_new, kv, LAYER, meta, SCALE)[2:], rows)


def test_bad_bf16_rows_are_refused(kernel: ModuleType) -> None:
    q, _, _, kv, meta, _ = step([(20, 20), (5, 30)], 16, 9, 3, 64, seed=4)
    args = (kv, LAYER, meta.block_tables, [20, 5], [20, 30], SCALE, 0)
    call = kernel.paged_prefill_attention
    with pytest.raises(RuntimeError, match="bf16_rows: one entry per sequence"):
        call(q, *args, [20])
    with pytest.raises(RuntimeError, match="bf16_rows: each 0 .. its query_lens"):
        call(q, *args, [20, 6])
    with pytest.raises(RuntimeError, match="bf16_rows: each 0 .. its query_lens"):
        call(q, *args, [-1, 0])
    with pytest.raises(RuntimeError, match="bf16_rows: bfloat16 attention needs float32 queries"):
        call(q.bfloat16(), kv.bfloat16(), *args[1:], [20, 5])


def test_leading_rows() -> None:
    assert leading_rows((), [3, 4]) == [0, 0]
    # two decodes, a chunk of 30 whose first 20 are prompt tokens, a prompt chunk of 8
    runs = ((0, 2, False), (2, 22, True), (22, 32, False), (32, 40, True))
    assert leading_rows(runs, [1, 1, 30, 8]) == [0, 0, 20, 8]
    # neighbours merged into one run across sequences
    assert leading_rows(((0, 8, True),), [5, 3]) == [5, 3]
    assert leading_rows(((0, 2, False), (2, 42, True)), [1, 1, 40]) == [0, 0, 40]
