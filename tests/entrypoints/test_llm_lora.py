"""LoRA through the offline API (LLM(enable_lora=True), generate(lora_request=...)): float32
greedy equals HF + peft token for token, on the default model (rank 8 and 16, all seven
projections) and on the tiny one; a batch mixing the base model and two adapters equals each
request alone, on uni and on mp with TP=3 and PP=2; max_loras holds in every step the scheduler
plans; the prefix cache never crosses adapters; max_cpu_loras evicts the least recently used;
the adapter calls (add/remove/pin/list) reach every rank and their lists agree; bad input is
refused naming what to change, and the engine serves on.

Every adapter has random non-zero A and B (tests/lora_helpers.py), and each output test asserts
that the adapter changes the output, so a path that ignored it could not pass."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from shardserve import LLM, AsyncLLM, EngineArgs, SamplingParams
from shardserve.lora.peft_adapter import LoRAError
from shardserve.lora.request import LoRARequest
from tests.conftest import TP3
from tests.entrypoints.pp_oracle import oracle_prompt_ids
from tests.lora_helpers import make_peft_adapter, make_peft_model, peft_greedy, peft_model

N = 16
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
TINY = dict(dtype="float32", max_model_len=128, enable_lora=True, max_loras=2,
            max_lora_rank=16, max_cpu_loras=2)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# ---- the default model against HF + peft ----
def hf_greedy_batch(model, prompt_ids: list[list[int]], n: int, eos: int = 2) -> list[list[int]]:
    """HF generate's greedy continuations of all prompts in one left-padded batch (3.4x faster
    than one at a time here, and equal to it), each up to and with its first EOS, as ours stop
    (peft_greedy's min_new_tokens bans EOS, which our greedy may pick)."""
    import torch

    width = max(map(len, prompt_ids))
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos)
    rows = out[:, width:].tolist()
    return [row[:row.index(eos) + 1] if eos in row else row for row in rows]


def test_default_model_adapters_equal_peft(default_model_path, hf_default_model, tmp_path):
    llm = LLM(str(default_model_path), dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=16, max_model_len=256)
    try:
        prompt_ids = oracle_prompt_ids(llm.get_tokenizer())
        prompts = [{"prompt_token_ids": p} for p in prompt_ids]
        made = {r: make_peft_model(hf_default_model, tmp_path / f"r{r}", rank=r, seed=r)
                for r in (8, 16)}
        loras = [LoRARequest(f"rank{r}", r, str(f)) for r, (f, _) in made.items()]
        # One batch: the base model and both adapters side by side.
        params = SamplingParams(temperature=0, max_tokens=N)
        outs = _ids(llm.generate(prompts * 3, params, use_tqdm=False,
                                 lora_request=[None] * 8 + [loras[0]] * 8 + [loras[1]] * 8))
    finally:
        llm.shutdown()
    base = outs[:8]
    for i, (_, hf_with_adapter) in enumerate(made.values()):
        got = outs[8 * (i + 1):8 * (i + 2)]
        assert got == hf_greedy_batch(hf_with_adapter, prompt_ids, N)
        assert sum(g != b for g, b in zip(got, base, strict=True)) >= 4  # it does change them


# ---- the tiny model: shared engines and adapters ----
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tiny_model_builder) -> Path:
    """The tiny Llama in the shape that splits three ways (TP=3), two layers (PP=2)."""
    return tiny_model_builder("LlamaForCausalLM", tmp_path_factory.mktemp("lora_tiny"), **TP3)


@pytest.fixture(scope="module")
def tiny_hf(tiny_dir):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def loras(tiny_hf, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("lora_adapters")
    specs = {"A": (1, 8), "B": (2, 16), "C": (3, 8)}
    return {name: LoRARequest(name, i, str(make_peft_adapter(tiny_hf, root / name, rank=r,
                                                             seed=10 + i, b_std=0.2)))
            for name, (i, r) in specs.items()}


@pytest.fixture(scope="module")
def uni(tiny_dir):
    llm = LLM(str(tiny_dir), **TINY)
    yield llm
    llm.shutdown()


PROMPTS = [[5, 17, 33, 60, 81], [100, 4, 9], [250, 251, 12, 13, 14, 15, 16], [42] * 6,
           [7, 8, 9, 10], [300, 120, 64]]
MIX = [None, "A", "B", "A", None, "B"]


def _mix(loras) -> list[LoRARequest | None]:
    return [loras[m] if m else None for m in MIX]


@pytest.fixture(scope="module")
def uni_mixed(uni, loras) -> list[list[int]]:
    return _ids(uni.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                             use_tqdm=False, lora_request=_mix(loras)))


