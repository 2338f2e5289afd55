"""The one input processor every front end uses (LLM, the server, AsyncLLM), and the typed
message that crosses to an engine core."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

import shardserve
from shardserve.engine.config_builder import engine_config_from_kwargs
from shardserve.engine.input_processor import EngineCoreRequest, InputProcessor
from shardserve.engine.request import Request
from shardserve.model.loader import load_tokenizer
from shardserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def inputs(tiny_llama_dir) -> InputProcessor:
    config = engine_config_from_kwargs(str(tiny_llama_dir), dtype="float32", max_model_len=16)
    return InputProcessor(config, load_tokenizer(config.model_config.tokenizer_path))


def test_prompt_forms(inputs):
    text, ids = inputs.process_prompt("hello there")
    assert text == "hello there" and ids == inputs.tokenizer.encode("hello there")
    assert inputs.process_prompt({"prompt": "hello there"}) == (text, ids)
    assert inputs.process_prompt({"prompt_token_ids": [3, 4]}) == (None, [3, 4])
    assert inputs.process_prompt([5, 6]) == (None, [5, 6])


@pytest.mark.parametrize("prompt, message", [
    ([], r"prompt is empty"),
    (list(range(1, 18)), r"17 tokens, longer than max_model_len=16"),
    ([1, 10**6], r"\[1000000\], outside the vocabulary"),
    (3.5, r"prompt of type float is not supported"),
])
def test_bad_prompts_name_the_problem(inputs, prompt, message):
    with pytest.raises(ValueError, match=message):
        inputs.process_prompt(prompt)


def test_fan_out_gives_each_child_its_id_and_seed(inputs):
    req = inputs.process("r", [1, 2, 3], SamplingParams(n=3, seed=10, max_tokens=2))
    assert list(req.children) == ["r#0", "r#1", "r#2"]
    assert [p.seed for p in req.children.values()] == [10, 11, 12]
    assert all(p.n == 1 for p in req.children.values())
    single = inputs.process("s", "hi", SamplingParams(max_tokens=2))
    assert list(single.children) == ["s"]
    with pytest.raises(ValueError, match="sampling_params must be SamplingParams"):
        inputs.process("t", "hi", {"max_tokens": 2})  # type: ignore[arg-type]


def test_core_request_crosses_as_a_plain_message(inputs):
    req = inputs.process("r", [1, 2, 3], SamplingParams(n=2, max_tokens=2))
    messages = req.core_requests()
    assert [m.request_id for m in messages] == ["r#0", "r#1"]
    back = pickle.loads(pickle.dumps(messages[0]))
    assert isinstance(back, EngineCoreRequest) and back == messages[0]
    core_side = back.to_request()
    assert isinstance(core_side, Request) and core_side.prompt_token_ids == [1, 2, 3]
    assert core_side.eos_token_ids == inputs.config.model_config.arch.eos_token_ids


def test_front_ends_share_it(tiny_llama_dir):
    """LLM's engine checks with the same processor type; the server's API process builds no
    engine-internal Request (it imports neither the request module nor LLMEngine)."""
    llm = shardserve.LLM(str(tiny_llama_dir), dtype="float32", max_model_len=16)
    try:
        assert isinstance(llm.engine.inputs, InputProcessor)
        with pytest.raises(ValueError, match="longer than max_model_len=16"):
            llm.generate([list(range(1, 18))], SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        llm.shutdown()
    source = Path(shardserve.__file__).parent / "engine" / "async_engine.py"
    imported = {node.module for node in ast.walk(ast.parse(source.read_text()))
                if isinstance(node, ast.ImportFrom)}
    assert "shardserve.engine.request" not in imported
    assert "shardserve.engine.llm_engine" not in imported


def test_bad_words_become_token_sequences_for_the_workers(inputs):
    tok = inputs.tokenizer
    params = SamplingParams(bad_words=["quick brown", " fox"], bad_words_token_ids=[[7, 8]])
    req = inputs.process("r", "hi", params)
    sequences = req.children["r"].bad_words_token_ids
    want = [[7, 8]]
    for text in ("quick brown", " quick brown", "fox", " fox"):
        ids = tok.encode(text, add_special_tokens=False)
        if ids not in want:
            want.append(ids)
    assert sequences == want
    assert params.bad_words_token_ids == [[7, 8]]  # the caller's object is not changed
    pickle.loads(pickle.dumps(req.core_requests()[0]))


def test_truncate_prompt_tokens_before_the_length_check(inputs):
    long = list(range(3, 23))  # 20 tokens, max_model_len is 16
    assert inputs.process_prompt(long, 5) == (None, long[-5:])
    assert inputs.process_prompt(long, -1) == (None, long[-16:])
    assert inputs.process("r", long, SamplingParams(truncate_prompt_tokens=4)) \
        .prompt_token_ids == long[-4:]
    assert inputs.process("s", (None, long[:10]), SamplingParams(truncate_prompt_tokens=3)) \
        .prompt_token_ids == long[7:10]


def test_token_ids_outside_the_vocabulary_name_the_id(inputs):
    vocab = inputs.vocab_size
    for params, name in ((SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
                         (SamplingParams(allowed_token_ids=[1, vocab + 5]), "allowed_token_ids")):
        with pytest.raises(ValueError, match=rf"{name} contains token id \d+, outside the "
                                             rf"vocabulary \[0, {vocab}\)"):
            inputs.process("r", "hi", params)
