"""Offline API in the shape vLLM users know:

    from engine import LLM, SamplingParams
    llm = LLM(dtype="float32")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from engine.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, engine_config
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.vocab.lora_request import LoRARequest
from engine.vocab.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, dtype: str = ModelConfig.dtype,
                 block_size: int = CacheConfig.block_size,
                 enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
                 max_model_len: int | None = None, max_num_seqs: int = SchedulerConfig.max_num_seqs,
                 max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
                 kv_cache_memory: float = CacheConfig.kv_cache_memory, num_blocks: int | None = None,
                 scheduling_policy: str = SchedulerConfig.policy, seed: int = ModelConfig.seed,
                 device: str = ModelConfig.device, num_threads: int | None = None,
                 attention_backend: str = ModelConfig.attention_backend,
                 kv_cache_dtype: str = CacheConfig.kv_cache_dtype,
                 prefill_dtype: str = ModelConfig.prefill_dtype,
                 decode_dtype: str = ModelConfig.decode_dtype,
                 speculative_config: dict[str, Any] | None = None,
                 enable_lora: bool = LoRAConfig.enable_lora,
                 max_loras: int = LoRAConfig.max_loras,
                 max_lora_rank: int = LoRAConfig.max_lora_rank) -> None:
        """speculative_config: vLLM's shape, e.g. {"method": "ngram",
        "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
        {"method": "draft", "model": PATH, ...} or {"method": "layerskip", "num_layers": 8, ...}.
        kv_cache_dtype: auto (the model's dtype), bfloat16 or float16 (half a float32 model's cache),
            fp8_e4m3 or fp8_e5m2 (engine/layers/kv_quant.py).
        prefill_dtype: auto (every token in the model's dtype) or bfloat16 (a float32 model on a CPU
            with AVX512-BF16: prompt tokens through bfloat16 projections, twice as fast; generated
            tokens stay exact).
        decode_dtype: auto (generated tokens in the model's dtype), int8 (a float32 model's
            4-bit layers and 8-bit head: generated tokens' inputs quantized to int8 per block of
            32, integer dot products, AVX512-VNNI where present) or bfloat16 (a float32 model's
            4-bit layers: generated tokens' inputs rounded to bfloat16, the weights exact; CPUs
            with AVX512-BF16 and VBMI) or bfloat16-weights (any float32 model: every projection
            and the head on bfloat16 panels, on AMX tiles where the CPU has them; CPUs with
            AVX512-BF16); a bfloat16 model on the packed kernels: auto (bfloat16 where its
            layers are 4-bit and the CPU has VBMI and no AMX, else bfloat16-weights), bfloat16 or
            bfloat16-weights; prompt tokens keep their path."""
        config = engine_config(
            model=model, dtype=dtype, block_size=block_size, enable_prefix_caching=enable_prefix_caching,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
            num_blocks=num_blocks, scheduling_policy=scheduling_policy, seed=seed, device=device,
            num_threads=num_threads, attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype,
            prefill_dtype=prefill_dtype, decode_dtype=decode_dtype, speculative_config=speculative_config,
            enable_lora=enable_lora, max_loras=max_loras, max_lora_rank=max_lora_rank)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, priority: Sequence[int] | None = None, cache_salt: str | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.
        A prompt is a string or a list of token ids.  lora_request: one
        adapter for all prompts, or one (or None: the base) per prompt."""
        batch: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [prompts]  # type: ignore[list-item]
        else:
            batch = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(batch) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(batch):
            raise ValueError(f"sampling_params: {len(params)} given for {len(batch)} prompts")
        if priority is not None and len(priority) != len(batch):
            raise ValueError(f"priority: {len(priority)} given for {len(batch)} prompts")
        loras = ([lora_request] * len(batch) if lora_request is None or isinstance(lora_request, LoRARequest)
                 else list(lora_request))
        if len(loras) != len(batch):
            raise ValueError(f"lora_request: {len(loras)} given for {len(batch)} prompts")
        results: list[RequestOutput] = []
        children: dict[str, tuple[RequestOutput, CompletionOutput]] = {}
        added: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(batch, params, strict=True)):
                rid = str(next(self._ids))
                ids = self.engine.tokenize(prompt)
                ro = RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids)
                results.append(ro)
                for j in range(p.n):
                    child = replace(p, n=1, seed=None if p.seed is None else p.seed + j,
                                    prompt_logprobs=p.prompt_logprobs if j == 0 else None)  # shared
                    cid = f"{rid}-{j}"
                    self.engine.add_request(cid, ids, child,
                                            priority=priority[i] if priority else 0,
                                            cache_salt=cache_salt, lora=loras[i])
                    added.append(cid)
                    co = CompletionOutput(j, "", [], logprobs=[] if p.logprobs is not None else None)
                    ro.outputs.append(co)
                    children[cid] = (ro, co)
            self._run(children)
        except BaseException:
            for cid in added:
                self.engine.abort(cid)
            raise
        return results

    def _run(self, children: dict[str, tuple[RequestOutput, CompletionOutput]]) -> None:
        pending = set(children)
        while pending:
            for out in self.engine.step():
                ro, co = children[out.request_id]
                co.token_ids += out.new_token_ids
                co.text += out.new_text
                if out.new_logprobs is not None and co.logprobs is not None:
                    co.logprobs += out.new_logprobs
                    co.cumulative_logprob = sum(
                        pos[t].logprob for pos, t in zip(co.logprobs, co.token_ids, strict=True))
                ro.num_cached_tokens = max(ro.num_cached_tokens, out.num_cached_tokens)
                if out.prompt_logprobs is not None:  # each of n choices computes the same
                    ro.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    co.finish_reason, co.stop_reason = out.finish_reason, out.stop_reason
                    pending.discard(out.request_id)
                    ro.finished = all(c.finish_reason is not None for c in ro.outputs)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | None = None, **kwargs: Any) -> list[RequestOutput]:
        """Apply the model's chat template and generate.  `messages` is one
        conversation (a list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, **kwargs)

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}]: needs 'role' and 'content'")
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                 tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
