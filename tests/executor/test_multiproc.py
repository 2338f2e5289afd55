"""MultiprocExecutor with real worker processes: equality with uni, RPC semantics."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from shardserve import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "def add(a, b):", "Hello, world! How are", "Tensor parallel"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _generate(path, **kwargs) -> list[list[int]]:
    llm = LLM(str(path) if path else None, dtype="float32", max_model_len=256, **kwargs)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_equals_uni(fixture, tp, request):
    path = request.getfixturevalue(fixture)
    assert _generate(path, tensor_parallel_size=tp, distributed_executor_backend="mp") == (
        _generate(path)
    )


def test_collective_rpc_semantics(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), max_model_len=128, tensor_parallel_size=2)
    try:
        executor = llm.engine.core.executor
        assert type(executor).__name__ == "MultiprocExecutor"
        assert llm.collective_rpc("get_rank") == [0, 1]
        assert llm.collective_rpc(lambda w: w.rank * 10) == [0, 10]
        assert executor.collective_rpc("get_rank", unique_reply_rank=1) == 1
        futures = [executor.collective_rpc("get_rank", non_block=True) for _ in range(3)]
        assert all(isinstance(f, Future) for f in futures)
        assert [f.result(timeout=10) for f in reversed(futures)] == [[0, 1]] * 3
        with pytest.raises(ValueError, match=r"rank \d \(pid \d+\).*level"):
            executor.collective_rpc("sleep", kwargs={"level": 7})
        assert llm.collective_rpc("get_rank") == [0, 1]  # healthy after a remote error
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_tp3_on_the_default_model_equals_uni(default_model_path):
    tp3 = _generate(None, tensor_parallel_size=3, distributed_executor_backend="mp")
    assert tp3 == _generate(None)


def test_tp3_with_quantized_blocks_equals_uni(default_model_path):
    """quantization="gguf" under TP=3: each rank keeps its rows of the Q4_1 blocks (and its
    whole-block column range of o_proj and down_proj). 3 prompts, so decode steps run the
    integer kernel (4+ rows would take the dense copy)."""
    def run(**kwargs) -> list[list[int]]:
        llm = LLM(None, dtype="float32", quantization="gguf", max_model_len=256, **kwargs)
        try:
            layer = llm.collective_rpc(
                lambda w: type(w.model_runner.model.model.layers[0].mlp.down_proj.qweight).__name__)
            assert set(layer) == {"QuantWeight"}
            outs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
            return [o.outputs[0].token_ids for o in outs]
        finally:
            llm.shutdown()

    assert run(tensor_parallel_size=3, distributed_executor_backend="mp") == run()
