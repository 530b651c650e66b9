"""Speculative decoding flags, shared by the decode worker and `splitserve up`.
Torch-free: the launcher parses them without loading the engine.

Either individual flags or one JSON `--speculative-config` in vLLM's shape;
flags given on top override the JSON's keys.
"""

from __future__ import annotations

import argparse
import json

from engine.config import SPECULATIVE_METHODS, SpeculativeConfig
from services.help_format import given_argv

# flag dest -> SpeculativeConfig field
FLAG_FIELDS = {
    "speculative_method": "method",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_min": "prompt_lookup_min",
    "prompt_lookup_max": "prompt_lookup_max",
    "draft_model": "model",
    "speculative_num_layers": "num_layers",
}


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (decode workers)")
    g.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default=None,
                   help="proposer: ngram (prompt lookup), draft (--draft-model), layerskip (first layers)")
    g.add_argument("--num-speculative-tokens", type=int, default=None, help="draft tokens per step (k)")
    g.add_argument("--prompt-lookup-min", type=int, default=None, help="ngram: shortest n-gram matched")
    g.add_argument("--prompt-lookup-max", type=int, default=None, help="ngram: longest n-gram matched")
    g.add_argument("--draft-model", default=None, help="draft: model directory or .gguf (same tokenizer)")
    g.add_argument("--speculative-num-layers", type=int, default=None,
                   help="layerskip: target layers that make up the draft")
    g.add_argument("--no-adaptive-speculation", action="store_true",
                   help="always propose k tokens, however poorly they are accepted")
    g.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig:
    """Raises ValueError naming the field."""
    fields: dict[str, object] = {}
    raw = getattr(args, "speculative_config", None)
    if raw:
        try:
            fields = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e})") from e
        if not isinstance(fields, dict):
            raise ValueError("speculative_config: must be a JSON object")
    for dest, name in FLAG_FIELDS.items():
        value = getattr(args, dest, None)
        if value is not None:
            fields[name] = value
    if getattr(args, "no_adaptive_speculation", False):
        fields["adaptive"] = False
    return SpeculativeConfig.from_dict(fields)


def speculative_argv(args: argparse.Namespace) -> list[str]:
    """The speculative flags as given, to pass on to a decode worker."""
    return given_argv(args, (*FLAG_FIELDS, "speculative_config"), switches=("no_adaptive_speculation",))
