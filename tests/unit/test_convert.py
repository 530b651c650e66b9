import pytest

from engine.sampling_params import SamplingParams
from protos import pb
from services.convert import sampling_from_proto, sampling_to_proto


def test_round_trip_keeps_every_field() -> None:
    p = SamplingParams(n=2, temperature=0.0, top_p=0.5, top_k=7, min_p=0.1, repetition_penalty=1.2,
                       presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={3: 2.0}, seed=0,
                       stop=["a", "bc"], stop_token_ids=[5], ignore_eos=True, min_tokens=2,
                       max_tokens=9, logprobs=0, include_stop_str_in_output=True,
                       skip_special_tokens=False)
    q = sampling_from_proto(sampling_to_proto(p))
    assert q == p


def test_unset_fields_take_engine_defaults() -> None:
    assert sampling_from_proto(pb.SamplingParams()) == SamplingParams()


def test_bad_values_name_the_field() -> None:
    with pytest.raises(ValueError, match="top_p"):
        sampling_from_proto(pb.SamplingParams(top_p=2.0))
