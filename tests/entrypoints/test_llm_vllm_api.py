"""The offline API as vLLM's users call it: sampling params as a dict, the model's default
sampling params, TokensPrompt/TextPrompt, LLM.chat's options (chat_template, tools,
continue_final_message, content parts) with `prompt` set on the outputs, RequestOutput.metrics,
and the max_tokens warning."""

from __future__ import annotations

import json
import logging

import pytest

from shardserve import LLM, SamplingParams
from shardserve.inputs import TextPrompt, TokensPrompt

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if tools %}<tools>{{ tools | length }}{% endif %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256)
    yield engine
    engine.shutdown()


def test_dict_params_and_prompt_shapes(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("hello world")
    outs = llm.generate([TextPrompt(prompt="hello world"), TokensPrompt(prompt_token_ids=ids)],
                        {"temperature": 0, "max_tokens": 6}, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert len(outs[0].outputs[0].token_ids) == 6 and outs[0].prompt == "hello world"
    with pytest.raises(ValueError, match="sampling_params: .*temprature"):
        llm.generate(["x"], {"temprature": 0})


def test_default_sampling_params_come_from_the_generation_config(tiny_model_builder, tmp_path):
    folder = tiny_model_builder("LlamaForCausalLM", tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.3, "top_p": 0.9, "top_k": 7, "max_new_tokens": 5, "do_sample": True}))
    engine = LLM(str(folder), dtype="float32", max_model_len=128)
    try:
        params = engine.get_default_sampling_params()
        assert (params.temperature, params.top_p, params.top_k, params.max_tokens) \
            == (0.3, 0.9, 7, 5)
        out = engine.generate(["hi"], use_tqdm=False)[0]  # no params: the model's defaults
        assert len(out.outputs[0].token_ids) == 5
    finally:
        engine.shutdown()


def test_chat_options_and_prompt_on_outputs(llm):
    conv = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]}]
    params = SamplingParams(temperature=0, max_tokens=3)
    out = llm.chat(conv, params, use_tqdm=False, chat_template=TEMPLATE,
                   tools=[{"type": "function", "function": {"name": "f"}}])[0]
    assert out.prompt == "<user>ab<tools>1<assistant>"
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt,
                                                              add_special_tokens=False)
    cont = llm.chat(conv + [{"role": "assistant", "content": "x"}], params, use_tqdm=False,
                    add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt.endswith("x"), cont.prompt  # the assistant turn stays open
    with pytest.raises(ValueError, match="image_url"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(conv, continue_final_message=True)


def test_metrics_and_cached_tokens(llm):
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert out.num_cached_tokens == 0


def test_max_tokens_past_max_model_len_warns_once(llm, caplog):
    llm.engine._warned_max_tokens = False
    with caplog.at_level(logging.WARNING, logger="shardserve.engine.llm_engine"):
        outs = llm.generate(["hi", "ho"], SamplingParams(temperature=0, max_tokens=1000,
                                                         ignore_eos=True), use_tqdm=False)
    warnings = [r for r in caplog.records if "max_tokens=1000" in r.getMessage()]
    assert len(warnings) == 1 and "max_model_len=256" in warnings[0].getMessage()
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
