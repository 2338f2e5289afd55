"""Incremental detokenization and tail-only stop-string search: token by token, the text equals
a whole decode of the tokens (multi-byte characters included), a stop string that straddles two
steps is found where a whole-text search finds it, and no step decodes the whole output."""

from __future__ import annotations

import pytest

from shardserve.engine.output_processor import OutputProcessor
from shardserve.messages import EngineCoreOutput
from shardserve.model.loader import default_model_path, load_tokenizer
from shardserve.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "naïve café — déjà vu; 東京は日本の首都です。 🚀🔥👍🏽 end",
    "def f(x):\n    return x ** 2  # squares\n\n\ttabs\tand  spaces  ",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def _stream(tokenizer, ids: list[int], params: SamplingParams) -> list[str]:
    proc = OutputProcessor(tokenizer, stream=True)
    proc.add_request("r", None, [1], {"r": params})
    texts = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        results, _ = proc.process(
            [EngineCoreOutput("r", [token], finish_reason="length" if last else None)]
        )
        texts.append(results[0].outputs[0].text)
        if results[0].finished:
            break
    return texts


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_a_whole_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    texts = _stream(tokenizer, ids, SamplingParams(max_tokens=len(ids)))
    assert texts[-1] == tokenizer.decode(ids, skip_special_tokens=True)
    for i, t in enumerate(texts):  # every prefix shown is a prefix of the final text
        assert texts[-1].startswith(t), (i, t)
        assert "\ufffd" not in t  # a split multi-byte character waits for its next token


def test_a_stop_string_across_steps_is_found_where_a_whole_search_finds_it(tokenizer):
    text = TEXTS[1]
    ids = tokenizer.encode(text)
    for stop in ("東京", "vu; 東", "🔥👍", "end"):
        texts = _stream(tokenizer, ids, SamplingParams(max_tokens=len(ids), stop=[stop]))
        full = tokenizer.decode(ids, skip_special_tokens=True)
        assert texts[-1] == full[: full.index(stop)], stop


def test_a_step_decodes_only_a_window(tokenizer):
    """The cost of a step does not grow with the output: every decode call sees a few tokens."""
    seen: list[int] = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            seen.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer.encode(TEXTS[0] * 20)
    _stream(Counting(), ids, SamplingParams(max_tokens=len(ids)))
    assert len(ids) > 200 and max(seen) <= 8, max(seen)


def test_the_default_tokenizer_streams_through_a_decode_stream(tokenizer):
    """The fast path is taken for the default model's tokenizer (no per-step wrapper decode)."""
    assert OutputProcessor(tokenizer)._fast is tokenizer._tokenizer


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_and_a_cut_character_at_the_end_match_a_whole_decode(tokenizer, skip):
    eos = tokenizer.eos_token_id
    emoji = tokenizer.encode("go 🚀🔥")
    cases = [
        tokenizer.encode("Hi there") + [eos],  # finished by a special token
        tokenizer.encode("a") + [eos] + tokenizer.encode(" b c"),  # one in the middle
        emoji[:-1],  # ends inside a multi-byte character: U+FFFD, as a whole decode gives
    ]
    for ids in cases:
        texts = _stream(tokenizer, ids, SamplingParams(max_tokens=len(ids),
                                                       skip_special_tokens=skip))
        assert texts[-1] == tokenizer.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("interval", [1, 3, 8])
def test_stream_interval_hands_out_the_first_token_then_every_n_and_the_end(tokenizer, interval):
    ids = tokenizer.encode(TEXTS[0] * 2)
    proc = OutputProcessor(tokenizer, stream=True, stream_interval=interval)
    proc.add_request("r", None, [1], {"r": SamplingParams(max_tokens=len(ids))})
    handed = []  # the number of tokens in each output handed out
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        results, _ = proc.process(
            [EngineCoreOutput("r", [token], finish_reason="length" if last else None)])
        handed += [len(r.outputs[0].token_ids) for r in results]
    expected = [1, *range(1 + interval, len(ids), interval)]
    if expected[-1] != len(ids):
        expected.append(len(ids))
    assert handed == expected
    assert results[0].outputs[0].text == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_stream_interval_below_one_is_refused(tokenizer):
    with pytest.raises(ValueError, match="stream_interval=0 must be >= 1"):
        OutputProcessor(tokenizer, stream=True, stream_interval=0)


def test_logprobs_zero_still_gives_the_sampled_tokens_logprob(tokenizer):
    """OpenAI's logprobs=0: no alternatives, but the chosen token's logprob (it was dropped)."""
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1], {"r": SamplingParams(max_tokens=1, logprobs=0)})
    results, _ = proc.process([EngineCoreOutput("r", [42], finish_reason="length",
                                                new_logprobs=[{42: (-0.5, 3)}])])
    (entry,) = results[0].outputs[0].logprobs
    assert entry[42].logprob == -0.5 and entry[42].rank == 3
    assert results[0].outputs[0].cumulative_logprob == -0.5


def test_a_sibling_stopped_by_a_stop_string_stays_finished_when_late_tokens_arrive(tokenizer):
    """n = 2, async scheduling: the engine's next step was already under way when the output
    processor found child a's stop string, so a's token of that step still arrives (and after
    it, with the abort, nothing). a stays finished, and the request ends with b."""
    proc = OutputProcessor(tokenizer, stream=False)
    params = SamplingParams(max_tokens=8, stop=[" "])
    proc.add_request("r", None, [1], {"a": params, "b": params})
    word, space = tokenizer.encode("Hello"), tokenizer.encode(" world")
    _, abort = proc.process([EngineCoreOutput("a", word + space[:1]),
                             EngineCoreOutput("b", word)])
    assert abort == ["a"]
    results, abort = proc.process([EngineCoreOutput("a", space[1:] or word),
                                   EngineCoreOutput("b", word, finish_reason="length")])
    assert abort == []
    assert [r.finished for r in results] == [True]
    assert [c.finish_reason for c in results[0].outputs] == ["stop", "length"]
    assert results[0].outputs[0].text == "Hello"
    assert not proc.has_unfinished()
