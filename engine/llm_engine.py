"""One engine: tokenizer, scheduler, KV cache manager and model runner in one loop."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import replace

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.guided import GrammarCompiler
from engine.hashing import cache_model_key, extra_keys
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.models.loader import load_tokenizer, model_id, model_name, resolve_model
from engine.outputs import Logprob, PositionLogprobs, StepOutput
from engine.request import Request, RequestStatus
from engine.sampler import SampledToken
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.spec_decode.decoder import (
    SpeculativeDecoder,
    check_speculative_config,
    make_speculative_decoder,
)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        model_dir = resolve_model(config.model.model)
        self.model_name = model_name(config.model.model)  # what metrics and users call it
        self.model_id = model_id(config.model.model)  # name + weights digest: identity between workers
        self.tokenizer = load_tokenizer(model_dir)
        hf_cfg = json.loads((model_dir / "config.json").read_text())
        # Before the weights load: a configuration that cannot work fails fast.
        draft_dir = check_speculative_config(config.speculative, hf_cfg, self.tokenizer)
        self.runner = ModelRunner(model_dir, config.model, config.cache)
        spec = self.runner.spec
        max_len = min(config.scheduler.max_model_len, spec.max_position_embeddings)
        self.config = replace(config, scheduler=replace(config.scheduler, max_model_len=max_len))
        self.vocab_size = spec.vocab_size
        self.eos_token_ids = _eos_ids(hf_cfg, model_dir, self.tokenizer)
        # Block hashes: blocks of other weights, dtypes or KV dtypes never match.
        self.cache_model_key = cache_model_key(self.model_id, _dtype_name(self.runner.dtype),
                                               _dtype_name(self.runner.kv_dtype))
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                 config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler, self.kv)
        self.spec: SpeculativeDecoder | None = None
        if config.speculative.enabled:
            self.spec = make_speculative_decoder(config.speculative, self.runner, draft_dir)
        # Structured output; xgrammar loads with the first request that has a grammar.
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._rng = random.Random(config.model.seed)
        # Monotonic counters for metrics and tests.
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0
        self._detok: dict[str, IncrementalDetokenizer] = {}

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
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
                    num_resumed_tokens: int = 0) -> Request:
        """Validate and queue one request (params.n is handled by the caller).
        Raises ValueError naming the field; the engine state is untouched then.
        hold_blocks: keep the KV blocks after finishing until release()
        (a prefill worker sends them first).  num_resumed_tokens: the prompt's
        last tokens are output this request generated elsewhere (it migrated);
        its grammar resumes after them."""
        req = self.make_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                                arrival_time=arrival_time, hold_blocks=hold_blocks,
                                num_resumed_tokens=num_resumed_tokens)
        self.scheduler.add_request(req)
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params)
        return req

    def make_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                     *, priority: int = 0, cache_salt: str | None = None,
                     arrival_time: float | None = None, hold_blocks: bool = False,
                     num_resumed_tokens: int = 0) -> Request:
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
        rng = random.Random(params.seed) if params.seed is not None else random.Random(self._rng.random())
        return Request(request_id, ids, params, max_tokens=max_tokens, eos_token_ids=self.eos_token_ids,
                       priority=priority, arrival_time=arrival_time, rng=rng, hold_blocks=hold_blocks,
                       extra_keys=extra_keys(self.cache_model_key, cache_salt), grammar=grammar)

    # -- the split --------------------------------------------------------------

    def reserve_remote(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                       *, priority: int = 0, cache_salt: str | None = None,
                       num_resumed_tokens: int = 0) -> Request | None:
        """Decode worker: reserve blocks for a prompt whose KV a prefill worker
        will send.  None: no room now (nothing changed).  The request's block
        table is `self.kv.block_ids(request_id)`; blocks from
        num_computed_tokens // block_size on are the ones to fill."""
        req = self.make_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                                num_resumed_tokens=num_resumed_tokens)
        if self.scheduler.reserve_remote(req) is None:
            return None
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params)
        return req

    def remote_kv_landed(self, request_id: str, first_token: SampledToken) -> StepOutput:
        req = self.scheduler.remote_kv_landed(request_id, first_token)
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
        sampled = self.runner.execute(plan, self.spec.draft_probs if self.spec is not None else None)
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
            logprobs = [self._position_logprobs(tok) for tok in emitted]
        out = StepOutput(req.request_id, [t.token_id for t in emitted], text, logprobs,
                         finished=req.status.finished, finish_reason=req.status.finish_reason,
                         stop_reason=req.stop_reason, num_prompt_tokens=req.num_prompt_tokens,
                         num_cached_tokens=max(req.num_cached_tokens, 0),
                         queue_time=(req.first_scheduled_time or req.arrival_time) - req.arrival_time)
        if req.status.finished:
            del self._detok[req.request_id]
        return out

    def _position_logprobs(self, tok: SampledToken) -> PositionLogprobs:
        out: PositionLogprobs = {}
        for rank, (tid, lp) in enumerate(sorted(tok.top_logprobs.items(), key=lambda kv: -kv[1]), 1):
            out[tid] = Logprob(lp, rank, self.tokenizer.decode([tid]))
        if tok.token_id not in out:
            out[tok.token_id] = Logprob(tok.logprob, tok.rank, self.tokenizer.decode([tok.token_id]))
        return out


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
