from __future__ import annotations

import pickle

import pytest

from shardserve.sampling_params import SamplingParams, SamplingType

INVALID = [
    ("temperature", -1.0),
    ("temperature", "hot"),
    ("temperature", float("nan")),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.1),
    ("top_k", -2),
    ("top_k", 2.5),
    ("top_k", True),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("n", 0),
    ("n", "2"),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 3.0),
    ("min_tokens", -1),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.1),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("logprobs", -1),
    ("logprobs", 21),
    ("seed", 1.5),
    ("seed", "42"),
    ("stop_token_ids", [3, -1]),
    ("stop_token_ids", ["a"]),
    ("ignore_eos", "yes"),
    ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", -2),
    ("truncate_prompt_tokens", 2.5),
    ("detokenize", "no"),
    ("allowed_token_ids", [3, -1]),
    ("allowed_token_ids", [3, "x"]),
    ("bad_words", ["a", 3]),
    ("bad_words_token_ids", [[1], []]),
]


@pytest.mark.parametrize(("name", "value"), INVALID)
def test_invalid_value_names_field_and_value(name: str, value: object) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**{name: value})
    message = str(info.value)
    assert name in message
    bad = value[-1] if isinstance(value, list) else value
    assert repr(bad) in message or str(bad) in message


def test_range_message_states_valid_range() -> None:
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1.0"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match=r"min_tokens.*max_tokens.*got 9"):
        SamplingParams(max_tokens=8, min_tokens=9)
    assert SamplingParams(max_tokens=8, min_tokens=8).min_tokens == 8
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100


@pytest.mark.parametrize("stop", [[""], ["ok", ""], ""])
def test_stop_with_empty_string(stop: object) -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=stop)


def test_stop_wrong_types() -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["a", 3])
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=5)


def test_valid_edges() -> None:
    p = SamplingParams(top_p=1, temperature=0, top_k=-1, min_p=1.0, logprobs=20, seed=-3)
    assert p.top_p == 1.0 and isinstance(p.top_p, float)
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.top_k == -1 and not p.top_k_enabled
    SamplingParams(presence_penalty=2, frequency_penalty=-2, logprobs=0, max_tokens=1)


def test_stop_normalised() -> None:
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams().stop == []
    assert SamplingParams().stop_token_ids == []
    assert SamplingParams(stop_token_ids=(5, 6)).stop_token_ids == [5, 6]


def test_defaults_and_sampling_type() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy
    assert SamplingParams(temperature=0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(temperature=0, seed=1).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0.7, seed=1).sampling_type is SamplingType.RANDOM_SEED


def test_has_penalties() -> None:
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties


def test_pickle_roundtrip() -> None:
    p = SamplingParams(max_tokens=32, temperature=0.5, stop="end", seed=7, logprobs=3)
    assert pickle.loads(pickle.dumps(p)) == p
