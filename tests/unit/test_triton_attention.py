"""The Triton paged-attention kernel (run by the Triton interpreter on CPUs)
against the torch path and a dense softmax(QK^T)V written out per sequence."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.layers import triton_attention
from engine.layers.attention import AttentionMetadata, paged_attention, write_kv
from engine.layers.triton_attention import triton_paged_attention

pytest.importorskip("triton")  # conftest has chosen the interpreter on CPU-only machines

# On a GPU machine the kernel runs compiled on the GPU; elsewhere, interpreted.
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_LAYERS, LAYER = 2, 1  # write to a layer other than 0 so layer strides matter
# (q_len, seq_len), decodes first.  Prefills with and without a cached prefix,
# lengths off block boundaries, and a 1-token prefill chunk after a long prefix.
MIXED_BATCH = [(1, 1), (1, 7), (1, 17), (1, 40),
               (5, 5), (13, 13), (3, 20), (9, 41), (1, 12)]


@pytest.fixture(scope="module", params=["native", "avx2"])
def decode_kernel(request):  # type: ignore[no-untyped-def]
    """The CPU attention kernels as the engine builds them (-march=native) and,
    on a CPU with AVX-512, built for AVX2 too (x86-64-v3): the code the AVX2
    machines run (8-wide vectors, their own score sums) is checked here as well."""
    from engine.layers.cpu_attention import build_avx2_kernel, load_cpu_kernel
    from engine.layers.cpu_features import cpuinfo

    if request.param == "native":
        kernel = load_cpu_kernel()
    else:
        if "avx512f" not in cpuinfo()[1]:
            pytest.skip("no AVX-512 here: the native build is the AVX2 one")
        kernel = build_avx2_kernel()
    assert kernel is not None
    return kernel


def rows_reading_the_cache(seqs: list[tuple[int, int]], meta: AttentionMetadata) -> torch.Tensor:
    """[T] bool: the query rows that read every key from the cache.  A prefill
    without a cached prefix attends to this step's keys as computed on the
    torch path, not as a rounding cache stores them."""
    rows = torch.ones(int(meta.query_start_loc[-1]), dtype=torch.bool)
    starts = meta.query_start_loc.tolist()
    for i, (q_len, seq_len) in enumerate(seqs):
        if q_len == seq_len and q_len > 1:
            rows[starts[i]:starts[i + 1]] = False
    return rows


def _causal_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  window: int | None = None) -> torch.Tensor:
    """q: [q_len, Hq, D]; k, v: [seq_len, Hkv, D] -> [q_len, Hq, D].  The queries
    are the last q_len positions; with a window each sees its last `window` keys."""
    q_len, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len)
    k_pos = torch.arange(seq_len)[None, :]
    visible = k_pos <= q_pos[:, None]  # [q_len, seq_len]
    if window is not None:
        visible &= k_pos > q_pos[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _make_step(seqs: list[tuple[int, int]], block_size: int, num_q_heads: int,
               num_kv_heads: int, head_dim: int, gen: torch.Generator, window: int | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                          AttentionMetadata, torch.Tensor]:
    """A cache holding every sequence's prefix, the step's new K/V written with
    write_kv, shuffled block tables.  -> (q, k_new, v_new, kv_cache, meta, expected)."""
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay garbage
    # Garbage everywhere, so a read outside a sequence's keys shows up.
    kv_cache = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim,
                           generator=gen)
    block_ids = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32)
    scale = head_dim ** -0.5
    qs, k_news, v_news, slots, expected = [], [], [], [], []
    for i, ((q_len, seq_len), nb) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
        table = [block_ids.pop() for _ in range(nb)]
        block_tables[i, :nb] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        q = torch.randn(q_len, num_q_heads, head_dim, generator=gen)
        pos_slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                                  for p in range(seq_len)])
        prefix = seq_len - q_len
        write_kv(kv_cache, LAYER, k[:prefix], v[:prefix], pos_slots[:prefix])  # "cached" earlier
        qs.append(q)
        k_news.append(k[prefix:])
        v_news.append(v[prefix:])
        slots.append(pos_slots[prefix:])
        expected.append(_causal_dense(q, k, v, scale, window))
    k_new, v_new, slot_mapping = torch.cat(k_news), torch.cat(v_news), torch.cat(slots)
    write_kv(kv_cache, LAYER, k_new, v_new, slot_mapping)
    query_lens = [q_len for q_len, _ in seqs]
    seq_lens = [seq_len for _, seq_len in seqs]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()],
                                     dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        query_lens=query_lens,
        seq_lens_host=seq_lens,
        num_decodes=next((i for i, q_len in enumerate(query_lens) if q_len > 1), len(seqs)),
    )
    return torch.cat(qs), k_new, v_new, kv_cache, meta, torch.cat(expected)


def triton_on_kernel_device(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                            scale: float, window: int | None = None) -> torch.Tensor:
    """The Triton kernel over a step built on the CPU, run where it compiles
    (the GPU when there is one, else the interpreter); the answer on the CPU."""
    on_device = dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(KERNEL_DEVICE)
                                             for f in dataclasses.fields(meta)
                                             if isinstance(getattr(meta, f.name), torch.Tensor)})
    return triton_paged_attention(q.to(KERNEL_DEVICE), kv_cache.to(KERNEL_DEVICE), LAYER,
                                  on_device, scale, window).cpu()


def _check(seqs: list[tuple[int, int]], block_size: int, num_q_heads: int,
           num_kv_heads: int, head_dim: int, window: int | None = None) -> None:
    gen = torch.Generator().manual_seed(block_size * 1000 + num_q_heads * 10 + num_kv_heads)
    q, k_new, v_new, kv_cache, meta, expected = _make_step(
        seqs, block_size, num_q_heads, num_kv_heads, head_dim, gen, window)
    scale = head_dim ** -0.5
    torch_out = paged_attention(q, k_new, v_new, kv_cache, LAYER, meta, scale, window=window)
    pure_torch_out = paged_attention(q, k_new, v_new, kv_cache, LAYER, meta, scale, use_kernel=False,
                                     window=window)
    triton_out = triton_on_kernel_device(q, kv_cache, meta, scale, window)
    assert triton_out.shape == q.shape
    assert (torch_out - expected).abs().max().item() < 1e-3
    assert (pure_torch_out - expected).abs().max().item() < 1e-3
    assert (triton_out - expected).abs().max().item() < 1e-3
    assert (triton_out - torch_out).abs().max().item() < 1e-3


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(9, 3), (4, 1), (2, 2)])
def test_mixed_batch_matches_torch_and_dense(block_size: int, num_q_heads: int,
                                             num_kv_heads: int) -> None:
    _check(MIXED_BATCH, block_size, num_q_heads, num_kv_heads, head_dim=64)


@pytest.mark.parametrize("block_size", [8, 32])
def test_head_dim_32(block_size: int) -> None:
    _check(MIXED_BATCH, block_size, num_q_heads=9, num_kv_heads=3, head_dim=32)


def test_decodes_only() -> None:
    _check([(1, 3), (1, 16), (1, 29)], block_size=16, num_q_heads=9, num_kv_heads=3,
           head_dim=64)


def test_prefills_only() -> None:
    _check([(7, 7), (20, 37)], block_size=8, num_q_heads=9, num_kv_heads=3, head_dim=64)


@pytest.mark.parametrize(("block_size", "window"), [(8, 1), (8, 6), (16, 16), (32, 20), (16, 100)])
def test_sliding_window_matches_dense(block_size: int, window: int) -> None:
    """Windows shorter than a block, a block, a tile, and longer than every
    sequence (no effect), over decodes and prefills with and without a prefix:
    the CPU kernel, the torch path and Triton each mask exactly the keys the
    dense reference drops."""
    _check(MIXED_BATCH + [(30, 30), (25, 60)], block_size, num_q_heads=9, num_kv_heads=3,
           head_dim=64, window=window)


def test_missing_triton_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_attention, "triton", None)
    q, _, _, kv_cache, meta, _ = _make_step([(1, 4)], 8, 2, 1, 32, torch.Generator())
    with pytest.raises(RuntimeError, match="needs the `triton` package"):
        triton_paged_attention(q, kv_cache, LAYER, meta, 1.0)


def test_cpu_decode_kernel_builds_and_matches(decode_kernel) -> None:  # type: ignore[no-untyped-def]
    """The compiled CPU decode kernel is what the engine uses on CPUs; it must
    build here and agree with the dense reference in every dtype."""
    kernel = decode_kernel
    seqs = [(1, 1), (1, 17), (1, 40), (1, 33)]
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        gen = torch.Generator().manual_seed(7)
        q, k_new, v_new, kv_cache, meta, expected = _make_step(seqs, 16, 9, 3, 64, gen)
        out = kernel.paged_decode_attention(q.to(dtype), kv_cache.to(dtype), LAYER,
                                            meta.block_tables, meta.seq_lens, 64 ** -0.5)
        assert (out.float() - expected).abs().max().item() < tol


@pytest.mark.parametrize(("block_size", "head_dim"), [(16, 64), (24, 64), (16, 32), (8, 128)])
def test_cpu_decode_kernel_long_sequences(decode_kernel, block_size: int, head_dim: int) -> None:  # type: ignore[no-untyped-def]
    """Sequences of several 128-position spans (merged after), spans ending inside
    a block (block size 24), the any-head-size path (32), every float dtype."""
    kernel = decode_kernel
    seqs = [(1, 128), (1, 129), (1, 300), (1, 2), (1, 513)]
    gen = torch.Generator().manual_seed(block_size + head_dim)
    q, _, _, kv_cache, meta, expected = _make_step(seqs, block_size, 9, 3, head_dim, gen)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)):
        out = kernel.paged_decode_attention(q.to(dtype), kv_cache.to(dtype), LAYER,
                                            meta.block_tables, meta.seq_lens, head_dim ** -0.5)
        assert out.dtype == dtype
        assert (out.float() - expected).abs().max().item() < tol, dtype


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_decode_kernel_shared_kv_heads_change_no_bit(decode_kernel, dtype: torch.dtype,  # type: ignore[no-untyped-def]
                                                         head_dim: int) -> None:
    """The query heads that share a KV head read its rows once, together (in
    twos, threes or fours by head size): each head's output is bit for bit what
    it is when every head has a KV head of its own (the cache's heads copied)."""
    kernel = decode_kernel
    seqs = [(1, 1), (1, 17), (1, 40), (1, 300)]
    gen = torch.Generator().manual_seed(head_dim)
    q, _, _, kv_cache, meta, _ = _make_step(seqs, 16, 9, 3, head_dim, gen)
    q, kv_cache = q.to(dtype), kv_cache.to(dtype)
    args = (meta.block_tables, meta.seq_lens, head_dim ** -0.5)
    shared = kernel.paged_decode_attention(q, kv_cache, LAYER, *args)
    own = kernel.paged_decode_attention(q, kv_cache.repeat_interleave(3, dim=4).contiguous(), LAYER, *args)
    assert torch.equal(shared, own)


@pytest.mark.parametrize("window", [1, 127, 128, 200, 600])
def test_cpu_decode_kernel_sliding_window(decode_kernel, window: int) -> None:  # type: ignore[no-untyped-def]
    """Windows that start inside a 128-position span, on a span's edge, and
    beyond the sequence's start: every sequence sees exactly its last `window`
    keys, and the masked span is never read (so garbage there cannot leak)."""
    kernel = decode_kernel
    seqs = [(1, 128), (1, 129), (1, 300), (1, 2), (1, 513)]
    gen = torch.Generator().manual_seed(window)
    q, _, _, kv_cache, meta, expected = _make_step(seqs, 16, 9, 3, 64, gen, window)
    out = kernel.paged_decode_attention(q, kv_cache, LAYER, meta.block_tables, meta.seq_lens,
                                        64 ** -0.5, window)
    assert (out - expected).abs().max().item() < 1e-4
    for i, (_, seq_len) in enumerate(seqs):  # poison every key out of sight: nothing changes
        for p in range(max(0, seq_len - window)):
            kv_cache[meta.block_tables[i, p // 16], LAYER, :, p % 16] = float("nan")
    again = kernel.paged_decode_attention(q, kv_cache, LAYER, meta.block_tables, meta.seq_lens,
                                          64 ** -0.5, window)
    assert torch.equal(again, out)


def test_cpu_decode_kernel_is_batch_invariant(decode_kernel) -> None:  # type: ignore[no-untyped-def]
    """A sequence's output is bit for bit the same alone as in any batch: its sums
    are cut at fixed positions, never by how many sequences share the step."""
    kernel = decode_kernel
    seqs = [(1, n) for n in (700, 5, 130, 64, 256, 1, 400, 90)]
    gen = torch.Generator().manual_seed(3)
    q, _, _, kv_cache, meta, _ = _make_step(seqs, 16, 9, 3, 64, gen)
    batch = kernel.paged_decode_attention(q, kv_cache, LAYER, meta.block_tables, meta.seq_lens, 0.125)
    for i in range(len(seqs)):
        alone = kernel.paged_decode_attention(q[i:i + 1], kv_cache, LAYER, meta.block_tables[i:i + 1],
                                              meta.seq_lens[i:i + 1], 0.125)
        assert torch.equal(alone, batch[i:i + 1]), i
    pair = kernel.paged_decode_attention(q[2:4], kv_cache, LAYER, meta.block_tables[2:4],
                                         meta.seq_lens[2:4], 0.125)
    assert torch.equal(pair, batch[2:4])


def test_cpu_decode_kernel_rejects_bad_input() -> None:
    from engine.layers.cpu_attention import load_cpu_kernel

    kernel = load_cpu_kernel()
    assert kernel is not None
    gen = torch.Generator().manual_seed(4)
    q, _, _, kv_cache, meta, _ = _make_step([(1, 20)], 16, 9, 3, 64, gen)
    with pytest.raises(RuntimeError, match="seq_lens"):
        kernel.paged_decode_attention(q, kv_cache, LAYER, meta.block_tables,
                                      torch.zeros(1, dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        kernel.paged_decode_attention(q[:, :8], kv_cache, LAYER, meta.block_tables, meta.seq_lens, 0.125)


@pytest.fixture()
def fresh_cpu_kernel():  # type: ignore[no-untyped-def]
    """load_cpu_kernel with its cache cleared before and after (it reads the environment once)."""
    from engine.layers.cpu_attention import load_cpu_kernel

    load_cpu_kernel.cache_clear()
    yield load_cpu_kernel
    load_cpu_kernel.cache_clear()


def test_attention_isa_override_runs_the_avx2_build(fresh_cpu_kernel,  # type: ignore[no-untyped-def]
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """SPLITSERVE_ATTENTION_ISA=avx2 on an AVX-512 CPU: the engine's attention
    is the AVX2 machines' build (the one decode_kernel's "avx2" case checks),
    not the native one, and it computes the step's attention."""
    from engine.layers.cpu_features import cpuinfo

    if "avx512f" not in cpuinfo()[1]:
        pytest.skip("no AVX-512 here: the native build is the AVX2 one")
    monkeypatch.delenv("SPLITSERVE_ATTENTION_ISA", raising=False)  # a suite run whole under the override
    native = fresh_cpu_kernel()
    fresh_cpu_kernel.cache_clear()
    monkeypatch.setenv("SPLITSERVE_ATTENTION_ISA", "avx2")
    kernel = fresh_cpu_kernel()
    assert kernel is not None and native is not None
    assert "splitserve_paged_attention_avx2" in kernel.__file__ and kernel.__file__ != native.__file__
    gen = torch.Generator().manual_seed(5)
    q, _, _, kv_cache, meta, expected = _make_step([(1, 40), (1, 300)], 16, 9, 3, 64, gen)
    out = kernel.paged_decode_attention(q, kv_cache, LAYER, meta.block_tables, meta.seq_lens, 64 ** -0.5)
    assert (out - expected).abs().max().item() < 1e-4


def test_attention_isa_override_refuses_unknown_sets(fresh_cpu_kernel,  # type: ignore[no-untyped-def]
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_ATTENTION_ISA", "avx9")
    with pytest.raises(ValueError, match="SPLITSERVE_ATTENTION_ISA=avx9: not one of native, avx2"):
        fresh_cpu_kernel()
