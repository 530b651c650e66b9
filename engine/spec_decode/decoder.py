"""The engine's speculative decoding: what a step does around the scheduler.

    propose(running)   before schedule(): drafts for each decoding request
                       (Request.spec_token_ids), sized by adaptive k
    (schedule: 1 + k tokens per speculating request; runner: one target
     forward, then the rejection rule; update: accept, roll back the rest)
    record(plan, sampled)   metrics and each request's acceptance
    release(request_id)     a request finished or was preempted: free its
                            draft state (a draft model's KV blocks)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.scheduler import SchedulerOutput
from engine.spec_decode.adaptive import AdaptiveK, SpecDecodeStats
from engine.spec_decode.draft import Proposal


class Proposer(Protocol):
    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> dict[str, Proposal]: ...

    def free(self, request_id: str) -> None: ...


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        assert config.method is not None
        self.config = config
        self.proposer = proposer
        k = config.num_speculative_tokens
        self.adaptive = AdaptiveK(k, config.adaptive, config.min_acceptance_rate, config.probe_interval)
        self.stats = SpecDecodeStats(config.method, accepted_per_position=[0] * k)
        # Distributions of this step's sampled drafts, by request id.
        self.draft_probs: dict[str, Tensor] = {}

    def propose(self, running: Sequence[Request]) -> None:
        self.draft_probs = {}
        reqs, ks = [], []
        for req in running:
            req.spec_token_ids = []
            if req.params.disable_speculation or req.num_tokens - req.num_computed_tokens != 1:
                continue  # opted out, or still prefilling
            room = req.max_tokens - req.num_output_tokens - 1  # tokens after the next one
            if room < 1:
                continue
            k = min(self.adaptive.num_to_propose(req.request_id), room)
            if k > 0:
                reqs.append(req)
                ks.append(k)
        if not reqs:
            return
        by_id = {r.request_id: r for r in reqs}
        for rid, (drafts, probs) in self.proposer.propose(reqs, ks).items():
            by_id[rid].spec_token_ids = drafts
            if probs is not None:
                self.draft_probs[rid] = probs

    def record(self, plan: SchedulerOutput, sampled: Mapping[str, Sequence[Any]]) -> None:
        for seq in plan.seqs:
            num_drafts = len(seq.spec_token_ids)
            toks = sampled.get(seq.request.request_id)
            if num_drafts and toks:
                accepted = len(toks) - 1
                self.stats.record(num_drafts, accepted)
                self.adaptive.observe(seq.request.request_id, num_drafts, accepted)

    def release(self, request_id: str, finished: bool) -> None:
        self.proposer.free(request_id)
        if finished:
            self.adaptive.forget(request_id)


def check_speculative_config(config: SpeculativeConfig, target_hf_config: Mapping[str, Any],
                             tokenizer: Any) -> Path | None:
    """What can be checked before any weights load: the draft model exists
    and shares the target's vocabulary and tokenizer; layerskip leaves layers
    to skip.  Returns the draft model's directory (draft method only).
    Raises ValueError naming the field."""
    if config.method == "layerskip":
        n = target_hf_config["num_hidden_layers"]
        assert config.num_layers is not None
        if config.num_layers >= n:
            raise ValueError(f"speculative_config.num_layers: must be below the target's {n} layers, "
                             f"got {config.num_layers}")
    if config.method != "draft":
        return None
    from engine.models.loader import load_text_tokenizer, resolve_model

    try:
        draft_dir = resolve_model(config.model)
    except FileNotFoundError as e:
        raise ValueError(f"speculative_config.model: {e}") from e
    draft_cfg = json.loads((draft_dir / "config.json").read_text())
    for key in ("vocab_size",):
        if draft_cfg.get(key) != target_hf_config.get(key):
            raise ValueError(f"speculative_config.model: the draft's {key} ({draft_cfg.get(key)}) differs "
                             f"from the target's ({target_hf_config.get(key)}); a draft must share the "
                             f"target's tokenizer")
    if any((draft_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        draft_vocab, target_vocab = load_text_tokenizer(draft_dir).get_vocab(), tokenizer.get_vocab()
        if draft_vocab != target_vocab:
            diff = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()))
            raise ValueError(f"speculative_config.model: the draft's tokenizer differs from the target's "
                             f"(e.g. {diff[0] if diff else 'in size'}); a draft must share the tokenizer")
    return draft_dir


def make_speculative_decoder(config: SpeculativeConfig, runner: Any,
                             draft_dir: Path | None = None) -> SpeculativeDecoder:
    """The configured proposer over the target's runner (after
    check_speculative_config)."""
    if config.method == "ngram":
        from engine.spec_decode.ngram import NgramProposer

        return SpeculativeDecoder(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))
    from engine.spec_decode.draft import DraftProposer

    if config.method == "layerskip":
        assert config.num_layers is not None
        model = runner.model.first_layers(config.num_layers)
    else:
        assert draft_dir is not None
        model = runner.load_model(draft_dir)
    proposer = DraftProposer(model, runner.num_blocks, runner.block_size, runner.device, runner.dtype,
                             runner.attn)
    return SpeculativeDecoder(config, proposer)
