"""Incremental detokenization for streaming, with stop strings.

Offset-based, as in vLLM / TGI: each step decodes only a short window,
ids[prefix_offset:], and diffs it against ids[prefix_offset:read_offset]. The
window starts a few tokens back so tokenizers that strip a word's leading
space at the start of a decode, or that merge across tokens, see context.

Three kinds of text:

    released   returned by push()/flush(); never taken back
    held       decoded, but its tail could still grow into a stop string
    pending    token ids whose decode ends in an incomplete UTF-8 sequence (U+FFFD)

text = released + held. Only flush() releases pending text as it decodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.stop_strings import StopMatcher
from engine.vocab.sampling_params import SamplingParams

# Prompt tokens kept as decode context for the first output token.
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


def decode_window(
    tokenizer: Any, ids: Sequence[int], prefix_offset: int, read_offset: int,
    skip_special_tokens: bool, *, final: bool = False,
) -> tuple[str, int, int]:
    """-> (new text, prefix_offset, read_offset).

    Text is new when the window decodes longer than its prefix and doesn't end in
    U+FFFD (an incomplete multi-byte sequence that later tokens may complete);
    `final` takes it anyway. Offsets only move forward when text is emitted.
    """
    prefix_text = tokenizer.decode(ids[prefix_offset:read_offset], skip_special_tokens=skip_special_tokens)
    full_text = tokenizer.decode(ids[prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(full_text) > len(prefix_text) and (final or not full_text.endswith(REPLACEMENT_CHAR)):
        return full_text[len(prefix_text):], read_offset, len(ids)
    return "", prefix_offset, read_offset


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._ids: list[int] = context  # decode context: prompt tail + all output ids
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._released = 0  # chars of self.text already returned
        self.text = ""
        self.stop_reason: str | None = None
        self.output_token_ids: list[int] = []
        self._stops = StopMatcher(params.stop_strings) if params.stop_strings else None

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    def push(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; -> text delta that is now safe to stream."""
        if self.finished or not token_ids:
            return ""
        self.output_token_ids.extend(token_ids)
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At finish: -> everything not yet released, up to a stop string if one hits."""
        if self.finished:
            return ""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        new_text, self._prefix_offset, self._read_offset = decode_window(
            self.tokenizer, self._ids, self._prefix_offset, self._read_offset,
            self.params.skip_special_tokens, final=final,
        )
        stops = self._stops
        if new_text:
            self.text += new_text
            hit = stops.feed(new_text) if stops is not None else None
            if hit is not None:
                index, stop = hit
                self.stop_reason = stop
                end = index + len(stop) if self.params.include_stop_str_in_output else index
                self.text = self.text[:end]
                return self._release(len(self.text))
        held = 0 if final or stops is None else stops.held()
        return self._release(len(self.text) - held)

    def _release(self, upto: int) -> str:
        delta = self.text[self._released:upto] if upto > self._released else ""
        self._released = max(self._released, upto)
        return delta
