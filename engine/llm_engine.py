"""One engine: tokenizer, scheduler, KV cache manager and model runner in one loop."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Sequence
from dataclasses import replace

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.guided import GrammarCompiler
from engine.kv_cache_manager import KVCacheManager
from engine.kv_handoff import KVHandoff
from engine.lora import LoRAAdapter
from engine.model_runner import ModelRunner
from engine.models.loader import load_text_tokenizer, load_tokenizer, model_name, resolve_model
from engine.outputs import Logprob, PositionLogprobs, PromptLogprobs, StepOutput
from engine.request import Request, RequestStatus
from engine.sampler import SampledToken
from engine.scheduler import Scheduler
from engine.spec_decode.decoder import (
    SpeculativeDecoder,
    check_speculative_config,
    make_speculative_decoder,
)
from engine.vocab.hashing import cache_model_key, extra_keys
from engine.vocab.lora_request import LoRARequest
from engine.vocab.models import model_id
from engine.vocab.sampling_params import SamplingParams
from engine.vocab.tokenizer import TextTokenizer
from kvtransfer.layout import KVLayout


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        model_dir = resolve_model(config.model.model)
        self.model_name = model_name(config.model.model)  # what metrics and users call it
        self.model_id = model_id(config.model.model)  # name + weights digest: identity between workers
        self._model_dir = model_dir
        # Encoding, decoding, the vocabulary: without transformers where the
        # model allows (engine/vocab/tokenizer.py); `tokenizer` is transformers'.
        self.text_tokenizer = load_text_tokenizer(model_dir)
        self._tokenizer = None if isinstance(self.text_tokenizer, TextTokenizer) else self.text_tokenizer
        self._tokenizer_lock = threading.Lock()
        hf_cfg = json.loads((model_dir / "config.json").read_text())
        # Before the weights load: a configuration that cannot work fails fast.
        draft_dir = check_speculative_config(config.speculative, hf_cfg, self.text_tokenizer)
        self.runner = ModelRunner(model_dir, config.model, config.cache)
        if config.lora.enabled:
            self.runner.enable_lora(config.lora.max_loras, config.lora.max_lora_rank)
            for module in config.lora.lora_modules:
                self.load_lora(module)
        spec = self.runner.spec
        max_len = min(config.scheduler.max_model_len, spec.max_position_embeddings)
        self.config = replace(config, scheduler=replace(config.scheduler, max_model_len=max_len))
        self.vocab_size = spec.vocab_size
        self.eos_token_ids = _eos_ids(hf_cfg, model_dir, self.text_tokenizer)
        # Block hashes: blocks of other weights, dtypes or KV dtypes never match.
        self.cache_model_key = cache_model_key(self.model_id, _dtype_name(self.runner.dtype),
                                               _dtype_name(self.runner.kv_dtype), self.runner.prefill_dtype)
        # What this engine's blocks are, built once (docs/ARCHITECTURE.md, invariant 7): the
        # cache tensor's own shape and dtype (fp8 or the model's) and the compute dtype.
        # The UCX handshake, Info, registrations and every handoff carry it.
        self.kv_layout = KVLayout.from_cache(self.runner.kv_cache, self.model_id, self.runner.dtype,
                                             self.runner.prefill_dtype)
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                 config.cache.enable_prefix_caching,
                                 prompt_blocks_only=self.runner.prompt_rows is not None)
        # The cache's pages filled ahead of the blocks handed out next, off the steps' path.
        self.prefault = self.runner.kv_prefault()
        if self.prefault is not None:
            self.kv.pool.on_fresh = self.prefault.ahead_of
            self.prefault.ahead_of(0)
        self.scheduler = Scheduler(self.config.scheduler, self.kv)
        self.spec: SpeculativeDecoder | None = None
        if config.speculative.enabled:
            self.spec = make_speculative_decoder(config.speculative, self.runner, draft_dir)
        # Structured output; xgrammar loads with the first request that has a grammar.
        self.grammars = GrammarCompiler(lambda: self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._rng = random.Random(config.model.seed)
        # Monotonic counters for metrics and tests.
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._token_texts: dict[int, str] = {}  # logprobs name each token by its text

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        """transformers' tokenizer for the model (chat templates, grammars),
        loaded on first use: importing transformers costs about a second."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self._model_dir)
            return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return list(self.text_tokenizer.encode(prompt, add_special_tokens=True))
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt: token id {t!r} is not in [0, {self.vocab_size})")
        return ids

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    *, priority: int = 0, cache_salt: str | None = None,
                    arrival_time: float | None = None, hold_blocks: bool = False,
                    num_resumed_tokens: int = 0, lora: LoRARequest | None = None,
                    lora_digest: str | None = None) -> Request:
        """Validate and queue one request (params.n is handled by the caller).
        Raises ValueError naming the field; the engine state is untouched then.
        hold_blocks: keep the KV blocks after finishing until release()
        (a prefill worker sends them first).  num_resumed_tokens: the prompt's
        last tokens are output this request generated elsewhere (it migrated):
        its grammar resumes after them, penalties count them as output and a
        seeded RNG stands where it would after drawing them.  lora: the adapter to
        run with (lora_digest: the one a caller expects; a mismatch is refused)."""
        req = self.make_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                                arrival_time=arrival_time, hold_blocks=hold_blocks,
                                num_resumed_tokens=num_resumed_tokens, lora=lora, lora_digest=lora_digest)
        self.scheduler.add_request(req)
        self._detok[request_id] = IncrementalDetokenizer(self.text_tokenizer, req.prompt_token_ids, params)
        return req

    def make_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                     *, priority: int = 0, cache_salt: str | None = None,
                     arrival_time: float | None = None, hold_blocks: bool = False,
                     num_resumed_tokens: int = 0, lora: LoRARequest | None = None,
                     lora_digest: str | None = None) -> Request:
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: must be a SamplingParams")
        ids = self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens, max_model_len is {self.max_model_len}")
        if params.logit_bias:
            bad = [t for t in params.logit_bias if t >= self.vocab_size]
            if bad:
                raise ValueError(f"logit_bias: token id {bad[0]} is not in [0, {self.vocab_size})")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority: must be an integer, got {priority!r}")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if not 0 <= num_resumed_tokens < len(ids):
            raise ValueError(f"num_resumed_tokens: {num_resumed_tokens} is not in [0, {len(ids)})")
        grammar = None
        if params.guided is not None:
            grammar = self.grammars.matcher(params.guided, ids[len(ids) - num_resumed_tokens:])
        adapter = self.lora_adapter(lora, lora_digest)
        rng = random.Random(params.seed) if params.seed is not None else random.Random(self._rng.random())
        if params.seed is not None and not params.greedy:
            # Where the undisturbed run's RNG stood after the resumed tokens: one
            # draw per token (exact unless speculation drew extra for rejections).
            for _ in range(num_resumed_tokens):
                rng.random()
        return Request(request_id, ids, params, max_tokens=max_tokens, eos_token_ids=self.eos_token_ids,
                       priority=priority, arrival_time=arrival_time, rng=rng, hold_blocks=hold_blocks,
                       extra_keys=extra_keys(self.cache_model_key, cache_salt,
                                             adapter.digest if adapter else None),
                       grammar=grammar, lora=adapter, num_resumed_tokens=num_resumed_tokens)

    # -- LoRA -------------------------------------------------------------------

    def lora_adapter(self, lora: LoRARequest | None, digest: str | None = None) -> LoRAAdapter | None:
        """The loaded adapter for a request (loading it from its path on first
        use); ValueError naming the field when it cannot be had."""
        if lora is None:
            return None
        if self.runner.lora is None:
            raise ValueError(f"model: {lora.lora_name!r} is a LoRA adapter and this engine was "
                             f"started without LoRA (--enable-lora)")
        try:
            return self.runner.lora.get(lora, digest)
        except (OSError, RuntimeError) as e:  # unreadable or malformed safetensors
            raise ValueError(f"lora_path: cannot load {lora.lora_path!r}: {e}") from e

    def load_lora(self, lora: LoRARequest) -> str:
        """Load (or reload from its path) an adapter -> its digest."""
        if self.runner.lora is not None:
            self.runner.lora.unload(lora.lora_name)
        adapter = self.lora_adapter(lora)
        assert adapter is not None
        return adapter.digest

    def unload_lora(self, name: str) -> bool:
        """Requests in flight keep their adapter; new ones can no longer name it."""
        return self.runner.lora is not None and self.runner.lora.unload(name)

    def lora_names(self) -> list[str]:
        return [] if self.runner.lora is None else list(self.runner.lora.adapters)

    # -- the split --------------------------------------------------------------

    def reserve_remote(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                       *, priority: int = 0, cache_salt: str | None = None,
                       num_resumed_tokens: int = 0, lora: LoRARequest | None = None,
                       lora_digest: str | None = None) -> KVHandoff | None:
        """Decode worker: reserve blocks for a prompt whose KV a prefill worker
        will send; the handoff names them.  None: no room now (nothing changed)."""
        req = self.make_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                                num_resumed_tokens=num_resumed_tokens, lora=lora, lora_digest=lora_digest)
        block_ids = self.scheduler.reserve_remote(req)
        if block_ids is None:
            return None
        self._detok[request_id] = IncrementalDetokenizer(self.text_tokenizer, req.prompt_token_ids, params)
        adapter = req.lora  # the engine's LoRAAdapter, or None
        return KVHandoff(request_id, tuple(block_ids), req.num_computed_tokens // self.kv.block_size,
                         self.kv_layout,
                         lora=None if adapter is None else LoRARequest(adapter.name, adapter.path),
                         lora_digest="" if adapter is None else adapter.digest)

    def remote_kv_landed(self, request_id: str, first_token: SampledToken,
                         prompt_logprobs: list[PositionLogprobs] | None = None) -> StepOutput:
        """prompt_logprobs: what the prefill worker computed (entry i: prompt token i + 1)."""
        req = self.scheduler.remote_kv_landed(request_id, first_token)
        if req.prompt_logprobs is not None and prompt_logprobs is not None:
            req.prompt_logprobs = list(prompt_logprobs)
        return self._output(req, [first_token])

    def remote_kv_failed(self, request_id: str) -> None:
        self.scheduler.remote_kv_failed(request_id)

    def held_block_ids(self, request_id: str) -> list[int]:
        return self.kv.block_ids(request_id)

    def release(self, request_id: str) -> None:
        self.scheduler.release(request_id)

    def abort(self, request_id: str) -> bool:
        self._detok.pop(request_id, None)
        if self.spec is not None:
            self.spec.release(request_id, finished=True)
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        draft_probs = self.spec.draft_probs if self.spec is not None else None
        sampled, prompt_stats = self.runner.execute(plan, draft_probs)
        for rid, stats in prompt_stats.items():
            req = self.scheduler.requests.get(rid)
            if req is not None and req.prompt_logprobs is not None:  # else aborted meanwhile
                tokens = req.prompt_token_ids[len(req.prompt_logprobs) + 1:]
                req.prompt_logprobs += [self._position_logprobs(t, lp, rank, top)
                                        for t, (lp, rank, top) in zip(tokens, stats, strict=False)]
        for seq in plan.seqs:
            prompt_end = min(seq.start + seq.num_new_tokens, seq.request.num_prompt_tokens)
            self.prompt_tokens_computed += max(0, prompt_end - seq.start)
        before = {s.request.request_id: s.request.num_output_tokens for s in plan.seqs}
        changed = self.scheduler.update(plan, sampled)
        outs = []
        for req in changed:
            # A stop condition may have cut the accepted tokens short.
            toks = sampled[req.request_id][:req.num_output_tokens - before[req.request_id]]
            self.generation_tokens += len(toks)
            outs.append(self._output(req, toks))
        if self.spec is not None:
            self.spec.record(plan, sampled)
            self._release_spec_state([s.request for s in plan.seqs] + plan.preempted)
        return outs

    def _release_spec_state(self, reqs: list[Request]) -> None:
        """Draft state (a draft model's KV blocks) goes with finished and
        preempted requests; a preempted one catches up again when it resumes."""
        assert self.spec is not None
        for req in reqs:
            if req.status.finished or req.status == RequestStatus.PREEMPTED:
                self.spec.release(req.request_id, finished=req.status.finished)

    def _output(self, req: Request, toks: list[SampledToken]) -> StepOutput:
        """One request's delta.  Tokens go to the detokenizer one at a time,
        so a stop string ends the output at the same token as without
        speculation."""
        detok = self._detok[req.request_id]
        text = ""
        emitted: list[SampledToken] = []
        for tok in toks:
            emitted.append(tok)
            text += detok.push([tok.token_id])
            if detok.stop_reason is not None:
                break
        if detok.stop_reason is not None and not req.status.finished:
            req.stop_reason = detok.stop_reason
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        elif req.status.finished and detok.stop_reason is None:
            text += detok.flush()
        logprobs = None
        if req.params.logprobs is not None:
            logprobs = [self._position_logprobs(t.token_id, t.logprob, t.rank, t.top_logprobs)
                        for t in emitted]
        prompt_logprobs: PromptLogprobs | None = None
        if req.prompt_logprobs is not None:  # the first output: the prompt is all computed
            prompt_logprobs, req.prompt_logprobs = [None, *req.prompt_logprobs], None
        out = StepOutput(req.request_id, [t.token_id for t in emitted], text, logprobs,
                         finished=req.status.finished, finish_reason=req.status.finish_reason,
                         stop_reason=req.stop_reason, num_prompt_tokens=req.num_prompt_tokens,
                         num_cached_tokens=max(req.num_cached_tokens, 0),
                         queue_time=(req.first_scheduled_time or req.arrival_time) - req.arrival_time,
                         prompt_logprobs=prompt_logprobs)
        if req.status.finished:
            del self._detok[req.request_id]
        return out

    def _position_logprobs(self, token_id: int, logprob: float, rank: int,
                           top: dict[int, float]) -> PositionLogprobs:
        """The top alternatives ranked 1..k, and the position's own token with its rank."""
        out: PositionLogprobs = {}
        for r, (tid, lp) in enumerate(sorted(top.items(), key=lambda kv: -kv[1]), 1):
            out[tid] = Logprob(lp, r, self._token_text(tid))
        if token_id not in out:
            out[token_id] = Logprob(logprob, rank, self._token_text(token_id))
        return out

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.text_tokenizer.decode([token_id])
        return text


def _eos_ids(hf_cfg: dict, model_dir, tokenizer) -> frozenset[int]:  # type: ignore[no-untyped-def]
    ids: set[int] = set()
    gen = model_dir / "generation_config.json"
    for cfg in (hf_cfg, json.loads(gen.read_text()) if gen.exists() else {}):
        eos = cfg.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")
