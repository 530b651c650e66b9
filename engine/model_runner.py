"""Torch side of a step: KV tensors, input preparation, forward, sampling."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import cast

import torch

from engine.config import CacheConfig, ModelConfig
from engine.guided import allocate_bitmask
from engine.layers import huge_pages
from engine.layers.attention import AttentionMetadata, paged_attention
from engine.layers.cpu_attention import load_cpu_kernel, load_linear_kernel
from engine.layers.cpu_features import fast_bf16
from engine.layers.cpu_malloc import keep_freed_memory
from engine.layers.kv_quant import resolve_kv_dtype
from engine.layers.packed_linear import PackedLinear, PromptRows, leading_rows, row_runs
from engine.lora import LoRAManager
from engine.model_inputs import Chunk, build_inputs
from engine.models.int4 import Int4Weight
from engine.models.llama import AttentionFn, LlamaForCausalLM, LlamaSpec, bare_modules
from engine.sampler import SampledToken, SamplingRow, TokenStats, gather_logprobs, plain_greedy, sample
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.spec_decode.rejection import VerifyItem, rejection_sample

log = logging.getLogger(__name__)

# Prompt logprobs are computed this many positions at a time ([rows, V] float32 logits).
PROMPT_LOGPROB_ROWS = 256
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# dtype=auto on CPUs with native bf16: float32 (the packed kernels, exact
# 4-bit weights).  Measured side by side on an AVX512-BF16 EPYC without AMX
# (Zen 4, 2 cores; benchmarks/README.md, issue 16's targets run), one server
# each way: float32 served a mixed workload at 115 tok/s against bf16's 100,
# 32 streams at 260 against 225 and one stream at 49 against 15.  On an AMX
# Xeon (family 6 model 207, 2 cores, session 37's targets run) the same:
# mixed 191 against 121 tok/s, one stream 16 against 63 ms a token (torch's
# bf16 matmuls run on AMX, but a one-row step is memory-bound and the 4-bit
# blocks read 4.5 bits a weight to bf16's 16).  Prefill-heavy work runs
# faster in bf16 (2,000 tokens in 3.1 s against 3.9 on the Zen 4; offline
# batches of 64 prompts 203 tok/s against 126), so users of big offline
# batches pass bfloat16, or prefill_dtype=bfloat16 (prompts on bf16 panels,
# AMX tiles where present: 1.5 s for 2,000 tokens on the Xeon).  Those
# figures are of torch's bf16 ops; since session 48 a bfloat16 model on such
# CPUs runs on the packed kernels (packed_bf16).


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """On CPUs without native bf16, bf16 matmuls are several times slower than
    float32 (seen: 6x on an AVX2-only EPYC), so auto picks float32 there; on
    CPUs with it, see above."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    if fast_bf16() and load_linear_kernel() is None:
        return torch.bfloat16  # float32 would be torch's BLAS path
    return torch.float32


def packed_bf16(device: torch.device) -> bool:
    """Whether a bfloat16 model runs on the packed kernels here (a CPU whose
    linear kernel runs bfloat16 panels: AVX512-BF16 or AMX) rather than on
    torch's bfloat16 ops.  The weights are then bfloat16 panels (and a 4-bit
    layer's blocks) and the activations, norms, residual and sums float32:
    each token is computed exactly as a float32 model computes it under
    --prefill-dtype bfloat16 --decode-dtype D (ModelRunner._bf16_model_decodes:
    bfloat16 or bfloat16-weights) with a bfloat16 KV cache, but for the
    head's logits of a prompt's last token (bfloat16 panels here, float32
    there).  On the Zen 4 (family 25 model 17, avx512_bf16), a decode step
    of 32 sequences took 38.4 ms against torch's bfloat16 ops' 70.9, of one
    9.3 against 34.7 (bfloat16-weights)."""
    kernel = load_linear_kernel() if device.type == "cpu" else None
    return kernel is not None and bool(kernel.bf16_supported())  # the CPU's AVX512-BF16 (or AMX) too


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The KV cache's zeros: on CPUs huge_pages.kv_cache_zeros (its pages
    filled on first use, not on the start-up path)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return huge_pages.kv_cache_zeros(shape, dtype)


