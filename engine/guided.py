"""Structured output on the worker: grammars compiled with xgrammar, one
matcher per request, token bitmasks per step.

Why xgrammar (measured on this 2-core CPU, SmolLM2's 49152-token vocabulary,
a nested schema with bounds, enums, a pattern and an optional object):
compile 19 ms (llguidance 4 ms, outlines-core 413 ms), mask fill 0.01 ms per
token on average, 0.15 ms worst (llguidance 0.23 / 3.8 ms), and its matcher
rolls back, which verifying speculative drafts needs.  It imports torch, so
only workers load it; the frontend validates specs with engine.vocab.guided_params.

Bitmask: [rows, ceil(V / 32)] int32, bit t % 32 of word t // 32 set = token t
allowed (xgrammar's layout; engine.sampler applies it).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from engine.vocab.guided_params import GuidedDecoding

log = logging.getLogger(__name__)

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the message.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class Grammar:
    """One request's grammar state: accepts the tokens the request emits."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size

    def accept(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return bool(self._m.is_terminated())

    def fill_with_drafts(self, bitmask: torch.Tensor, first_row: int, drafts: Sequence[int]) -> None:
        """Masks for the position after the last token and after each draft
        (rows first_row .. first_row + len(drafts)).  A draft the grammar
        refuses gets a mask without it, so verification rejects it; the rows
        after it (or after a stop token) are never used (left all-allowed).  The matcher ends where it
        started: drafts are rolled back."""
        accepted = 0
        for j in range(len(drafts) + 1):
            self.fill(bitmask, first_row + j)
            if j == len(drafts) or not self.accept(drafts[j]):
                break
            accepted += 1
            if self.terminated:  # a stop-token draft: nothing follows it
                break
        self.rollback(accepted)


class GrammarCompiler:
    """Compiles specs once per (kind, spec) (xgrammar caches compiled grammars)
    and makes matchers.  Thread-safe: servicers compile off the engine thread."""

    def __init__(self, tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: Iterable[int],
                 max_threads: int = 1) -> None:
        self._tokenizer = tokenizer  # -> transformers' tokenizer (loaded with the first grammar)
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._max_threads = max_threads
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        # The tokenizer info takes ~0.2 s (and transformers' tokenizer ~1 s to
        # load): built on the first grammar, not at start.
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer(), vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads)
            return self._compiler

    def compile(self, guided: GuidedDecoding) -> Any:
        """-> the compiled grammar; ValueError("guided: ...") when the engine refuses the spec."""
        compiler = self._get()
        try:
            if guided.kind == "json":
                # Compact JSON: with free whitespace a small model can emit newlines forever.
                return compiler.compile_json_schema(guided.spec, any_whitespace=False)
            if guided.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if guided.kind == "regex":
                return compiler.compile_regex(guided.spec)
            if guided.kind == "choice":
                alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in guided.choices)
                return compiler.compile_grammar(f"root ::= {alts}")
            return compiler.compile_grammar(guided.spec)
        except RuntimeError as e:
            msg = _CPP_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else "")
            raise ValueError(f"guided.{guided.kind}: the grammar engine refused it: {msg}") from None

    def matcher(self, guided: GuidedDecoding, resumed: Sequence[int] = ()) -> Grammar:
        """A fresh matcher, advanced over `resumed` (tokens this request
        generated before it moved here)."""
        import xgrammar as xgr

        grammar = Grammar(xgr.GrammarMatcher(self.compile(guided), override_stop_tokens=self.stop_token_ids),
                          self.vocab_size)
        for i, t in enumerate(resumed):
            if not grammar.accept(t):
                raise ValueError(f"guided: resumed output token {i} ({t}) does not match the grammar")
        return grammar


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """All tokens allowed: -1 is every bit set."""
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)