def test_mixed_batch_equals_each_alone_and_peft(uni, loras, uni_mixed, tiny_hf):
    for prompt, lora, got in zip(PROMPTS, _mix(loras), uni_mixed, strict=True):
        alone = uni.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                             lora_request=lora)
        assert _ids(alone)[0] == got
    for name in ("A", "B"):
        rows = [i for i, m in enumerate(MIX) if m == name]
        want = peft_greedy(peft_model(tiny_hf, Path(loras[name].lora_path)),
                           [PROMPTS[i] for i in rows], N)
        assert [uni_mixed[i] for i in rows] == want
    base = _ids(uni.generate([{"prompt_token_ids": PROMPTS[i]} for i in (1, 2)], GREEDY,
                             use_tqdm=False))
    assert base[0] != uni_mixed[1] and base[1] != uni_mixed[2]  # A and B change the output


def test_chat_takes_lora_request(uni, loras):
    messages = [{"role": "user", "content": "hello there"}]
    text = uni.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True,
                                                   tokenize=False)
    ids = uni.get_tokenizer().encode(text, add_special_tokens=False)
    chat = _ids(uni.chat(messages, GREEDY, use_tqdm=False, lora_request=loras["B"]))
    assert chat == _ids(uni.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False,
                                     lora_request=loras["B"]))
    assert chat != _ids(uni.chat(messages, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 3},
                                      {"pipeline_parallel_size": 2}], ids=["tp3", "pp2"])
def test_mp_equals_uni_and_ranks_agree(tiny_dir, loras, uni_mixed, parallel):
    llm = LLM(str(tiny_dir), distributed_executor_backend="mp", **TINY, **parallel)
    try:
        got = _ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                use_tqdm=False, lora_request=_mix(loras)))
        assert got == uni_mixed
        executor = llm.engine.core.executor
        assert executor.list_loras() == [1, 2]  # every rank loaded both (the lists agree)
        assert llm.add_lora(loras["C"]) and llm.list_loras() == {2, 3}  # A least recent
        # One rank drops an adapter behind the engine's back: the lists disagree, named.
        llm.collective_rpc(_drop_on_rank_1, args=(3,))
        with pytest.raises(RuntimeError, match=r"ranks \[1\] answered"):
            executor.list_loras()
    finally:
        llm.shutdown()


def test_data_parallel_replicas_serve_adapters(tiny_dir, loras, uni_mixed):
    """Two engine cores in processes of their own: each loads the adapters, a refusal comes
    back over the wire as a ValueError, and the outputs equal uni's."""
    llm = LLM(str(tiny_dir), data_parallel_size=2, **TINY)
    try:
        got = _ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                use_tqdm=False, lora_request=_mix(loras)))
        assert got == uni_mixed
        assert llm.engine.client.call("list_loras") == [[1, 2], [1, 2]]
        bad = LoRARequest("missing", 7, str(Path(loras["A"].lora_path).parent / "nowhere"))
        with pytest.raises(ValueError, match="engine core 0: add_lora: LoRAError"):
            llm.add_lora(bad)
        assert llm.remove_lora(1) and llm.list_loras() == {2}
    finally:
        llm.shutdown()


def _drop_on_rank_1(worker, lora_int_id: int) -> None:
    if worker.rank == 1:
        worker.remove_lora(lora_int_id)


# ---- scheduling and caching ----
def test_no_step_holds_more_than_max_loras(uni, loras):
    core = uni.engine.core
    plans, schedule = [], core.scheduler.schedule

    def recording_schedule():
        plan = schedule()  # the real scheduler's output, kept to be looked at
        plans.append({core.scheduler.requests[rid].lora_int_id
                      for rid in plan.num_scheduled_tokens} - {0})
        return plan

    core.scheduler.schedule = recording_schedule
    try:
        order = ["A", "B", "C", None, "C", "A", "B", "C"]
        outs = uni.generate([{"prompt_token_ids": PROMPTS[i % 6]} for i in range(8)], GREEDY,
                            use_tqdm=False, lora_request=[loras[m] if m else None for m in order])
    finally:
        del core.scheduler.schedule  # the class's own method again
    assert all(len(p) <= 2 for p in plans) and max(len(p) for p in plans) == 2
    assert set().union(*plans) == {1, 2, 3}
    assert all(o.finished and len(o.outputs[0].token_ids) == N for o in outs)


def test_prefix_cache_is_never_shared_across_adapters(uni, loras):
    prompt = {"prompt_token_ids": list(range(10, 50))}  # two full blocks of 16 and 8 more
    params = SamplingParams(temperature=0, max_tokens=1)

    def cached(lora: LoRARequest | None) -> int:
        return uni.generate(prompt, params, use_tqdm=False, lora_request=lora)[0] \
            .num_cached_tokens

    assert [cached(loras["A"]), cached(loras["B"]), cached(None)] == [0, 0, 0]
    assert [cached(loras["A"]), cached(None)] == [32, 32]  # the same adapter does hit


