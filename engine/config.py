"""Frozen configuration: flags/env -> these dataclasses -> passed down."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from engine.vocab.lora_request import LoRAConfig, LoRARequest

Policy = Literal["fcfs", "priority"]
DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")  # auto: the model's dtype
PREFILL_DTYPES = ("auto", "bfloat16")  # auto: the model's dtype (engine/layers/packed_linear.py)
# auto: the model's dtype (engine/layers/packed_linear.py)
DECODE_DTYPES = ("auto", "int8", "bfloat16", "bfloat16-weights")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # HF directory or .gguf file; None: the default model
    # auto: bfloat16 on GPUs, float32 on CPUs (model_runner.resolve_dtype).
    dtype: str = "auto"
    device: str = "auto"  # auto: cuda when present, else cpu
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None: all cores
    attention_backend: str = "auto"  # auto | torch | triton
    # bfloat16: a float32 model's prompt tokens through bfloat16 projections
    # (AVX512-BF16), every other token exact; auto: every token in `dtype`.
    prefill_dtype: str = "auto"
    # int8: a float32 model's generated tokens (decodes, drafts) through its 4-bit
    # layers and 8-bit head with x quantized to int8 per block of 32 inputs; bfloat16: through
    # its 4-bit layers with x rounded to bfloat16 (AVX512-BF16 and VBMI); bfloat16-weights:
    # through bfloat16 panels of every projection and the head (AVX512-BF16; AMX tiles where
    # the CPU has them); auto: in `dtype`.
    decode_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.prefill_dtype not in PREFILL_DTYPES:
            raise ValueError(f"prefill_dtype: must be one of {', '.join(PREFILL_DTYPES)}, "
                             f"got {self.prefill_dtype!r}")
        if self.decode_dtype not in DECODE_DTYPES:
            raise ValueError(f"decode_dtype: must be one of {', '.join(DECODE_DTYPES)}, "
                             f"got {self.decode_dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device: must be auto, cpu or cuda, got {self.device!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend: must be auto, torch or triton, "
                             f"got {self.attention_backend!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # <= 1: fraction of free memory; > 1: bytes.
    kv_cache_memory: float = 0.25
    enable_prefix_caching: bool = True
    num_blocks: int | None = None  # overrides kv_cache_memory (tests, tiny budgets)
    kv_cache_dtype: str = "auto"  # see engine/layers/kv_quant.py

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size: must be a power of two <= 128, got {self.block_size}")
        if not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory: must be > 0, got {self.kv_cache_memory}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    policy: Policy = "fcfs"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy: must be fcfs or priority, got {self.policy!r}")


SPECULATIVE_METHODS = ("ngram", "draft", "layerskip")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, chosen per server.  method None: off.

    ngram: prompt lookup over the request's own tokens (n-grams of
    prompt_lookup_min..prompt_lookup_max).  draft: a small model with the
    target's tokenizer (`model`).  layerskip: the target's first `num_layers`
    layers plus its final norm and head.  adaptive: a request whose drafts keep
    being rejected proposes fewer, then none (probing again now and then).
    """

    method: str | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # draft: HF directory or .gguf file
    num_layers: int | None = None  # layerskip: target layers used by the draft
    adaptive: bool = True
    # adaptive: below this acceptance rate (EMA) a request stops proposing...
    min_acceptance_rate: float = 0.3
    # ...except for one-token probes, probe_interval decode steps apart (doubling while they fail).
    probe_interval: int = 16

    def __post_init__(self) -> None:
        if self.method is None:
            return
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method: must be one of "
                             f"{', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens: must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min: must be >= 1 and <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max}), got {self.prompt_lookup_min}")
        if self.method == "draft" and not self.model:
            raise ValueError("speculative_config.model: the draft method needs a draft model path")
        if self.method == "layerskip" and (self.num_layers is None or self.num_layers < 1):
            raise ValueError(f"speculative_config.num_layers: layerskip needs num_layers >= 1, "
                             f"got {self.num_layers!r}")
        if not 0 <= self.min_acceptance_rate <= 1:
            raise ValueError(f"speculative_config.min_acceptance_rate: must be in [0, 1], "
                             f"got {self.min_acceptance_rate}")
        if self.probe_interval < 1:
            raise ValueError(f"speculative_config.probe_interval: must be >= 1, got {self.probe_interval}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SpeculativeConfig:
        """vLLM's shape: {"method": "ngram", "num_speculative_tokens": 4, ...}.
        Unknown keys are an error, not silently ignored."""
        if not d:
            return cls()
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} "
                             f"(known: {', '.join(sorted(known))})")
        return cls(**d)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)


def engine_config(*, model: str | None = None, dtype: str = ModelConfig.dtype,
                  device: str = ModelConfig.device, seed: int = ModelConfig.seed,
                  num_threads: int | None = None, attention_backend: str = ModelConfig.attention_backend,
                  prefill_dtype: str = ModelConfig.prefill_dtype,
                  decode_dtype: str = ModelConfig.decode_dtype,
                  block_size: int = CacheConfig.block_size, kv_cache_dtype: str = CacheConfig.kv_cache_dtype,
                  kv_cache_memory: float = CacheConfig.kv_cache_memory,
                  enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
                  num_blocks: int | None = None, max_model_len: int | None = None,
                  max_num_seqs: int = SchedulerConfig.max_num_seqs,
                  max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
                  scheduling_policy: str = SchedulerConfig.policy,
                  speculative_config: Mapping[str, Any] | SpeculativeConfig | None = None,
                  enable_lora: bool = LoRAConfig.enable_lora, max_loras: int = LoRAConfig.max_loras,
                  max_lora_rank: int = LoRAConfig.max_lora_rank,
                  lora_modules: Sequence[LoRARequest] = ()) -> EngineConfig:
    """The one mapping from flat options (`LLM(...)` keywords, worker flags) to the
    nested config; the defaults are the dataclasses' own.  max_model_len None: the
    model's context (the engine caps it).  Raises ValueError naming the field."""
    speculative = (speculative_config if isinstance(speculative_config, SpeculativeConfig)
                   else SpeculativeConfig.from_dict(speculative_config))
    return EngineConfig(
        model=ModelConfig(model=model, dtype=dtype, device=device, seed=seed, num_threads=num_threads,
                          attention_backend=attention_backend, prefill_dtype=prefill_dtype,
                          decode_dtype=decode_dtype),
        cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory,
                          enable_prefix_caching=enable_prefix_caching, num_blocks=num_blocks,
                          kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len or 1 << 30,
                                  policy=scheduling_policy),  # type: ignore[arg-type]
        speculative=speculative,
        lora=LoRAConfig(enable_lora=enable_lora, max_loras=max_loras, max_lora_rank=max_lora_rank,
                        lora_modules=tuple(lora_modules)))