def bf16_decode_attention(decodes: str, bf16_prompts: bool, attention: ModuleType | None) -> bool:
    """Whether generated tokens under decode_dtype `decodes` attend in bfloat16:
    those whose projections take bfloat16 inputs do, where the CPU attention
    kernel can (paged_decode_attention's bf16_dots over fp8 e4m3 and bfloat16
    caches: the query and the softmax's weights rounded to bfloat16, keys and
    values exact), unless SPLITSERVE_BF16_DECODE_ATTENTION is "0".  Generated
    tokens a step computes among others (drafts checked, tokens computed again
    after a preemption) attend as bfloat16 rows of the prefill kernel, which
    takes a run of leading rows: so only where prompt tokens attend in
    bfloat16 too (bf16_prompts: prefill_dtype bfloat16 there), and then every
    row does (mark_prompt_rows).
    Zen 5 (family 26 model 2), 30 layers of 32 sequences over an e4m3 cache:
    1.85 -> 1.47 ms at context 112, 5.16 -> 4.41 at 300; greedy outputs move
    from float32 decodes' about as far as with the bfloat16 panels alone
    (benchmarks/README.md, session 61)."""
    if os.environ.get("SPLITSERVE_BF16_DECODE_ATTENTION") == "0":
        return False
    bf16_inputs = decodes in ("bfloat16", "bfloat16-weights") and bf16_prompts
    return bf16_inputs and attention is not None and attention.decode_bf16_supported()


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows]: x itself where rows are all of its rows in order (a step of
    decodes), else index_select.  On the CPU x[list] is advanced indexing,
    whose copy runs as a parallel region: with OpenMP's idle threads asleep
    (engine/__init__.py) it woke them, 67 against 4 us for 32 rows of 576 on
    2 cores (Zen 4), once a step."""
    if len(rows) == x.shape[0] and rows == list(range(len(rows))):
        return x
    return x.index_select(0, torch.tensor(rows, dtype=torch.long, device=x.device))


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    from safetensors import safe_open

    from engine.models.loader import gguf_source
    from engine.models.quantized import int4_layers

    config = json.loads((model_dir / "config.json").read_text())
    spec = LlamaSpec.from_hf(config)
    files = sorted(glob.glob(str(model_dir / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"model: no .safetensors files in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():  # noqa: SIM118
                tensors[name] = st.get_tensor(name)
    with bare_modules():
        model = LlamaForCausalLM(spec)
    # Storage for the meta tensors.  Not Module.to_empty: its empty_like on meta
    # tensors imports torch's reference ops and sympy, seconds of every start.
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype)).to(dtype)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    kernel = load_linear_kernel() if device.type == "cpu" and dtype == torch.float32 else None
    cache = packed_cache_path(model_dir, files)
    panels = load_packed(cache) if kernel is not None else None
    int4: dict[str, Int4Weight] = {}
    int4_only = False
    if panels is None:  # a 4-bit checkpoint's layers, or (for the kernel) a GGUF's 4-bit tensors
        gguf = gguf_source(model_dir) if kernel is not None else None
        int4, int4_only = int4_layers(model, config, tensors, gguf)
    if kernel is None:  # no 4-bit kernel: float weights throughout
        with torch.no_grad():
            for path, w in int4.items():
                cast(torch.nn.Linear, model.get_submodule(path)).weight.copy_(w.dequantize())
        model.load_hf_state_dict(tensors, skip_linears=int4)
        return model.to(device).eval()
    model.load_hf_state_dict(tensors, skip_linear_weights=panels is not None,
                             skip_linears=int4 if int4_only else ())
    model.eval().pack_linears(kernel, panels, int4, int4_only)
    if panels is None:
        save_packed(model.packed_panels(), cache)
    return model


def packed_cache_path(model_dir: Path, files: Sequence[str], kind: str = "") -> Path:
    """Where the packed weights of these safetensors files are kept: the key
    changes with the files and with the kernel's source (its packing layout).
    kind "bf16": their bfloat16 panels (bf16_panels_path), beside them."""
    from engine.layers import packed_linear
    from engine.layers.cpu_attention import CSRC
    from engine.models import llama, quantized
    from engine.vocab.models import cache_dir

    h = hashlib.sha256((CSRC / "linear_cpu.cpp").read_bytes() + (CSRC / "linear_isa_api.h").read_bytes())
    h.update(Path(packed_linear.__file__).read_bytes())  # the packing code
    h.update(Path(llama.__file__).read_bytes())
    for name in quantized.SOURCES:
        h.update((Path(quantized.__file__).parent / name).read_bytes())
    for f in files:
        st = os.stat(f)
        h.update(f"{os.path.realpath(f)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return cache_dir() / "packed" / f"{model_dir.name}{'-' + kind if kind else ''}-{h.hexdigest()[:16]}.pt"


def bf16_panels_path(model_dir: Path) -> Path:
    """Where the bfloat16 panels packed from a model's weights are kept
    (prefill_dtype=bfloat16, bfloat16-weights, a bfloat16 model), keyed as
    its packed weights are."""
    return packed_cache_path(model_dir, sorted(glob.glob(str(model_dir / "*.safetensors"))), "bf16")


def load_packed(path: Path) -> dict[str, torch.Tensor] | None:
    """Packed weights saved by an earlier start, mapped from the file (no copy;
    huge_pages moves the ones the kernels stream onto 2 MiB pages, unless
    SPLITSERVE_HUGE_PAGES=0 keeps them shared); None if there are none."""
    if not path.exists():
        return None
    try:
        return torch.load(path, mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001 - a bad cache file is rebuilt, never fatal
        log.warning("packed weights at %s unreadable (%s); packing again", path, e)
        return None


def save_packed(panels: Mapping[str, torch.Tensor], path: Path) -> None:
    """Best effort: a start that cannot write the cache still serves."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        torch.save(dict(panels), tmp)
        os.replace(tmp, path)  # atomic: workers starting together never read half a file
        stem = path.stem.rsplit("-", 1)[0]
        for old in path.parent.glob(f"{stem}-*.pt"):  # packings of older code or files
            if old != path and old.stem.rsplit("-", 1)[0] == stem:
                old.unlink(missing_ok=True)
    except OSError as e:
        log.warning("could not save packed weights to %s: %s", path, e)


