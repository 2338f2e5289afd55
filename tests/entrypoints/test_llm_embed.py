"""LLM.embed with runner="pooling": embeddings equal HF transformers' final hidden states
(after the final norm) pooled the same way, in float32 — last token (the default, normalized),
mean over the prompt (also across prefill chunks), first token; batched prompts of different
lengths equal each alone; tensor parallelism (mp, TP=3 on the default model) and pipeline
stages equal uni. And the refusals: generation on a pooling engine, embed on a generating
one, options not built."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardserve import LLM, PoolingParams
from shardserve.engine.config_builder import engine_config_from_kwargs

TEXTS = ["The quick brown fox jumps over the lazy dog and keeps running far away from here",
         "def add(a, b): return a + b", "hello", "Paris is the capital of France, and " * 4]
MIN_COSINE = 0.9999
# A small KV cache: allocating the default share of memory costs seconds per engine.
TINY = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 1 << 22}
DEFAULT = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 32 << 20}


def _hf_hidden(folder, ids_list: list[list[int]]) -> list[torch.Tensor]:
    """HF's last_hidden_state (its final norm applied) of each prompt alone."""
    import transformers

    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).last_hidden_state[0] for ids in ids_list]


def _cosine(a, b) -> float:
    a, b = torch.as_tensor(np.asarray(a, dtype=np.float32)), torch.as_tensor(b).float()
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def _embed(llm: LLM, prompts, params=None) -> list[list[float]]:
    return [o.outputs.embedding for o in llm.embed(prompts, params, use_tqdm=False)]


# The default model's tests come first in the file: while no in-process (uni) engine is
# alive (llama_last's stays up for the module), the mp engine's workers are forked, not
# spawned (3 spawned workers re-importing torch cost ~8 s more on 2 cores).
@pytest.fixture(scope="module")
def default_last(default_model_path) -> list:
    """The default model's default pooling (LAST, normalized) on uni: its outputs of TEXTS[:2]
    (the engine shut down at once)."""
    llm = LLM(str(default_model_path), runner="pooling", **DEFAULT)
    try:
        return llm.embed(TEXTS[:2], use_tqdm=False)
    finally:
        llm.shutdown()


def test_default_model_equals_hf(default_last, hf_default_model):
    with torch.no_grad():
        for out in default_last:
            h = hf_default_model.model(torch.tensor([out.prompt_token_ids])).last_hidden_state
            want = torch.nn.functional.normalize(h[0, -1], dim=0)
            assert _cosine(out.outputs.embedding, want) >= MIN_COSINE


def test_default_model_tp3_equals_tp1(default_model_path, default_last):
    """TP=3 on mp (9 query and 3 KV heads: one KV head per rank) equals uni's TP=1."""
    llm = LLM(str(default_model_path), runner="pooling", **DEFAULT,
              distributed_executor_backend="mp", tensor_parallel_size=3)
    try:
        got = _embed(llm, TEXTS[:2])
    finally:
        llm.shutdown()
    for vec, out in zip(got, default_last, strict=True):
        assert _cosine(vec, out.outputs.embedding) >= 0.99999
        assert np.allclose(vec, out.outputs.embedding, atol=1e-5)


@pytest.fixture(scope="module")
def llama_last(tiny_llama_dir):
    """The default pooling (LAST, normalized) on uni, and HF's hidden states per prompt."""
    llm = LLM(str(tiny_llama_dir), runner="pooling", **TINY)
    outs = llm.embed(TEXTS, use_tqdm=False)
    ids = [o.prompt_token_ids for o in outs]
    yield llm, outs, _hf_hidden(tiny_llama_dir, ids)
    llm.shutdown()


def test_last_token_normalized_equals_hf(llama_last):
    _, outs, hidden = llama_last
    for out, h in zip(outs, hidden, strict=True):
        vec = np.asarray(out.outputs.embedding)
        assert vec.shape == (64,) and abs(np.linalg.norm(vec) - 1) < 1e-5
        assert _cosine(vec, torch.nn.functional.normalize(h[-1], dim=0)) >= MIN_COSINE
        assert out.finished and out.prompt_token_ids


def test_batch_of_lengths_equals_each_alone_and_frees_blocks(llama_last):
    llm, outs, _ = llama_last
    for text, out in zip(TEXTS, outs, strict=True):
        alone = _embed(llm, text)[0]
        assert _cosine(alone, out.outputs.embedding) >= 0.99999
    assert not llm.engine.core.scheduler.running
    # No KV kept past the requests: every block is back in the pool (cached ones evictable).
    assert llm.engine.core.scheduler.kv.usage == 0.0


def test_token_ids_and_normalize_false(llama_last):
    llm, outs, hidden = llama_last
    ids = outs[1].prompt_token_ids
    raw = _embed(llm, {"prompt_token_ids": ids}, PoolingParams(normalize=False))[0]
    assert _cosine(raw, hidden[1][-1]) >= MIN_COSINE
    assert np.allclose(raw, hidden[1][-1].numpy(), atol=1e-4)


