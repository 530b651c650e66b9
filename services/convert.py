"""The one place where protobuf messages and engine dataclasses meet.  Torch-free."""

from __future__ import annotations

from typing import Any

from engine.vocab.guided_params import GuidedDecoding
from engine.vocab.logprobs import Logprob, PositionLogprobs, PromptLogprobs
from engine.vocab.lora_request import LoRARequest
from engine.vocab.sampling_params import SamplingParams
from protos import pb

_OPTIONAL = ("n", "temperature", "top_p", "repetition_penalty", "seed", "max_tokens", "logprobs",
             "skip_special_tokens", "prompt_logprobs")
_PLAIN = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "ignore_eos", "min_tokens",
          "include_stop_str_in_output", "disable_speculation")


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        top_k=p.top_k, min_p=p.min_p, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, ignore_eos=p.ignore_eos, min_tokens=p.min_tokens,
        include_stop_str_in_output=p.include_stop_str_in_output,
        disable_speculation=p.disable_speculation,
        stop=list(p.stop_strings), stop_token_ids=list(p.stop_token_ids or ()),
        logit_bias={int(k): float(v) for k, v in (p.logit_bias or {}).items()})
    for name in _OPTIONAL:
        value = getattr(p, name)
        if value is not None:
            setattr(msg, name, value)
    if p.guided is not None:
        msg.guided.CopyFrom(guided_to_proto(p.guided))
    return msg


def guided_to_proto(g: GuidedDecoding) -> pb.GuidedDecoding:
    if g.kind == "json":
        return pb.GuidedDecoding(json_schema=g.spec)
    if g.kind == "json_object":
        return pb.GuidedDecoding(json_object=True)
    if g.kind == "choice":
        return pb.GuidedDecoding(choice=pb.GuidedDecoding.Choices(choices=g.choices))
    if g.kind == "regex":
        return pb.GuidedDecoding(regex=g.spec)
    return pb.GuidedDecoding(grammar=g.spec)


def guided_from_proto(msg: pb.GuidedDecoding) -> GuidedDecoding | None:
    """Raises ValueError naming the field (sampling.guided.<kind>...)."""
    which = msg.WhichOneof("spec")
    field = f"sampling.guided.{which}"
    if which is None:
        return None
    if which == "json_schema":
        return GuidedDecoding.json_schema(msg.json_schema, field)
    if which == "json_object":
        return GuidedDecoding("json_object") if msg.json_object else None
    if which == "regex":
        return GuidedDecoding.regex(msg.regex, field)
    if which == "choice":
        return GuidedDecoding.choice(list(msg.choice.choices), f"{field}.choices")
    return GuidedDecoding.grammar(msg.grammar, field)


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the field for out-of-range values."""
    kw: dict[str, Any] = {name: getattr(msg, name) for name in _PLAIN}
    for name in _OPTIONAL:
        if msg.HasField(name):
            kw[name] = getattr(msg, name)
    if msg.stop:
        kw["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kw["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.logit_bias:
        kw["logit_bias"] = dict(msg.logit_bias)
    if msg.HasField("guided"):
        kw["guided"] = guided_from_proto(msg.guided)
    return SamplingParams(**kw)


def logprobs_to_proto(token_id: int, pos: PositionLogprobs) -> pb.TokenLogprobs:
    chosen = pos[token_id]
    top = [pb.TopLogprob(token_id=t, logprob=lp.logprob, token=lp.decoded_token or "", rank=lp.rank or 0)
           for t, lp in sorted(pos.items(), key=lambda kv: -kv[1].logprob)]
    return pb.TokenLogprobs(token_id=token_id, logprob=chosen.logprob, rank=chosen.rank or 0,
                            token=chosen.decoded_token or "", top=top)


def lora_from_proto(msg: pb.LoRAAdapter | None) -> tuple[LoRARequest | None, str | None]:
    """-> (the adapter, the digest the sender expects); (None, None): the base
    model.  ValueError naming the field."""
    if msg is None or not msg.name:
        return None, None
    return LoRARequest(msg.name, msg.path), msg.digest or None


def logprobs_from_proto(msg: pb.TokenLogprobs) -> PositionLogprobs:
    """The inverse of logprobs_to_proto: every entry of `top`, and the position's own token."""
    pos = {t.token_id: Logprob(t.logprob, t.rank or None, t.token) for t in msg.top}
    pos[msg.token_id] = Logprob(msg.logprob, msg.rank or None, msg.token)
    return pos


def prompt_logprobs_to_proto(prompt_ids: list[int], entries: PromptLogprobs) -> list[pb.TokenLogprobs]:
    """vLLM's list (first entry None) -> one TokenLogprobs per prompt token after the first."""
    if not entries:
        return []
    return [logprobs_to_proto(t, pos) for t, pos in zip(prompt_ids[1:], entries[1:], strict=True)
            if pos is not None]
