"""Paged attention as one Triton kernel, for decodes and (prefix-cached) prefills alike.

Same semantics as `attention.paged_attention`: the step's new K/V are already in
the cache, so every key 0..seq_len-1 is read from it through the block table.

Work split: one program per (query tile, kv head).  A query tile is up to
BLOCK_Q consecutive new tokens of one sequence; its rows are the G query heads
that share the kv head, each padded to G_PAD, so the tile is a
[BLOCK_M = BLOCK_Q * G_PAD, D] matrix and every K/V element loaded serves all
of them.  Keys are visited BLOCK_N at a time (a BLOCK_N tile may span several
cache blocks when block_size < 16), with online softmax in fp32.  With a
sliding window the key loop starts at the tile's first visible key, rounded
down to BLOCK_N, and a mask drops keys older than each row's window.  A cache
in another dtype than the query's (fp8, or a float32 model's bfloat16 cache:
kv_quant.py) is widened as each K/V tile loads: to float32, times the cache's
scale (fp8's; 1 otherwise), to the query's dtype.
"""

from __future__ import annotations

import torch

from engine.layers.attention import AttentionMetadata
from engine.layers.kv_quant import KV_SCALE, is_fp8

try:
    import triton
    import triton.language as tl
except ImportError:  # the frontend and CPU-only installs run without triton
    triton = None

# tl.dot needs every dimension >= 16 on GPUs.
_MIN_DOT = 16


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, o_ptr, kv_ptr,  # q, o: [T, Hq, D]; kv: one layer, [blocks, 2, bs, Hkv, D]
        block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        tile_seq_ptr, tile_q_start_ptr,  # [num_tiles]: owning sequence, first query in it
        qk_scale,  # softmax scale * log2(e), so exp2 can be used
        window,  # > 0: keys q_pos - window + 1 .. q_pos only; 0: no window
        kv_scale,  # KV_CAST: stored value * kv_scale = the key or value
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kv_block, stride_kv_kv, stride_kv_slot, stride_kv_head,
        stride_bt,
        G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, KV_CAST: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = tl.load(tile_seq_ptr + tile)
        q_start = tl.load(tile_q_start_ptr + tile)  # index among the sequence's new tokens
        token0 = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - token0
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - q_len  # keys cached before this step

        # Row m of the tile is (query q_start + m // G_PAD, head m % G_PAD of the group).
        offs_m = tl.arange(0, BLOCK_M)
        q_idx = q_start + offs_m // G_PAD
        head = kv_head * G + offs_m % G_PAD
        row_valid = (offs_m % G_PAD < G) & (q_idx < q_len)
        q_pos = context_len + q_idx  # [BLOCK_M] absolute position, the causal limit
        offs_d = tl.arange(0, D_PAD)
        d_valid = offs_d < HEAD_DIM

        q_offs = (token0 + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        io_mask = row_valid[:, None] & d_valid[None, :]
        q = tl.load(q_ptr + q_offs, mask=io_mask, other=0.0)  # [BLOCK_M, D_PAD]

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)

        # Keys past the tile's last query are never visible to it, nor (with a
        # window) keys before its first query's window.
        kv_end = context_len + tl.minimum(q_start + BLOCK_Q, q_len)
        kv_lo = tl.where(window > 0, tl.maximum(context_len + q_start - window + 1, 0), 0)
        # Rows whose window starts later see keys below it as well: mask them.
        oldest = tl.where(window > 0, q_pos - window, -1)  # [BLOCK_M], last key out of sight
        for start_n in range((kv_lo // BLOCK_N) * BLOCK_N, kv_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_valid = offs_n < kv_end  # also keeps the block-table read in its row
            block = tl.load(block_tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE,
                            mask=n_valid, other=0).to(tl.int64)
            kv_offs = (block[:, None] * stride_kv_block
                       + (offs_n % BLOCK_SIZE)[:, None] * stride_kv_slot
                       + kv_head * stride_kv_head + offs_d[None, :])
            kv_mask = n_valid[:, None] & d_valid[None, :]
            k = tl.load(kv_ptr + kv_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
            v = tl.load(kv_ptr + stride_kv_kv + kv_offs, mask=kv_mask, other=0.0)
            if KV_CAST:  # tl.dot wants both operands in one dtype: the query's
                k = (k.to(tl.float32) * kv_scale).to(q.dtype)
                v = (v.to(tl.float32) * kv_scale).to(q.dtype)

            # ieee: fp32 caches must match the torch path, not tf32 (ignored for bf16).
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N]
            seen = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > oldest[:, None])
            s = tl.where(seen, s, float("-inf"))
            # A row may see nothing in a tile (its window starts further on): its
            # max stays -inf, and exponents are taken against 0 instead so that
            # no -inf - -inf makes a NaN.  Padded rows are never stored.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new

        out = acc / l_i[:, None]
        o_offs = (token0 + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=io_mask)


def _query_tiles(meta: AttentionMetadata, block_q: int, device: torch.device,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (tile_seq, tile_q_start): [num_tiles] int32 each.  Built on the host
    from the host copy of the query lengths (never waiting on the device), sent
    in one copy, once per step: every layer reuses them."""
    key = f"triton_tiles_{block_q}"
    tiles = meta.per_step.get(key)
    if tiles is None:
        seqs: list[int] = []
        starts: list[int] = []
        for seq, q_len in enumerate(meta.query_lens):
            for start in range(0, q_len, block_q):
                seqs.append(seq)
                starts.append(start)
        tiles = torch.tensor([seqs, starts], dtype=torch.int32).to(device, non_blocking=True)
        meta.per_step[key] = tiles
    return tiles[0], tiles[1]


def triton_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                           meta: AttentionMetadata, scale: float, window: int | None = None,
                           ) -> torch.Tensor:
    """q: [T, Hq, D]; kv_cache: [num_blocks, num_layers, 2, block_size, Hkv, D]
    holding this step's keys already.  Returns [T, Hq, D].  window: the
    sliding window (see attention.py), None for none."""
    if triton is None:
        raise RuntimeError("triton_paged_attention needs the `triton` package; "
                           "install it or use attention.paged_attention")
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of "
                         f"{num_kv_heads} kv heads")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and kv_cache need a contiguous head_dim")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")

    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = max(_MIN_DOT, group_pad)
    block_q = block_m // group_pad  # query tokens per tile
    tile_seq, tile_q_start = _query_tiles(meta, block_q, q.device)
    kv_layer = kv_cache[:, layer]  # [num_blocks, 2, bs, Hkv, D], a strided view
    grid = (tile_seq.numel(), num_kv_heads)
    _paged_attention_kernel[grid](
        q, out, kv_layer,
        meta.block_tables, meta.seq_lens, meta.query_start_loc,
        tile_seq, tile_q_start,
        scale * 1.4426950408889634,  # log2(e)
        window or 0,
        KV_SCALE if is_fp8(kv_cache.dtype) else 1.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        meta.block_tables.stride(0),
        G=group, G_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=max(_MIN_DOT, block_size), BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, D_PAD=max(_MIN_DOT, triton.next_power_of_2(head_dim)),
        KV_CAST=kv_cache.dtype != q.dtype,
    )
    return out