class ModelRunner:
    def __init__(self, model_dir: Path, model_config: ModelConfig, cache_config: CacheConfig) -> None:
        if model_config.num_threads:
            torch.set_num_threads(model_config.num_threads)
        self.model_dir = model_dir
        self.device = resolve_device(model_config.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # a step's big tensors reuse the last step's pages
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        # dtype=bfloat16 on a CPU whose packed kernels run bfloat16: the weights
        # as bfloat16 panels, every token through them (packed_bf16).
        self.bf16_weights_model = self.dtype == torch.bfloat16 and packed_bf16(self.device)
        decodes, prefill = model_config.decode_dtype, model_config.prefill_dtype
        if (self.device.type == "cpu" and self.dtype != torch.float32 and not self.bf16_weights_model
                and load_linear_kernel() is not None):  # auto would pick float32 on the packed kernels
            log.warning("dtype %s on this CPU runs torch's ops, not the packed kernels (%s): several times "
                        "slower than --dtype auto", str(self.dtype).removeprefix("torch."),
                        "float16 has none" if self.dtype == torch.float16 else "no AVX512-BF16 or AMX here")
        if self.bf16_weights_model:
            if decodes == "int8":  # refused: a float32 model's option
                self._check_quantized_decodes(decodes, load_linear_kernel())
            self.dtype, prefill = torch.float32, "bfloat16"
        self.model = load_model(model_dir, self.dtype, self.device)
        # bfloat16 panels packed by an earlier start, mapped from the file as
        # the packed weights are, where an option runs rows on them: the layers
        # that hold bfloat16 panels below take them.
        wants_bf16 = prefill == "bfloat16" or decodes == "bfloat16-weights"
        bf16_cache = (bf16_panels_path(model_dir)
                      if wants_bf16 and isinstance(self.model.lm_head, PackedLinear) else None)
        bf16_stored = load_packed(bf16_cache) if bf16_cache is not None else None
        if bf16_stored is not None:
            self.model.offer_bf16_panels(bf16_stored)
        if self.bf16_weights_model:
            decodes = self._bf16_model_decodes(decodes)
        self.spec = self.model.spec
        self.block_size = cache_config.block_size
        self.kv_dtype = resolve_kv_dtype(cache_config.kv_cache_dtype,
                                         torch.bfloat16 if self.bf16_weights_model else self.dtype)
        self.num_blocks = cache_config.num_blocks or self._blocks_for_budget(cache_config)
        s = self.spec
        # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]: a block is contiguous.
        self.kv_cache = lazy_zeros((self.num_blocks, s.num_layers, 2, self.block_size, s.num_kv_heads,
                                    s.head_dim), self.kv_dtype, self.device)
        self.attn = self._attention_backend(model_config.attention_backend)
        # prefill_dtype=bfloat16 or decode_dtype=int8/bfloat16: the prompt rows of each step, set
        # around its forward.
        self.prompt_rows: PromptRows | None = None
        # ... and their attention (the CPU kernel's, where it was built with AVX512-BF16).
        self.bf16_attention = False
        self.bf16_prompts = prefill == "bfloat16" and self.dtype != torch.bfloat16
        # False: greedy rows sample from the logits even where the head fuses
        # their argmax (_argmax_head): an A/B's other side, a test's reference.
        self.fused_argmax = True
        self.head_rows: PromptRows | None = None  # decode_dtype not auto: the head's rows by path
        self.decodes = ""
        if decodes != "auto":
            self.prompt_rows = self._decodes(decodes)
        if self.bf16_prompts:
            self.prompt_rows = self._bf16_prompts(self.prompt_rows)
            attention = load_cpu_kernel()
            self.bf16_attention = attention is not None and attention.prefill_bf16_supported()
            if not self.bf16_attention:
                log.warning("prefill_dtype bfloat16: the attention kernel has no AVX512-BF16 build; "
                            "prompt tokens attend in float32")
        self.bf16_decode_attention = bf16_decode_attention(
            self.decodes, self.bf16_attention, load_cpu_kernel() if self.device.type == "cpu" else None)
        self._masker: ThreadPoolExecutor | None = None  # started by the first grammar
        self.lora: LoRAManager | None = None  # set by enable_lora
        if self.bf16_weights_model:
            self.model.bf16_head_prompts(self.head_rows)
            log.info("dtype bfloat16 on the packed kernels: bfloat16 weights (generated tokens: %s), float32 "
                     "activations and sums; each token computed as under --dtype float32 --prefill-dtype "
                     "bfloat16 --decode-dtype %s, no float32 copy of the weights held",
                     "bfloat16 inputs, the 4-bit blocks exact" if decodes == "bfloat16"
                     else "the bfloat16 panels", decodes)
        self.model.drop_unread_panels()
        held = self.model.bf16_panels()
        if bf16_cache is not None and held.keys() - (bf16_stored or {}).keys():
            save_packed({**(bf16_stored or {}), **held}, bf16_cache)  # packed here: kept for the next start
        if self.device.type == "cpu":
            # What the kernels stream each step, before the decode stack keeps their pointers.
            huge_pages.move_to_huge_pages(b for m in self.model.modules() if isinstance(m, PackedLinear)
                                          for b in m.buffers())
            load_cpu_kernel()  # build (once per machine) now rather than in the first step
        log.info("model %s: %d KV blocks of %d tokens (%.1f MiB, %s)", model_dir.name, self.num_blocks,
                 self.block_size, self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
                 str(self.kv_dtype).removeprefix("torch."))

    @property
    def prefill_dtype(self) -> str:
        """What prompt tokens compute in, if not the model's dtype: "bfloat16" or ""."""
        return "bfloat16" if self.bf16_prompts else ""

    @property
    def model_dtype(self) -> torch.dtype:
        """The model's dtype as asked: bfloat16 for a bfloat16 model on the
        packed kernels (its weights' rounding), whose activations, and so
        self.dtype and the layout's compute dtype, are float32."""
        return torch.bfloat16 if self.bf16_weights_model else self.dtype

    @property
    def decode_dtype(self) -> str:
        """What generated tokens compute in, if not the model's dtype: "int8", "bfloat16",
        "bfloat16-weights" or ""."""
        return self.decodes

    def _decodes(self, dtype: str) -> PromptRows:
        """decode_dtype int8 or bfloat16: a float32 model's 4-bit layers run
        generated tokens on that kernel; bfloat16-weights: every packed layer
        runs them on its bfloat16 panels.  The returned rows are set per step."""
        kernel = load_linear_kernel() if self.device.type == "cpu" else None
        if dtype == "bfloat16-weights":
            self._check_bf16_weights(kernel)
        else:
            self._check_quantized_decodes(dtype, kernel)
        rows, self.head_rows, self.decodes = PromptRows(), PromptRows(), dtype
        self.model.enable_decodes(dtype, rows, self.head_rows)
        return rows

    def _bf16_model_decodes(self, asked: str) -> str:
        """What a bfloat16 model's generated tokens run on, as decode_dtype
        names it (the layers' prompt rows are on their bfloat16 panels either
        way).  auto: bfloat16 (q4bf16_linear: x rounded to bfloat16, the 4-bit
        blocks exact) where the layers are 4-bit and the CPU has AVX512-VBMI
        but no AMX, else bfloat16-weights (the bfloat16 panels; few rows' from
        the blocks, the same bits).  Without AMX a step of few rows makes the
        panels' pairs from each block before reading them, which bfloat16
        decodes skip: Zen 4 (family 25 model 17, benchmarks.step_profile),
        one sequence 7.4 against 8.6 ms a step, 8 sequences 12.9 against
        14.7; 32 sequences 36.2 against 35.4 (the head's 8-bit blocks cost
        more than its panels there).  Either where asked for and it runs."""
        kernel = load_linear_kernel()
        assert kernel is not None  # packed_bf16 found it
        if asked == "bfloat16":
            self._check_quantized_decodes(asked, kernel)
        if asked != "auto":
            return asked
        return "bfloat16" if self._four_bit() and kernel.q4bf16_supported() and not kernel.amx_supported() \
            else "bfloat16-weights"

    def _four_bit(self) -> bool:
        """Whether the model's projections are packed 4-bit blocks (the quantized decodes' layers)."""
        layer = self.model.layers[0].qkv_proj
        return isinstance(layer, PackedLinear) and layer.q4 is not None

    def _check_quantized_decodes(self, dtype: str, kernel: ModuleType | None) -> None:
        """decode_dtype int8 or bfloat16: refused, saying why, without a float32
        model of 4-bit weights on the kernels they need; int8 without VNNI says
        which kernels it runs on."""
        bf16 = dtype == "bfloat16"
        if self.dtype != torch.float32 or kernel is None or (bf16 and not kernel.q4bf16_supported()):
            where = "a CPU with AVX512-BF16 and AVX512-VBMI" if bf16 else "a CPU"
            kernels = ("unavailable" if kernel is None else "built, the CPU without them"
                       if bf16 and not kernel.q4bf16_supported() else "built")
            raise ValueError(f"decode_dtype: {dtype} needs a float32 model on {where} "
                             f"(model dtype {str(self.model_dtype).removeprefix('torch.')}, device "
                             f"{self.device.type}, CPU kernels {kernels})")
        if not self._four_bit():
            raise ValueError(f"decode_dtype: {dtype} needs a model of 4-bit weights (a Q4_1 GGUF, AWQ or "
                             "GPTQ) on the packed CPU projections")
        if not bf16 and not kernel.i8_vnni_supported():
            log.info("decode_dtype int8: no AVX512-VNNI/VBMI on this CPU; the integer kernels run on %s "
                     "(the same results)", kernel.isa())

    def _check_bf16_weights(self, kernel: ModuleType | None) -> None:
        """decode_dtype bfloat16-weights: refused, saying why, without a float32
        model on the packed projections of a CPU with AVX512-BF16."""
        if self.dtype != torch.float32 or kernel is None or not kernel.bf16_supported():
            kernels = ("unavailable" if kernel is None else "built" if kernel.bf16_supported()
                       else "built, the CPU without it")
            raise ValueError("decode_dtype: bfloat16-weights needs a float32 model on a CPU with AVX512-BF16 "
                             f"(model dtype {str(self.dtype).removeprefix('torch.')}, device "
                             f"{self.device.type}, CPU kernels {kernels})")
        if not isinstance(self.model.layers[0].qkv_proj, PackedLinear):
            raise ValueError("decode_dtype: bfloat16-weights needs the packed CPU projections")

    def _bf16_prompts(self, rows: PromptRows | None) -> PromptRows:
        kernel = load_linear_kernel() if self.device.type == "cpu" else None
        if self.dtype != torch.float32 or kernel is None or not kernel.bf16_supported():
            raise ValueError("prefill_dtype: bfloat16 needs a float32 model on a CPU with AVX512-BF16 "
                             f"(model dtype {str(self.dtype).removeprefix('torch.')}, device "
                             f"{self.device.type}, CPU kernels {'built' if kernel else 'unavailable'})")
        if not isinstance(self.model.layers[0].qkv_proj, PackedLinear):
            raise ValueError("prefill_dtype: bfloat16 needs the packed CPU projections")
        return self.model.enable_bf16_prompts(rows)

    def mark_prompt_rows(self, meta: AttentionMetadata, rows: Iterable[tuple[int, int]]) -> None:
        """bfloat16 prompts or int8 decodes: the next forward's rows by path, per scheduled
        sequence in row order (its rows, how many of them lead as prompt tokens),
        for the projections and the attention."""
        assert self.prompt_rows is not None
        self.prompt_rows.runs = row_runs(rows)
        if self.bf16_decode_attention:  # prompt and generated tokens alike (bf16_decode_attention)
            meta.bf16_rows = list(meta.query_lens)
        elif self.bf16_attention and self.prompt_rows.runs:
            meta.bf16_rows = leading_rows(self.prompt_rows.runs, meta.query_lens)

    def enable_lora(self, max_loras: int, max_rank: int) -> LoRAManager:
        self.lora = LoRAManager(self.model, max_loras, max_rank)
        return self.lora

    def _mask_pool(self) -> ThreadPoolExecutor:
        if self._masker is None:
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._masker

    def load_model(self, model_dir: Path) -> LlamaForCausalLM:
        """Another model (a draft) in this runner's dtype, on its device."""
        return load_model(model_dir, self.dtype, self.device)

    def kv_prefault(self) -> huge_pages.Prefault | None:
        """A filler of the CPU cache's pages ahead of use (huge_pages.Prefault),
        or None: a GPU cache (torch.zeros wrote it), no kernels built, or
        SPLITSERVE_KV_PREFAULT=0."""
        kernel = load_linear_kernel() if self.device.type == "cpu" else None
        if kernel is None or not huge_pages.prefault_enabled():
            return None
        return huge_pages.Prefault(self.kv_cache, self.block_bytes, kernel.touch_pages)

    @property
    def block_bytes(self) -> int:
        s = self.spec
        return (s.num_layers * 2 * self.block_size * s.num_kv_heads * s.head_dim
                * self.kv_dtype.itemsize)

    def _blocks_for_budget(self, cfg: CacheConfig) -> int:
        budget = cfg.kv_cache_memory
        nbytes = int(budget * available_memory(self.device)) if budget <= 1 else int(budget)
        n = nbytes // self.block_bytes
        if n < 1:
            raise ValueError(f"kv_cache_memory: {nbytes} bytes hold no block of {self.block_bytes} bytes")
        return n

    def _attention_backend(self, name: str) -> AttentionFn:
        if name == "triton" or (name == "auto" and self.device.type == "cuda"):
            from engine.layers.triton_attention import triton_paged_attention

            def attn(q, k, v, cache, layer, meta, scale, /, *, window=None, softcap=None):  # type: ignore[no-untyped-def]
                if softcap is not None:  # the kernel has no soft cap (Gemma 2): the torch path
                    return paged_attention(q, k, v, cache, layer, meta, scale, window=window, softcap=softcap)
                return triton_paged_attention(q, cache, layer, meta, scale, window)
            return attn
        return paged_attention

    def prepare(self, seqs: Sequence[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        input_ids, positions, meta = build_inputs([seq_chunk(s) for s in seqs], self.block_size, self.device)
        meta.bf16_decodes = self.bf16_decode_attention
        return input_ids, positions, meta

    @torch.inference_mode()
    def forward_logits(self, seqs: Sequence[ScheduledSeq],
                       ) -> tuple[torch.Tensor, dict[str, list[TokenStats]]]:
        """-> logits [S, V] float32 for each sequence that samples: at its last
        known token, then at each of its draft tokens (1 + drafts rows); and
        per sequence that wants them, the logprobs of the prompt tokens this
        chunk predicts (the next ones its request lacks)."""
        hidden, groups, prompt = self._forward_hidden(seqs)
        return self._logits(hidden, groups), prompt

    def _forward_hidden(self, seqs: Sequence[ScheduledSeq],
                        ) -> tuple[torch.Tensor, list[tuple[int, int]], dict[str, list[TokenStats]]]:
        """forward_logits's work but the head: the hidden rows it takes, their
        groups (as _logits takes them) and the prompt logprobs."""
        input_ids, positions, meta = self.prepare(seqs)
        if self.prompt_rows is not None:
            self.mark_prompt_rows(meta, [(s.num_new_tokens, prompt_tokens(s)) for s in seqs])
        try:
            if self.lora is None:
                hidden = self.model(input_ids, positions, self.kv_cache, meta, self.attn)
            else:
                with self.lora.apply([(s.request.lora, s.num_new_tokens) for s in seqs]):
                    hidden = self.model(input_ids, positions, self.kv_cache, meta, self.attn)
        finally:
            if self.prompt_rows is not None:
                self.prompt_rows.runs = ()
        rows: list[int] = []
        prompt: dict[str, list[TokenStats]] = {}
        end = 0
        for s in seqs:
            begin, end = end, end + s.num_new_tokens
            if s.sample:
                rows += range(end - 1 - len(s.spec_token_ids), end)
            span = prompt_logprob_positions(s)
            if span:
                prompt[s.request.request_id] = self._prompt_logprobs(
                    hidden[begin + span.start - s.start:begin + span.stop - s.start],
                    s.request.prompt_token_ids[span.start + 1:span.stop + 1],
                    s.request.params.prompt_logprobs or 0)
        groups = [(1 + len(s.spec_token_ids), int(last_known_is_prompt(s))) for s in seqs if s.sample]
        return take_rows(hidden, rows), groups, prompt

    def _logits(self, hidden: torch.Tensor, rows: Iterable[tuple[int, int]]) -> torch.Tensor:
        """The head over `hidden`'s rows, per group of them (its rows, how many
        lead as prompt tokens): decode_dtype int8 or bfloat16 runs the others' on its kernel."""
        return self._head(self.model.compute_logits, hidden, rows)

    def _head(self, head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
              rows: Iterable[tuple[int, int]]) -> torch.Tensor:
        """head (compute_logits or compute_argmax) over `hidden`'s rows, the
        head's kernels told which rows lead as prompt tokens (_logits)."""
        if self.head_rows is None:
            return head(hidden)
        self.head_rows.runs = row_runs(rows)
        try:
            return head(hidden)
        finally:
            self.head_rows.runs = ()

    def _prompt_logprobs(self, hidden: torch.Tensor, targets: list[int], k: int) -> list[TokenStats]:
        """hidden: [P, H] at prompt positions; targets: the token after each.
        In slices, so a long prompt never holds [P, V] logits at once."""
        out: list[TokenStats] = []
        for i in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            part = hidden[i:i + PROMPT_LOGPROB_ROWS]
            logits = self._logits(part, [(len(part), len(part))])
            ids = torch.tensor(targets[i:i + PROMPT_LOGPROB_ROWS], device=logits.device)
            out += gather_logprobs(logits, ids, [k] * len(ids))
        return out

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, draft_probs: Mapping[str, torch.Tensor] | None = None,
                ) -> tuple[dict[str, list[SampledToken]], dict[str, list[TokenStats]]]:
        """-> per sampling request, its new tokens: one, or when it verified
        drafts, the accepted drafts and one more; and per request that wants
        them, the prompt logprobs this step computed.  draft_probs: the
        proposal distributions [k, V] of drafts that were sampled (not one-hot)."""
        # Decodes and verifications first: the attention path batches them.
        seqs = sorted(out.seqs, key=lambda s: not s.attends_as_decode)
        sampling = [s for s in seqs if s.sample]
        # Grammar masks are filled on another thread while the forward runs.
        masks = None
        if any(s.request.grammar is not None for s in sampling):
            masks = self._mask_pool().submit(fill_grammar_masks, sampling, self.spec.vocab_size)
        elif sampling and self._argmax_head(sampling):
            return self._greedy(seqs, sampling)
        logits, prompt = self.forward_logits(seqs)
        if not sampling:
            return {}, prompt
        bitmasks = masks.result() if masks is not None else {}
        rows = [SamplingRow(s.request.params, s.request.prompt_token_ids, s.request.output_token_ids,
                            s.request.rng, s.request.eos_token_ids,
                            _first(bitmasks.get(s.request.request_id)), s.request.num_resumed_tokens)
                for s in sampling]
        if not any(s.spec_token_ids for s in sampling):
            tokens = sample(logits, rows)
            return {s.request.request_id: [t] for s, t in zip(sampling, tokens, strict=True)}, prompt
        probs = draft_probs or {}
        items = []
        for s, row in zip(sampling, rows, strict=True):
            q = probs.get(s.request.request_id)
            k = len(s.spec_token_ids)
            items.append(VerifyItem(row, s.spec_token_ids, None if q is None or not k else q[:k],
                                    bitmasks.get(s.request.request_id)))
        emitted = rejection_sample(logits, items)
        return {s.request.request_id: toks for s, toks in zip(sampling, emitted, strict=True)}, prompt

    def _argmax_head(self, sampling: Sequence[ScheduledSeq]) -> bool:
        """Whether this step's tokens are its head's argmax, fused
        (compute_argmax): every sampling row plain greedy (plain_greedy), no
        drafts to verify, no grammar (the caller's check), and a head that
        fuses it for these rows."""
        if not self.fused_argmax:
            return False
        for s in sampling:
            r = s.request
            if s.spec_token_ids or not plain_greedy(r.params, len(r.output_token_ids), r.eos_token_ids):
                return False
        return self.model.fuses_argmax(any(last_known_is_prompt(s) for s in sampling))

    def _greedy(self, seqs: Sequence[ScheduledSeq], sampling: Sequence[ScheduledSeq],
                ) -> tuple[dict[str, list[SampledToken]], dict[str, list[TokenStats]]]:
        """execute where _argmax_head: each token the argmax of its logits,
        taken in the head's kernel, the [S, V] logits never made (sample's
        tokens: sampling them would take the same argmax).  On a Zen 5
        (family 26 model 2), 32 rows of a 576 x 49,152 head: 2.5 ms against
        4.3 for the head and first_argmax."""
        hidden, groups, prompt = self._forward_hidden(seqs)
        ids = self._head(self.model.compute_argmax, hidden, groups).tolist()
        return ({s.request.request_id: [SampledToken(token_id=t, logprob=math.nan, rank=0)]
                 for s, t in zip(sampling, ids, strict=True)}, prompt)


def fill_grammar_masks(seqs: Sequence[ScheduledSeq], vocab_size: int) -> dict[str, torch.Tensor]:
    """-> per request with a grammar, [1 + drafts, W] bitmasks: the allowed
    tokens after its last token and after each of its drafts."""
    out = {}
    for s in seqs:
        grammar = s.request.grammar
        if grammar is not None:
            bm = allocate_bitmask(1 + len(s.spec_token_ids), vocab_size)
            grammar.fill_with_drafts(bm, 0, s.spec_token_ids)
            out[s.request.request_id] = bm
    return out


def prompt_logprob_positions(seq: ScheduledSeq) -> range:
    """The positions p of this chunk whose logits give prompt token p + 1's
    logprob, from the first one its request lacks (a recompute after a
    preemption does not repeat them)."""
    req = seq.request
    if req.prompt_logprobs is None:
        return range(0)
    lo = max(seq.start, len(req.prompt_logprobs))
    hi = min(seq.start + seq.num_new_tokens - len(seq.spec_token_ids), req.num_prompt_tokens - 1)
    if seq.start > len(req.prompt_logprobs):  # a gap: prefix hits are refused for such requests
        return range(0)
    return range(lo, max(lo, hi))


def last_known_is_prompt(seq: ScheduledSeq) -> bool:
    """Whether a chunk's last known token (whose logits sample its next) is a
    prompt token: the end of a prefill, not a decode."""
    return prompt_tokens(seq) == seq.num_new_tokens - len(seq.spec_token_ids)


def prompt_tokens(seq: ScheduledSeq) -> int:
    """How many of a scheduled chunk's rows (which lead) are prompt tokens: the
    request's own, not tokens it generated (a migrated stream's resumed tokens
    end its prompt, and were computed as outputs where they were generated)."""
    known = seq.num_new_tokens - len(seq.spec_token_ids)
    return max(0, min(known, seq.request.num_generated_from - seq.start))


def _first(bitmask: torch.Tensor | None) -> torch.Tensor | None:
    return None if bitmask is None else bitmask[0]


def seq_chunk(seq: ScheduledSeq) -> Chunk:
    """A scheduled sequence's query tokens: known tokens, then any drafts
    (verified as one-token rows, as are output tokens computed again)."""
    known_end = seq.start + seq.num_new_tokens - len(seq.spec_token_ids)
    return Chunk(seq.request.all_token_ids[seq.start:known_end] + seq.spec_token_ids, seq.start,
                 seq.block_ids, expand=seq.rows_as_decodes, prompt=not seq.attends_as_decode)


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