def test_max_cpu_loras_evicts_the_least_recently_used(uni, loras, tiny_hf):
    for lora_id in uni.list_loras():
        uni.remove_lora(lora_id)
    assert uni.add_lora(loras["A"]) and not uni.add_lora(loras["A"])  # once per id
    assert uni.add_lora(loras["B"])
    uni.generate({"prompt_token_ids": [5, 6]}, GREEDY, use_tqdm=False,
                 lora_request=loras["A"])  # A used after B
    uni.add_lora(loras["C"])
    assert uni.list_loras() == {1, 3}
    assert uni.pin_lora(1)
    uni.add_lora(loras["B"])  # A is the least recently used, but pinned: C goes
    assert uni.list_loras() == {1, 2}
    # An evicted adapter is loaded again by the step that needs it (B, unpinned, makes room).
    again = uni.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY, use_tqdm=False,
                         lora_request=loras["C"])
    assert uni.list_loras() == {1, 3}
    assert _ids(again) == peft_greedy(peft_model(tiny_hf, Path(loras["C"].lora_path)),
                                      [PROMPTS[1]], N)
    assert uni.remove_lora(1) and not uni.remove_lora(1)


def test_adapters_and_pins_survive_sleep_level_2(uni, loras, uni_mixed):
    """Level 2 frees the weights, the adapters' slots with them; wake_up loads the adapters
    the ranks held again, pins included."""
    for lora_id in uni.list_loras():
        uni.remove_lora(lora_id)
    uni.add_lora(loras["A"])
    uni.add_lora(loras["B"])
    assert uni.pin_lora(2)
    uni.collective_rpc(_mark_manager)
    uni.sleep(2)
    uni.wake_up()
    assert uni.collective_rpc(_manager_marked) == [False]  # a new model, a new manager
    assert uni.list_loras() == {1, 2}
    got = _ids(uni.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                            use_tqdm=False, lora_request=_mix(loras)))
    assert got == uni_mixed
    uni.add_lora(loras["C"])  # B still pinned: A goes
    assert uni.list_loras() == {2, 3}
    uni.remove_lora(2)


def _mark_manager(worker) -> None:
    worker.model_runner.loras.manager.marked_by_test = True


def _manager_marked(worker) -> bool:
    return hasattr(worker.model_runner.loras.manager, "marked_by_test")


# ---- bad input ----
def test_bad_adapters_fail_their_call_only(uni, loras, tmp_path, tiny_hf):
    bad = make_peft_adapter(tiny_hf, tmp_path / "r32", rank=32)
    with pytest.raises(LoRAError, match="max_lora_rank"):
        uni.generate(["hello", "there"], GREEDY, use_tqdm=False,
                     lora_request=[loras["A"], LoRARequest("big", 9, str(bad))])
    assert not uni.engine.has_unfinished_requests()  # nothing was queued
    with pytest.raises(ValueError, match="lora_int_id=1 is adapter 'A'"):
        uni.generate("x", GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("other", 1, str(bad)))
    with pytest.raises(ValueError, match="got 1 lora_requests for 2 prompts"):
        uni.generate(["a", "b"], GREEDY, use_tqdm=False, lora_request=[loras["A"]])
    out = uni.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY, use_tqdm=False,
                       lora_request=loras["A"])  # still serving, adapters and all
    assert len(out[0].outputs[0].token_ids) == N


def test_lora_request_without_enable_lora_is_refused(tiny_llama_dir, loras):
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64)
    try:
        with pytest.raises(ValueError, match="enable_lora=True"):
            llm.generate("hello", GREEDY, use_tqdm=False, lora_request=loras["A"])
        with pytest.raises(ValueError, match="enable_lora=True"):
            llm.add_lora(loras["A"])
        assert llm.list_loras() == set()
        assert len(llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == N
    finally:
        llm.shutdown()


# ---- AsyncLLM (its engine core in a process of its own) ----
def test_async_llm_serves_adapters(tiny_dir, loras, uni_mixed):
    engine = AsyncLLM(EngineArgs(model=str(tiny_dir), **TINY).create_engine_config())

    async def one(i: int, lora: LoRARequest | None) -> list[int]:
        outs = [o async for o in engine.generate({"prompt_token_ids": PROMPTS[i]}, GREEDY,
                                                 f"r{i}", lora_request=lora)]
        return outs[-1].outputs[0].token_ids

    async def main() -> None:
        got = await asyncio.gather(*(one(i, lora) for i, lora in enumerate(_mix(loras))))
        assert list(got) == uni_mixed
        assert await engine.list_loras() == {1, 2}
        assert await engine.pin_lora(1) and await engine.remove_lora(1)
        bad = LoRARequest("missing", 7, str(Path(loras["A"].lora_path).parent / "nowhere"))
        with pytest.raises(ValueError, match="nowhere"):
            await engine.add_lora(bad)
        assert await engine.list_loras() == {2}

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
