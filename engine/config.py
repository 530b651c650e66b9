"""Frozen configuration: flags/env -> these dataclasses -> passed down."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Policy = Literal["fcfs", "priority"]
DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # HF directory or .gguf file; None: the default model
    # auto: bfloat16 where it is fast (GPUs, CPUs with AMX or AVX512-BF16), else float32.
    dtype: str = "auto"
    device: str = "auto"  # auto: cuda when present, else cpu
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None: all cores
    attention_backend: str = "auto"  # auto | torch | triton

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
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

    def __post_init__(self) -> None:
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


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str | None = None  # ngram | draft | layerskip
    num_speculative_tokens: int = 0
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
