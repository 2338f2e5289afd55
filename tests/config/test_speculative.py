"""speculative_config: vLLM's defaults and rules, the refusals and their messages, and the option's
way in from LLM(...) keywords and the command line (shardserve/config/speculative.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardserve.config import EngineConfig, ModelArch, ModelConfig, SchedulerConfig
from shardserve.config.engine import group_options
from shardserve.config.speculative import SpeculativeConfig
from shardserve.entrypoints import cli

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def model_config(**options) -> ModelConfig:
    arch = ModelArch("LlamaForCausalLM", vocab_size=64, hidden_size=16, intermediate_size=32,
                     num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                     max_position_embeddings=64)
    return ModelConfig(path=Path("unused"), arch=arch, **options)


def test_ngram_defaults_are_vllms():
    cfg = SpeculativeConfig.from_dict(NGRAM)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    assert cfg.num_speculative_tokens == 3


@pytest.mark.parametrize(("given", "expected"), [
    ({"prompt_lookup_min": 2}, (2, 2)),
    ({"prompt_lookup_max": 4}, (4, 4)),
    ({"prompt_lookup_min": 2, "prompt_lookup_max": 4}, (2, 4)),
])
def test_one_lookup_bound_copies_the_other(given, expected):
    cfg = SpeculativeConfig.from_dict({**NGRAM, **given})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == expected


def test_suffix_defaults():
    cfg = SpeculativeConfig.from_dict({"method": "suffix"})
    assert cfg.suffix_decoding_max_tree_depth == 24
    assert cfg.num_speculative_tokens == 24  # vLLM: defaults to the tree depth
    assert cfg.suffix_decoding_max_cached_requests == 1000
    assert (cfg.suffix_decoding_max_spec_factor, cfg.suffix_decoding_min_token_prob) == (1.0, 0.1)
    assert cfg.prompt_lookup_min is None


def test_json_string_and_none_and_instance():
    cfg = SpeculativeConfig.from_dict(json.dumps({**NGRAM, "prompt_lookup_max": 3}))
    assert cfg == SpeculativeConfig("ngram", 3, prompt_lookup_max=3)
    assert SpeculativeConfig.from_dict(cfg) is cfg
    assert SpeculativeConfig.from_dict(None) is None
    assert SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2}).method \
        == "ngram"  # vLLM's older spelling


@pytest.mark.parametrize(("value", "message"), [
    ({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({**NGRAM, "prompt_lookup_min": 0}, "prompt_lookup_min=0 must be an int >= 1"),
    ({"method": "ngram"}, "method 'ngram' needs num_speculative_tokens"),
    ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be an int >= 1"),
    ({**NGRAM, "num_speculative_tokens": True}, "num_speculative_tokens=True must be an int"),
    ({**NGRAM, "lookahead": 2}, r"key\(s\) 'lookahead' are not supported; accepted keys: method, "),
    ({"num_speculative_tokens": 3}, "needs a method: one of 'ngram', 'suffix'"),
    ({**NGRAM, "method": "lookup"}, "method='lookup' is not supported; choose one of 'ngram', "),
    ({"method": "suffix", "prompt_lookup_max": 3}, "prompt_lookup_max applies to method 'ngram'"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 1},
     "suffix_decoding_max_tree_depth=1 must be an int >= 2"),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1},
     "suffix_decoding_max_cached_requests=-1 must be an int >= 0"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5},
     r"suffix_decoding_min_token_prob=1.5 must be in \[0, 1\]"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": 0},
     "suffix_decoding_max_spec_factor=0 must be > 0"),
    ({**NGRAM, "min_acceptance_rate": 2}, r"min_acceptance_rate=2 must be in \[0, 1\]"),
    ({**NGRAM, "max_batch_for_speculation": 0}, "max_batch_for_speculation=0 must be an int"),
    ({**NGRAM, "speculation_backoff_steps": 0}, "speculation_backoff_steps=0 must be an int"),
    ("{not json", "is not a JSON object"),
    (["ngram"], "must be a dict, a JSON object string or a SpeculativeConfig, got list"),
])
def test_bad_values_refused_naming_them(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(value)


@pytest.mark.parametrize("value", [
    {"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 3},
    {"method": "eagle3", "num_speculative_tokens": 3},
    {"method": "medusa", "num_speculative_tokens": 3},
    {"method": "mtp", "num_speculative_tokens": 1},
    {"method": "deepseek_mtp", "num_speculative_tokens": 1},
    {"method": "draft_model", "num_speculative_tokens": 3},
    {"model": "facebook/opt-125m", "num_speculative_tokens": 5},
    {**NGRAM, "draft_tensor_parallel_size": 1},
])
def test_draft_models_refused_saying_what_exists(value):
    with pytest.raises(ValueError, match="draft-model speculation is not supported; use method "
                                         "'ngram' or 'suffix'"):
        SpeculativeConfig.from_dict(value)


def test_engine_config_resolves_and_checks_it():
    config = EngineConfig(model_config=model_config(), speculative_config=json.dumps(NGRAM))
    assert config.speculative_config == SpeculativeConfig("ngram", 3)
    assert EngineConfig(model_config=model_config()).speculative_config is None
    with pytest.raises(ValueError, match="applies to runner='generate' only"):
        EngineConfig(model_config=model_config(runner="pooling"), speculative_config=NGRAM)
    with pytest.raises(ValueError, match="num_speculative_tokens=64 must be < max_model_len=64"):
        EngineConfig(model_config=model_config(),
                     speculative_config={**NGRAM, "num_speculative_tokens": 64})
    with pytest.raises(ValueError, match="needs max_num_batched_tokens >= 4"):
        EngineConfig(model_config=model_config(max_model_len=16),
                     scheduler_config=SchedulerConfig(max_num_batched_tokens=3,
                                                      enable_chunked_prefill=True),
                     speculative_config=NGRAM)


def test_llm_keyword_is_an_engine_option():
    assert group_options({"speculative_config": NGRAM, "max_num_seqs": 2}) == {
        "engine_config": {"speculative_config": NGRAM},
        "scheduler_config": {"max_num_seqs": 2}}


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_flag_takes_json(command):
    parser = cli.build_parser()
    args = parser.parse_args([command, *(["hi"] if command == "generate" else []),
                              "--speculative-config", json.dumps(NGRAM)])
    kwargs = cli.engine_kwargs(args)
    assert SpeculativeConfig.from_dict(kwargs["speculative_config"]) == SpeculativeConfig(
        "ngram", 3)
