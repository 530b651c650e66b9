"""`from engine.sampling_params import SamplingParams`, as `LLM` users write it.
The class lives in the torch-free vocabulary, engine/vocab/sampling_params.py."""

from engine.vocab.sampling_params import MAX_LOGPROBS, SAMPLING_EPS, SamplingParams

__all__ = ["MAX_LOGPROBS", "SAMPLING_EPS", "SamplingParams"]