# A 24-token budget splits the longer prompts into several chunks (MEAN sums across them).
# With 7 blocks of 8, the next prompt's first chunk takes the last block while the 43-token
# one still holds 6 (its vector not back yet): the next step preempts it mid-prompt, and it
# is recomputed from the start.
CHUNKED = {"max_num_batched_tokens": 24, "block_size": 8}
PREEMPTED = {**CHUNKED, "num_blocks_override": 7, "max_model_len": 48}


@pytest.mark.parametrize(("pooling", "options"), [("MEAN", CHUNKED), ("CLS", CHUNKED),
                                                  ("MEAN", PREEMPTED)],
                         ids=["mean-chunked", "cls-chunked", "mean-preempted"])
def test_mean_and_cls_across_prefill_chunks_equal_hf(tiny_qwen2_dir, pooling, options):
    llm = LLM(str(tiny_qwen2_dir), runner="pooling", convert="embed", **{**TINY, **options},
              pooler_config={"pooling_type": pooling, "normalize": False})
    try:
        texts = TEXTS[:3] if "num_blocks_override" in options else TEXTS
        outs = llm.embed(texts + TEXTS[:1], use_tqdm=False)  # the repeat: a prefix-cache hit?
        assert llm.engine.core.scheduler.kv.stats.hits == 0  # MEAN/CLS compute every position
        preemptions = llm.engine.core.scheduler.total_preemptions
    finally:
        llm.shutdown()
    assert (preemptions > 0) == ("num_blocks_override" in options)
    hidden = _hf_hidden(tiny_qwen2_dir, [o.prompt_token_ids for o in outs])
    assert max(len(o.prompt_token_ids) for o in outs) > 24
    for out, h in zip(outs, hidden, strict=True):
        want = h.mean(dim=0) if pooling == "MEAN" else h[0]
        assert _cosine(out.outputs.embedding, want) >= MIN_COSINE
        assert np.allclose(out.outputs.embedding, want.numpy(), atol=1e-4)


def test_mp_stages_equal_uni(tiny_llama_dir, llama_last):
    # The vector comes from the last stage's output rank (mp response queue).
    _, outs, _ = llama_last
    llm = LLM(str(tiny_llama_dir), runner="pooling", **TINY,
              distributed_executor_backend="mp", pipeline_parallel_size=2)
    try:
        got = _embed(llm, TEXTS)
    finally:
        llm.shutdown()
    for vec, out in zip(got, outs, strict=True):
        assert _cosine(vec, out.outputs.embedding) >= 0.99999


def test_generate_on_pooling_and_embed_on_generate_are_refused(llama_last, tiny_llama_dir):
    llm, _, _ = llama_last
    with pytest.raises(ValueError, match="runner='pooling'.*LLM.embed"):
        llm.generate(["hi"], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions=8 is not supported.*64 dimensions"):
        llm.embed(["hi"], PoolingParams(dimensions=8))
    gen = LLM(str(tiny_llama_dir), **TINY)
    try:
        with pytest.raises(ValueError, match="embeddings need an engine started with "
                                             "runner='pooling'"):
            gen.embed(["hi"])
    finally:
        gen.shutdown()


@pytest.mark.parametrize(("options", "message"), [
    ({"runner": "draft"}, "runner='draft' is not supported"),
    ({"runner": "pooling", "convert": "classify"}, "convert='classify' is not supported"),
    ({"runner": "pooling", "convert": "none"}, "use convert='embed'"),
    ({"convert": "embed", "runner": "generate"}, "convert='embed' needs runner='pooling'"),
    ({"pooler_config": {"pooling_type": "LAST"}}, "applies to runner='pooling' only"),
    ({"runner": "pooling", "pooler_config": {"pooling_type": "MAX"}},
     "pooling_type='MAX' is not supported; choose one of LAST, MEAN, CLS"),
    ({"runner": "pooling", "pooler_config": {"dimensions": 32}}, "dimensions=32 is not"),
    ({"runner": "pooling", "pooler_config": {"enable_chunked_processing": True}},
     "'enable_chunked_processing' are not supported"),
    ({"runner": "pooling", "pooler_config": "{not json"}, "is not a JSON object"),
    ({"runner": "pooling", "pooler_config": {"normalize": True},
      "override_pooler_config": {"normalize": False}}, "not both"),
])
def test_config_refusals_name_the_problem(tiny_llama_dir, options, message):
    with pytest.raises(ValueError, match=message):
        engine_config_from_kwargs(str(tiny_llama_dir), **options)


def test_config_defaults_and_cli_json(tiny_llama_dir):
    config = engine_config_from_kwargs(str(tiny_llama_dir), runner="pooling").model_config
    assert (config.runner, config.convert) == ("pooling", "embed")
    assert config.pooler_config.resolved_type == "LAST"
    assert config.pooler_config.resolved_normalize is True
    config = engine_config_from_kwargs(
        str(tiny_llama_dir), convert="embed", runner="auto",
        override_pooler_config='{"pooling_type": "mean", "use_activation": false}').model_config
    assert config.is_pooling and config.pooler_config.resolved_type == "MEAN"
    assert config.pooler_config.resolved_normalize is False
    assert engine_config_from_kwargs(str(tiny_llama_dir)).model_config.runner == "generate"
