"""Float32 linear layers over weights packed once at load for the CPU kernels
(csrc/linear_cpu.cpp), with exact quantized copies for memory-bound steps.

A model loaded from a GGUF holds float32 weights that are really 4-bit (Q4_1)
or 8-bit (Q8_0) blocks, recovered exactly at load.

- 4-bit layers run on their blocks at every row count: a block of 32 inputs
  adds d * sum(x q) + m * sum(x), so no weight is rebuilt per use (a decode
  step reads 4.5 bits per weight and does one FMA per weight; big steps are
  as fast as on float32 panels).  One arithmetic for every row count: a
  row's result never depends on its batch.
- 8-bit layers (the default model's head) read their blocks for steps of a
  few rows, rebuilding each weight exactly and accumulating in the float32
  panels' order, so both paths give the same bits.
- Everything else reads float32 panels.

Under prefill_dtype=bfloat16 (CPUs with AVX512-BF16) a layer's projections
also hold bfloat16 panels, and a step's prompt tokens (PromptRows) run on
them: about twice the float32 kernels' rate on the compute-bound prompt
chunks.  Every other token (decodes, drafts, outputs computed again) keeps
the exact path, and a token's path depends only on whether it is a prompt
token, never on the batch around it.

Under decode_dtype=int8 the 4-bit layers run every other token (decodes,
drafts, outputs computed again) on kernel.q4i8_linear: x quantized to int8
per block of 32 inputs (absmax scale), integer dot products with the q values
(AVX512-VNNI where the CPU has it) and the block's d, m and float32 sum of x
folded in float32; an 8-bit head the same way (q8i8_linear) for the logits
of every token but a prompt's last.  About twice the exact kernel's rate at
16-32 rows and 1.4x at one row (Zen 5); prompt tokens keep their path.

Under decode_dtype=bfloat16 (CPUs with AVX512-BF16 and VBMI) the 4-bit layers
run those tokens on kernel.q4bf16_linear: x rounded to bfloat16, the q values
(exact in bfloat16) through vdpbf16ps with float32 sums, folded per block as
the exact kernel folds them; an 8-bit head the same way (q8bf16_linear) for
the logits of every token but a prompt's last.  The weights are the same
blocks (no other copy); the only rounding is x's.  One arithmetic for every
row count; about 1.8x the exact kernel's rate at 16-64 rows and the same at
one (Zen 4); the head 1.4-1.6x at 16-64 rows, 1.6x at 8 and the same at one.
Up to 8 rows, both read one panel after another in memory order, a thread
through its own share (session 54: a one-sequence step 0.69-0.72x the time
of 2 or 4 panels read together, dealt out alternately between the threads).

Under decode_dtype=bfloat16-weights (CPUs with AVX512-BF16) every projection
and the head hold bfloat16 panels (the weight rounded to nearest even, as
prompt tokens under prefill_dtype=bfloat16 use them) and those tokens run on
kernel.bf16_linear: on AMX tiles where the CPU has them, whose rate at 16-64
rows is bound by reading the panels, not by folding blocks.  There a 4-bit
layer's steps of up to 32 such rows go through kernel.bf16_q4_linear, which
makes each tile from the blocks instead (6 bits a weight read, not 16; the
same bits), and an 8-bit head's through kernel.bf16_q8_linear (9 bits a
weight; on the Intel Xeon with AMX, family 6 model 207, a decode step of
one sequence 0.87-0.91x the time with the panels, of 8-16 0.92-0.95x, of
32 0.97-1.07x; the same tokens).  Without AMX (vdpbf16ps, with AVX512-VBMI)
the same two calls make the panels' pairs from the blocks, a block at a
time, for steps of up to 12 such rows (one tile of x; the same bits): on a
Zen 4 (family 25 model 17) a decode step of one sequence 0.75x the time
with the panels (8.8-9.1 against 11.8-12.0 ms), served 9.5 against 12.8 ms
a token.  The norm or SiLU ahead of a projection
runs in its call (kernel.bf16_norm_linear, bf16_silu_linear: each row
normed or gated as it is rounded, the separate calls' bits), for prompt
rows too where they share the panels.  The gate and up projection also
gates its own sums (kernel.bf16_norm_silu_linear, through
forward_normed_silu: each tile of gate's and up's sums made silu(gate) * up
while in cache, their float32 outputs never written out; the same bits):
on the Intel Xeon with AMX the MLP of a 2,000-token prompt 1.25x, of 16
rows 1.1x, with the kernels alone.  Any float32 model, 4-bit weights or
not.  On the Intel Xeon with AMX (family 6 model 207) a decode step of 16 sequences took 31.9
against int8's 47.4 ms, of 32 40.2 against 49.2, of one 18.0 against 14.4
(2 bytes a weight against a 4-bit block's 0.75).

A bfloat16 model on a CPU with AVX512-BF16 or AMX (model_runner.packed_bf16)
is a float32 model under prefill_dtype=bfloat16 and bfloat16-weights (or
bfloat16 decodes: ModelRunner._bf16_model_decodes) whose head runs a prompt's
last token on its bfloat16 panels too.  A layer whose prompt rows run on the
bfloat16 panels and its other rows on those or on its blocks frees its
float32 ones (drop_unread); in such a model, the head as well.  A layer of
4-bit blocks never holds float32 panels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

# Up to this many rows an 8-bit layer reads its blocks (decoding few sequences
# is memory-bound); beyond, the float32 panels (rebuilding weights costs
# compute, which bigger steps are bound by).  Both give the same bits.  Zen 5,
# the 576 x 49,152 head: 8-bit 1.7-3.4 ms against the panels' 3.4-6.2 ms at
# 4-12 rows; from 14 rows the panels are faster (3.8 against 4.0 ms).
Q8_MAX_ROWS = 12

# How a layer runs the rows that are not prompt tokens (PackedLinear.decode_path),
# numbered as the CPU kernels' DecodeStack (csrc/decode_stack.cpp) takes them:
# the exact kernels on its own weights, the bfloat16 panels (or the blocks they
# were rounded from), the blocks with bfloat16 inputs, the blocks with int8 inputs.
EXACT, BF16_WEIGHTS, BF16_ROWS, INT8 = range(4)


def _panel_rows(weight: torch.Tensor) -> tuple[int, int, int, torch.Tensor]:
    """-> (n, k, panels, the weight zero-padded to whole panels of 16 rows,
    viewed as [p * 16, k / 32, 32] blocks)."""
    n, k = weight.shape
    p = (n + 15) // 16
    w = torch.zeros(p * 16, k, dtype=torch.float32)
    w[:n] = weight
    return n, k, p, w.view(p * 16, k // 32, 32)


def _per_panel(v: torch.Tensor, p: int, kb: int) -> torch.Tensor:
    """[p * 16, kb] per-row scales -> [p, kb, 16] (a block's 16 columns together)."""
    return v.view(p, 16, kb).transpose(1, 2)


def q4_layout(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """4-bit weights w[n, k] = d[n, k / 32] * q[n, k] + m[n, k / 32] in
    kernel.q4_linear's layout, uint8 [P, K/32, 384]: per panel of 16 outputs
    and block of 32 inputs, d[16] and m[16] as float32, then 4 chunks of 64
    bytes, chunk c's byte 4j + i holding q(8c + i, j) in its low nibble and
    q(8c + 4 + i, j) in its high (the integer kernels' order: csrc/
    linear_isa_api.h).  q [N, K] uint8 (0..15), d and m [N, K / 32] float32."""
    n, k = q.shape
    p, kb = (n + 15) // 16, k // 32
    pad = p * 16 - n
    q, d, m = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, d, m))
    dm = torch.cat([_per_panel(d, p, kb), _per_panel(m, p, kb)], dim=-1)
    # [p, kb, chunk c, half h, column j, i] for input 8c + 4h + i
    qb = q.view(p, 16, kb, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
    nibbles = qb[..., 0, :, :] | (qb[..., 1, :, :] << 4)  # [p, kb, c, j, i]: byte 4j + i of chunk c
    return torch.cat([dm.contiguous().view(torch.uint8).view(p, kb, 128),
                      nibbles.reshape(p, kb, 256)], dim=-1).contiguous()


def q4_blocks(weight: torch.Tensor, kernel: ModuleType) -> torch.Tensor | None:
    """The weight as exact 4-bit blocks for kernel.q4_linear, if it is one: a
    matrix dequantized from GGUF Q4_1 (w = d * q + m, q in 0..15, d and m
    float16, per 32 inputs).  None unless every weight rebuilds bit for bit."""
    n, k = weight.shape
    if k % 32:
        return None
    w3 = weight.view(n, k // 32, 32)
    m = w3.amin(-1)
    d = ((w3.amax(-1) - m) / 15).half().float()
    if not (torch.isfinite(d).all() and torch.equal(m.half().float(), m)):
        return None
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = ((w3 - m[..., None]) / safe[..., None]).round().clamp_(0, 15).to(torch.uint8).view(n, k)
    blocks = q4_layout(q, d, m)
    if not torch.equal(kernel.q4_unpack(blocks, n), weight):  # rebuilt as the kernel rebuilds them
        return None
    return blocks


def q8_blocks(weight: torch.Tensor, kernel: ModuleType) -> torch.Tensor | None:
    """The weight as exact 8-bit blocks for kernel.q8_linear, if it is one: a
    matrix dequantized from GGUF Q8_0 (w = d * q, q in -127..127, d float16,
    per 32 inputs; the head of the default model).  None unless every weight
    rebuilds bit for bit."""
    if weight.shape[1] % 32:
        return None
    n, k, p, w3 = _panel_rows(weight)
    d = w3.abs().amax(-1) / 127  # the block's largest |q| is 127, so this is d exactly
    if not (torch.isfinite(d).all() and torch.equal(d.half().float(), d)):
        return None
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = (w3 / safe[..., None]).round()
    if q.abs().amax() > 127:
        return None
    kb = k // 32
    qb = q.to(torch.int8).view(p, 16, kb, 32).permute(0, 2, 3, 1)  # [p, kb, 32, 16]
    blocks = torch.cat([_per_panel(d, p, kb).contiguous().view(torch.uint8).view(p, kb, 64),
                        qb.contiguous().view(torch.uint8).view(p, kb, 512)], dim=-1).contiguous()
    if not torch.equal(kernel.q8_unpack(blocks, n), weight):
        return None
    return blocks


# (begin, end, bfloat16): consecutive rows of a step and whether they are prompt tokens.
RowRun = tuple[int, int, bool]


# PackedLinear.forward_normed's, forward_silu's and (or None) forward_normed_silu's
# kernels, bound to a layer's blocks.
FusedInputs = tuple[Callable[..., torch.Tensor], Callable[[torch.Tensor], torch.Tensor],
                    Callable[..., torch.Tensor] | None]


@dataclass
class PromptRows:
    """This step's rows by path, shared by the layers whose prompt tokens
    (bfloat16 panels) or other tokens (int8) take another path (set around one
    forward, as LoRABatch is): runs covering every row in order; empty: no row
    is a prompt token."""

    runs: tuple[RowRun, ...] = ()


def row_runs(rows: Iterable[tuple[int, int]]) -> tuple[RowRun, ...]:
    """Per sequence in row order (its rows, how many of them lead as prompt
    tokens) -> the runs, neighbours of one path merged; () if no row is a prompt
    token."""
    runs: list[RowRun] = []
    start = 0
    for n, prompt in rows:
        for lo, hi, bf in ((start, start + prompt, True), (start + prompt, start + n, False)):
            if hi <= lo:
                continue
            if runs and runs[-1][2] == bf:
                runs[-1] = (runs[-1][0], hi, bf)
            else:
                runs.append((lo, hi, bf))
        start += n
    return tuple(runs) if any(bf for _, _, bf in runs) else ()


def leading_rows(runs: Sequence[RowRun], query_lens: Sequence[int]) -> list[int]:
    """Per sequence of the attention (its query_lens rows, in row order): how
    many of its leading rows `runs` marks bfloat16."""
    out: list[int] = []
    start, i = 0, 0
    for n in query_lens:
        while i < len(runs) and runs[i][1] <= start:
            i += 1
        lead = 0
        if i < len(runs) and runs[i][2] and runs[i][0] <= start:
            lead = min(runs[i][1], start + n) - start
        out.append(lead)
        start += n
    return out


class PackedLinear(nn.Module):
    """A float32 linear layer whose weight is packed once for the CPU kernel;
    the BLAS would repack it on every call, which dominates decode steps of a
    few rows.  Holds the packed copies only: float32 panels, 8-bit blocks
    beside them (a head), or 4-bit blocks alone (a GGUF's Q4_1 tensors, an
    AWQ or GPTQ checkpoint's layers): every row runs on those, so float32
    panels beside them would never be read."""

    panels: torch.Tensor | None
    q4: torch.Tensor | None
    q8: torch.Tensor | None
    bf16: torch.Tensor | None  # bfloat16 panels for prompt rows (enable_bf16) or others (enable_bf16_weights)

    def __init__(self, linear: nn.Linear, kernel: ModuleType,
                 stored: Mapping[str, torch.Tensor] | None = None) -> None:
        """stored: what stored() returned at an earlier load, or a loader's
        packed copies by the same suffixes (no packing then)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel
        if stored is None:
            weight = linear.weight.detach()
            q4 = q4_blocks(weight, kernel)
            panels = None if q4 is not None else kernel.pack_weight(weight)
            q8 = None if q4 is not None else q8_blocks(weight, kernel)
        else:
            panels, q4, q8 = stored.get(""), stored.get("#q4"), stored.get("#q8")
            p = (self.out_features + 15) // 16
            if panels is None and q4 is None:
                raise ValueError("packed weights: neither float32 panels nor 4-bit blocks")
            if panels is not None and panels.shape != (p, self.in_features, 16):
                raise ValueError(f"packed weights: {tuple(panels.shape)} do not fit a "
                                 f"{self.in_features}->{self.out_features} layer")
            if q4 is not None and q4.shape[:2] != (p, self.in_features // 32):
                raise ValueError(f"4-bit weights: {tuple(q4.shape)} do not fit a "
                                 f"{self.in_features}->{self.out_features} layer")
        q4 = q4 if q4 is not None and q4.numel() else None
        # A layer of 4-bit blocks runs every row on them (or on bfloat16 panels):
        # nothing reads float32 panels beside them (4 bytes a weight, not 0.75).
        self.register_buffer("panels", None if q4 is not None else panels, persistent=False)
        self.register_buffer("q4", q4, persistent=False)
        self.register_buffer("q8", q8 if q8 is not None and q8.numel() else None, persistent=False)
        self.register_buffer("bf16", None, persistent=False)
        self.prompt_rows: PromptRows | None = None
        self.int8 = False  # enable_int8: tokens not of a prompt on q4i8_linear
        self.bf16_decodes = False  # enable_bf16_decodes: tokens not of a prompt on q4bf16_linear
        self.bf16_prompts = False  # enable_bf16: prompt tokens on the bfloat16 panels
        self.bf16_weights = False  # enable_bf16_weights: tokens not of a prompt on the bfloat16 panels
        self.bias = linear.bias
        self.decode = self._bind_generated()
        self._fused_inputs = self._bind_fused_inputs()

    def weight(self) -> torch.Tensor:
        """The float32 weight [N, K] the packed copies stand for (the bfloat16
        one where drop_unread left only the bfloat16 panels)."""
        if self.panels is not None:
            p, k, _ = self.panels.shape
            return self.panels.permute(0, 2, 1).reshape(p * 16, k)[:self.out_features]
        if self.q4 is not None:
            return self.kernel.q4_unpack(self.q4, self.out_features)
        assert self.bf16 is not None  # a layer without panels or 4-bit blocks ran drop_unread
        p, k2, _, _ = self.bf16.shape  # [N/16, K/2, 16, 2]
        return self.bf16.permute(0, 2, 1, 3).reshape(p * 16, k2 * 2)[:self.out_features].float()

    def drop_unread(self) -> None:
        """Free the panels no row reads: the bfloat16 ones offered but not
        asked for (offer_bf16), and the float32 ones where prompt rows run on
        the bfloat16 panels (enable_bf16) and the others on those too
        (enable_bf16_weights) or on the layer's 8-bit blocks
        (enable_bf16_decodes, enable_int8): half the memory such a layer
        holds or less (2 bytes a weight, and 1 for the blocks, not 6)."""
        if not (self.bf16_prompts or self.bf16_weights):
            self.register_buffer("bf16", None, persistent=False)
        if self.bf16_prompts and (self.bf16_weights or self.bf16_decodes or self.int8):
            self.register_buffer("panels", None, persistent=False)

    def offer_bf16(self, panels: torch.Tensor) -> None:
        """bfloat16 panels packed before from this weight (pack_bf16's
        [N/16, K/2, 16, 2]): held, and read if enable_bf16 or
        enable_bf16_weights asks for them, instead of packing them again."""
        shape = ((self.out_features + 15) // 16, self.in_features // 2, 16, 2)
        if tuple(panels.shape) == shape and panels.dtype == torch.bfloat16:
            self.register_buffer("bf16", panels, persistent=False)

    def enable_bf16(self, rows: PromptRows) -> None:
        """Hold bfloat16 panels too (the weight rounded to nearest even) and run
        the prompt rows `rows` names on them."""
        self._hold_bf16()
        self.bf16_prompts = True
        self.prompt_rows = rows

    def _hold_bf16(self) -> None:
        """The bfloat16 panels, packed once for prompts and decodes alike."""
        if self.bf16 is None:
            self.register_buffer("bf16", self.kernel.pack_bf16(self.weight()), persistent=False)

    def enable_int8(self, rows: PromptRows) -> None:
        """Run the rows `rows` does not mark as prompt tokens with x quantized
        to int8 (a layer of 4- or 8-bit blocks; any other keeps its exact path)."""
        self.int8 = self.q4 is not None or self.q8 is not None
        self.prompt_rows = rows
        self.decode = self._bind_generated()
        self._fused_inputs = self._bind_fused_inputs()

    def enable_bf16_decodes(self, rows: PromptRows) -> None:
        """Run the rows `rows` does not mark as prompt tokens with x rounded to
        bfloat16 (a layer of 4- or 8-bit blocks; any other keeps its exact path)."""
        self.bf16_decodes = self.q4 is not None or self.q8 is not None
        self.prompt_rows = rows
        self.decode = self._bind_generated()
        self._fused_inputs = self._bind_fused_inputs()

    def enable_bf16_weights(self, rows: PromptRows) -> None:
        """Run the rows `rows` does not mark as prompt tokens on bfloat16 panels
        (held once, shared with the prompt rows under enable_bf16); a layer of
        4- or 8-bit blocks makes few rows' AMX tiles (or vdpbf16ps's pairs)
        from its blocks, the same bits."""
        self._hold_bf16()
        self.bf16_weights = True
        self.prompt_rows = rows
        self.decode = self._bind_generated()
        self._fused_inputs = self._bind_fused_inputs()

    def stored(self) -> dict[str, torch.Tensor]:
        """The packed copies by suffix ("", "#q4", "#q8"), to save and pass back."""
        out: dict[str, torch.Tensor] = {}
        for key, t in (("", self.panels), ("#q4", self.q4), ("#q8", self.q8)):
            if t is not None:
                out[key] = t
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.prompt_rows
        runs = rows.runs if rows is not None else ()
        if not runs:  # no prompt token
            return self.decode(x)
        if len(runs) == 1:  # every row a prompt token
            return self._prompt(x)
        if self._one_path:
            # Prompt and generated rows on the same bfloat16 panels: one call
            # reads the weights once for both (the panels' bits either way).
            return self._generated(x)
        y = x.new_empty(x.shape[0], self.out_features)
        for lo, hi, prompt in runs:
            (self._prompt if prompt else self._generated)(x[lo:hi], out=y[lo:hi])
        return y

    def fuses_argmax(self, prompt_tokens: bool) -> bool:
        """Whether argmax runs (its kernel fused) for a step's rows, some of
        them prompt tokens or none: on the bfloat16 decode path
        (enable_bf16_weights) with no bias, where forward runs every row on
        the bfloat16 panels (or the blocks they were rounded from), on
        vdpbf16ps (not AMX tiles: kernel.bf16_argmax_supported)."""
        return (self.bf16_weights and self.bf16 is not None and self.bias is None
                and (not prompt_tokens or self._one_path) and self.kernel.bf16_argmax_supported())

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x).argmax(-1), torch's answer (the first index of the
        largest output, a NaN above every number), where fuses_argmax: each
        tile of sums is taken to its rows' argmax while in cache, the [rows,
        N] outputs never written (kernel.bf16_linear_argmax)."""
        rows = self.prompt_rows
        if not self.fuses_argmax(rows is not None and bool(rows.runs)):
            raise RuntimeError("argmax: not on this layer's path (fuses_argmax)")
        return self.kernel.bf16_linear_argmax(x, self.bf16, self.out_features, self._tile_blocks)

    def forward_normed(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
        """forward(kernel.rms_norm(x, weight, eps, residual)): with a residual,
        residual += x first (in place) and the norm is of the sum.  Where the
        rows are all generated tokens on a bfloat16 or int8 path, or every row
        runs on the bfloat16 panels (decode_dtype=bfloat16-weights with
        prefill_dtype=bfloat16), the kernel norms each row as it rounds (or
        quantizes) it: one call, no float32 copy between, the same bits."""
        fused = self._fused_now()
        if fused is not None:
            return fused[0](x, weight, eps, residual)
        return self.forward(self.kernel.rms_norm(x, weight, eps, residual))

    def forward_normed_silu(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                            residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """kernel.silu_and_mul(forward_normed(x, weight, eps, residual)) for a
        gate and up projection (gate's outputs, then up's), in one call where
        forward_normed fuses, or every row of the step is a prompt token on
        the bfloat16 panels (prefill_dtype=bfloat16, whatever the decodes'
        path), and the layer has no bias: each tile of gate's and up's sums is
        gated while in cache (AMX or vdpbf16ps), their float32 outputs never
        written out.  On AMX the gated rows come back in bfloat16, rounded as
        the down projection rounds its input (it reads them as they are).  The
        same bits.  None (and nothing done) where it does not apply.  The
        gated rows then go through the down projection's forward, the path
        its forward_silu takes."""
        fused = self._fused_now()
        if fused is not None:
            return None if fused[2] is None else fused[2](x, weight, eps, residual)
        rows = self.prompt_rows
        if self.bf16_prompts and rows is not None and len(rows.runs) == 1 and self.bias is None:
            # forward's _prompt path: the panels
            n = self.out_features
            return self.kernel.bf16_norm_silu_linear(x, self.bf16, None, n, weight, eps, residual)
        return None

    def forward_silu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """forward(kernel.silu_and_mul(gate_up)), fused as forward_normed is."""
        fused = self._fused_now()
        if fused is not None:
            return fused[1](gate_up)
        return self.forward(self.kernel.silu_and_mul(gate_up))

    def _fused_now(self) -> FusedInputs | None:
        """The fused kernels where this step's rows are all generated tokens
        (forward's decode path), or every row runs on the same bfloat16 panels
        (prompt and generated rows alike: enable_bf16 and enable_bf16_weights);
        else None."""
        rows = self.prompt_rows
        if rows is not None and rows.runs and not self._one_path:
            return None
        return self._fused_inputs

    @property
    def _one_path(self) -> bool:
        """Prompt and generated rows alike run on the bfloat16 panels
        (enable_bf16 and enable_bf16_weights): one call serves a whole step."""
        return self.bf16_prompts and self.bf16_weights

    def decode_path(self) -> int:
        """Which kernels run the rows that are not prompt tokens: EXACT,
        BF16_WEIGHTS (enable_bf16_weights), BF16_ROWS (enable_bf16_decodes, a
        layer of blocks) or INT8 (enable_int8, a layer of blocks)."""
        if self.bf16_weights:
            return BF16_WEIGHTS
        if self.bf16_decodes:
            return BF16_ROWS
        return INT8 if self.int8 else EXACT

    def decode_projection(self) -> Any:
        """This layer's decode path as the kernels' DecodeStack runs it
        (kernel.DecodeProjection): the weights it reads, held by reference."""
        return self.kernel.DecodeProjection(self.decode_path(), self.out_features, self.in_features,
                                            self.panels, self.q4, self.q8, self.bf16, self.bias, Q8_MAX_ROWS)

    def _bind_fused_inputs(self) -> FusedInputs | None:
        """forward_normed's and forward_silu's kernels, bound once, on the
        bfloat16 and int8 decode paths only (None elsewhere)."""
        kernel, n, bias = self.kernel, self.out_features, self.bias
        path = self.decode_path()
        if path == BF16_WEIGHTS and self.bf16 is not None:
            # The bfloat16 panels (or tiles or pairs made from the 4- or 8-bit blocks, few rows):
            # forward's path.
            panels, blocks = self.bf16, self._tile_blocks
            gated = None if bias is not None else (
                lambda x, w, eps, res: kernel.bf16_norm_silu_linear(x, panels, blocks, n, w, eps, res))
            return (lambda x, w, eps, res: kernel.bf16_norm_linear(x, panels, blocks, n, w, eps, res, bias),
                    lambda gate_up: kernel.bf16_silu_linear(gate_up, panels, blocks, n, bias), gated)
        blocks = self._tile_blocks
        if path == INT8 and blocks is not None:  # each row normed (or gated) as it is quantized
            return (lambda x, w, eps, res: kernel.int8_norm_linear(x, blocks, n, w, eps, res, bias),
                    lambda gate_up: kernel.int8_silu_linear(gate_up, blocks, n, bias), None)
        if path != BF16_ROWS or blocks is None:
            return None
        return (lambda x, w, eps, res: kernel.bf16_rows_norm_linear(x, blocks, n, w, eps, res, bias),
                lambda gate_up: kernel.bf16_rows_silu_linear(gate_up, blocks, n, bias), None)

    def _prompt(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.bf16_prompts:
            return self.kernel.bf16_linear(x, self.bf16, self.out_features, self.bias, out=out)
        return self._exact(x, out)

    @property
    def _tile_blocks(self) -> torch.Tensor | None:
        """The blocks enable_bf16_weights' AMX tiles (or pairs) are made from for few
        rows (bf16_q4_linear, bf16_q8_linear): the 4-bit ones, else the 8-bit
        ones (a head), else None."""
        return self.q4 if self.q4 is not None else self.q8

    def _blocks_linear(self) -> Callable[..., torch.Tensor]:
        """bf16_q4_linear or bf16_q8_linear, by _tile_blocks's kind."""
        return self.kernel.bf16_q4_linear if self.q4 is not None else self.kernel.bf16_q8_linear

    def _generated(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        tiles = self._tile_blocks
        if self.bf16_weights and tiles is not None:
            return self._blocks_linear()(x, self.bf16, tiles, self.out_features, self.bias, out=out)
        if self.bf16_weights:
            return self.kernel.bf16_linear(x, self.bf16, self.out_features, self.bias, out=out)
        if self.bf16_decodes:
            fn, blocks = (self.kernel.q4bf16_linear, self.q4) if self.q4 is not None else \
                (self.kernel.q8bf16_linear, self.q8)
            return fn(x, blocks, self.out_features, self.bias, out=out)
        if self.int8:
            if self.q4 is not None:
                return self.kernel.q4i8_linear(x, self.q4, self.out_features, self.bias, out=out)
            return self.kernel.q8i8_linear(x, self.q8, self.out_features, self.bias, out=out)
        return self._exact(x, out)

    def _bind_generated(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """What _generated(x) calls, bound once (forward's path when no row is a
        prompt token).  A single-stream step runs 120 projections; going through
        forward, _generated and _exact (nn.Module looks each buffer up in
        Python) and passing bias and out cost about 7 us of a 20 us one: 0.7 ms
        of an 11 ms step (Zen 3, engine steps interleaved in one process)."""
        kernel, n, bias = self.kernel, self.out_features, self.bias
        blocks: torch.Tensor | None
        path = self.decode_path()
        if path == BF16_WEIGHTS and self._tile_blocks is not None:
            # The panels' bits, made from the 4- or 8-bit blocks (few rows).
            panels, tiles, fn = self.bf16, self._tile_blocks, self._blocks_linear()
            return (lambda x: fn(x, panels, tiles, n)) if bias is None else \
                (lambda x: fn(x, panels, tiles, n, bias))
        if path == BF16_WEIGHTS:
            fn, blocks = kernel.bf16_linear, self.bf16
        elif path == BF16_ROWS and self.q4 is not None:
            fn, blocks = kernel.q4bf16_linear, self.q4
        elif path == BF16_ROWS:
            fn, blocks = kernel.q8bf16_linear, self.q8
        elif path == INT8 and self.q4 is not None:
            fn, blocks = kernel.q4i8_linear, self.q4
        elif path == INT8:
            fn, blocks = kernel.q8i8_linear, self.q8
        elif self.q4 is not None:
            fn, blocks = kernel.q4_linear, self.q4
        else:  # 8-bit blocks or float32 panels by the row count
            return lambda x: self._exact(x)
        return (lambda x: fn(x, blocks, n)) if bias is None else (lambda x: fn(x, blocks, n, bias))

    def _exact(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.q4 is not None:  # every row count: one arithmetic (batch invariance)
            return self.kernel.q4_linear(x, self.q4, self.out_features, self.bias, out=out)
        if self.q8 is not None and x.numel() <= Q8_MAX_ROWS * self.in_features:
            return self.kernel.q8_linear(x, self.q8, self.out_features, self.bias, out=out)
        assert self.panels is not None  # a layer without panels has its 4-bit blocks
        return self.kernel.packed_linear(x, self.panels, self.out_features, self.bias, out=out)
