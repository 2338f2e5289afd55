"""Tensor parallelism with more ranks than KV heads: each rank holds one KV head, replicated.

Rank r of tp ranks over kv KV heads (tp a multiple of kv) holds KV head r // (tp // kv) whole
(K and V rows and biases copied, not split) and its tp-th of the query heads, which all read
that head. Checked three ways: a 1-KV-head tiny Llama at TP=2 on mp (float32 greedy) equals
`uni` and HF transformers, with a k/v LoRA equal to HF + peft; a 2-KV-head Qwen2 (biases) at
TP=4 run in one process, the ranks as threads meeting in a real sum / concat for their
collectives, equals HF's logits, and every rank's q/k/v rows (float and quantized GGUF blocks)
are the ones the rule names; and the sizes the rule refuses are refused naming it.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from shardserve import LLM, SamplingParams
from shardserve.config.model_arch import ModelArch, kv_heads_of_rank
from shardserve.distributed import parallel_state
from shardserve.distributed.parallel_state import GroupCoordinator
from shardserve.lora.request import LoRARequest
from shardserve.model import quantization
from shardserve.model.layers import QKVParallelLinear
from shardserve.model.llama import LlamaForCausalLM
from shardserve.model.lora import LoRABatch, LoRAWeights
from shardserve.model.quantization import QuantizedTensor
from tests.hf_oracle import argmax_greedy
from tests.lora_helpers import make_peft_model
from tests.model.test_llama import arch_from_hf, decode_scenario, hf_logits

MQA = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1)
N = 12
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


# ---- TP=2 on one KV head, through the mp backend ----

@pytest.fixture(scope="module")
def mqa_dir(tmp_path_factory, tiny_model_builder) -> Path:
    return tiny_model_builder("LlamaForCausalLM", tmp_path_factory.mktemp("mqa"), **MQA)


def _prompt_ids(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 11, 3, 17)]


def _tokens(llm: LLM, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        **kwargs)
    return [o.outputs[0].token_ids for o in outs]


def test_tp2_one_kv_head_on_mp_equals_uni_hf_and_peft(mqa_dir: Path, tmp_path: Path) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(mqa_dir, dtype=torch.float32).eval()
    prompts = _prompt_ids(hf.config.vocab_size)
    adapter, peft = make_peft_model(hf, tmp_path / "kv", rank=8,
                                    targets=("q_proj", "k_proj", "v_proj"), b_std=0.2)
    lora = LoRARequest("kv", 1, str(adapter))
    uni = LLM(str(mqa_dir), dtype="float32", max_model_len=128)
    try:
        want = _tokens(uni, prompts)
    finally:
        uni.shutdown()
    llm = LLM(str(mqa_dir), dtype="float32", max_model_len=128, tensor_parallel_size=2,
              distributed_executor_backend="mp", enable_lora=True, max_loras=1, max_lora_rank=8)
    try:
        ranks = llm.collective_rpc(lambda w: (
            w.model_runner.model.kv_head_ids, w.model_runner.model.local_num_kv_heads,
            tuple(w.model_runner.kv_caches[0].shape)))
        got, adapted = _tokens(llm, prompts), _tokens(llm, prompts, lora_request=lora)
    finally:
        llm.shutdown()
    # Both ranks cache the one KV head (the cache's head axis is 1 on each).
    assert [r[:2] for r in ranks] == [([0], 1), ([0], 1)] and {r[2][3] for r in ranks} == {1}
    assert got == want == argmax_greedy(hf, prompts, N)
    assert adapted == argmax_greedy(peft, prompts, N)
    assert adapted != got  # the adapter changes the output: its k/v rows are in use


# ---- TP=4 on two KV heads, in one process ----

class _ThreadGroup(GroupCoordinator):
    """One rank of a TP group whose ranks are threads of this process: a collective puts the
    rank's tensor in its slot, and every rank sums (in rank order, as every rank must) or
    concatenates all the slots once all have arrived."""

    def __init__(self, rank: int, world_size: int, slots: list, barrier: threading.Barrier):
        super().__init__(rank, world_size)
        self.slots, self.barrier = slots, barrier

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.rank] = tensor.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # no rank refills its slot before every rank has read them
        return parts

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(tensor)
        return tensor.copy_(torch.stack(parts).sum(0))

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(tensor), dim=dim)


def _rank_models(arch: ModelArch, weights, tp: int, monkeypatch) -> list[LlamaForCausalLM]:
    barrier, slots = threading.Barrier(tp, timeout=60), [None] * tp
    models = []
    for rank in range(tp):
        group = _ThreadGroup(rank, tp, slots, barrier) if tp > 1 else GroupCoordinator()
        monkeypatch.setattr(parallel_state, "_TP_GROUP", group)
        model = LlamaForCausalLM(arch, torch.float32)
        model.load_weights(weights)
        models.append(model)
    monkeypatch.setattr(parallel_state, "_TP_GROUP", GroupCoordinator())
    return models


@pytest.fixture(scope="module")
def qwen2_gqa():
    """A tiny Qwen2 (q/k/v biases) with 8 query heads of 8 over 2 KV heads."""
    import transformers

    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=300,
                                   max_position_embeddings=256)
    cfg._attn_implementation = "eager"
    torch.manual_seed(11)
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises biases to zero: make them count
        for name, p in hf.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_(0, 0.2)
    return hf, arch_from_hf(cfg)


def test_tp4_two_kv_heads_threads_equal_hf(qwen2_gqa, monkeypatch) -> None:
    hf, arch = qwen2_gqa
    models = _rank_models(arch, hf.state_dict().items(), 4, monkeypatch)
    assert [m.kv_head_ids for m in models] == [[0], [0], [1], [1]]
    assert {m.local_num_kv_heads for m in models} == {1}
    with ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(decode_scenario, m, arch.vocab_size, 4) for m in models]
        results = [f.result(timeout=120) for f in runs]
    for rid, (seq, got) in results[0].items():
        want = hf_logits(hf, seq)[-got.shape[0]:]  # last prompt position, then each decode
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"request {rid}")
        assert all(torch.equal(r[rid][1], got) for r in results[1:])  # gathered: equal


def _dense(layer) -> torch.Tensor:
    """A loaded layer's weight as float32 rows, whatever form it computes from."""
    if layer.qweight is not None:
        return layer.qweight.dequantize(torch.float32)
    return layer.packed.to_dense() if layer.packed is not None else layer.weight.data.clone()


def _quantized(weights):
    """q/k/v projections as Q8_0 blocks (gguf's own quantizer), as a GGUF file hands them."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    kind = GGMLQuantizationType.Q8_0
    for name, t in weights:
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            raw = quantize(t.numpy().astype(np.float32), kind)
            t = QuantizedTensor(torch.from_numpy(raw.copy()), int(kind), t.shape[1])
        yield name, t


@pytest.mark.parametrize("form", ["float", "q8_0"])
def test_tp4_rank_shards_take_the_replicated_kv_head(qwen2_gqa, form: str, monkeypatch) -> None:
    """Every rank's qkv rows and bias are [its 2 q heads | k head r//2 | v head r//2] of the
    whole layer (q/k already in the RoPE row order): float tensors and quantized blocks."""
    hf, arch = qwen2_gqa
    state = list(hf.state_dict().items())
    weights = list(_quantized(state)) if form == "q8_0" else state
    whole = _rank_models(arch, weights, 1, monkeypatch)[0].model.layers[0].self_attn.qkv_proj
    d = arch.head_dim
    w_q, w_k, w_v = _dense(whole).split([8 * d, 2 * d, 2 * d])
    b_q, b_k, b_v = whole.bias.data.split([8 * d, 2 * d, 2 * d])
    for rank, model in enumerate(_rank_models(arch, weights, 4, monkeypatch)):
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, QKVParallelLinear) and qkv.kv_head_ids == [rank // 2]
        if form == "q8_0":
            assert qkv.qweight is not None or not quantization.available()
        kv = slice(rank // 2 * d, (rank // 2 + 1) * d)
        qs = slice(rank * 2 * d, (rank + 1) * 2 * d)
        torch.testing.assert_close(_dense(qkv), torch.cat([w_q[qs], w_k[kv], w_v[kv]]),
                                   rtol=0, atol=0)
        torch.testing.assert_close(qkv.bias.data, torch.cat([b_q[qs], b_k[kv], b_v[kv]]),
                                   rtol=0, atol=0)


def test_lora_k_v_shards_take_the_replicated_rows(monkeypatch) -> None:
    """A q/k/v adapter at TP=2 over one KV head: each rank's k and v outputs (base + adapter)
    are the whole layer's, its q output its half of the whole layer's."""
    g = torch.Generator().manual_seed(0)
    full = {"q": torch.randn(64, 64, generator=g), "k": torch.randn(16, 64, generator=g),
            "v": torch.randn(16, 64, generator=g)}
    subs = [(torch.randn(4, 64, generator=g), torch.randn(t.shape[0], 4, generator=g), 0.5)
            for t in full.values()]
    x = torch.randn(3, 64, generator=g)

    def adapted(rank: int, size: int) -> torch.Tensor:
        monkeypatch.setattr(parallel_state, "_TP_GROUP", GroupCoordinator(rank, size))
        layer = QKVParallelLinear(64, 16, 4, 1, False, torch.float32, rope_interleave=True)
        for shard_id, w in full.items():
            layer.weight_loader(layer.weight, w, shard_id)
        layer.lora = LoRAWeights(layer, ("q_proj", "k_proj", "v_proj"), 1, 4, torch.float32,
                                 LoRABatch())
        layer.lora.write(0, layer.lora.shard(subs))
        layer.lora.batch.set([0, -1, 0])
        with torch.inference_mode():
            return layer(x)

    want_q, want_k, want_v = adapted(0, 1).split([64, 16, 16], dim=1)
    for rank in range(2):
        q, k, v = adapted(rank, 2).split([32, 16, 16], dim=1)
        torch.testing.assert_close(q, want_q[:, rank * 32:(rank + 1) * 32])
        torch.testing.assert_close(k, want_k)
        torch.testing.assert_close(v, want_v)
    monkeypatch.setattr(parallel_state, "_TP_GROUP", GroupCoordinator(0, 1))
    base = QKVParallelLinear(64, 16, 4, 1, False, torch.float32, rope_interleave=True)
    for shard_id, w in full.items():
        base.weight_loader(base.weight, w, shard_id)
    assert (base(x)[0, 64:80] - want_k[0]).abs().max() > 1e-2  # the adapter adds to k


# ---- what the rule refuses ----

def _arch(heads: int, kv: int) -> ModelArch:
    return ModelArch("LlamaForCausalLM", vocab_size=300, hidden_size=heads * 8,
                     intermediate_size=96, num_layers=1, num_heads=heads, num_kv_heads=kv,
                     head_dim=8)


@pytest.mark.parametrize(("heads", "kv", "good", "bad"), [
    (4, 1, [1, 2, 4], [3, 8]),           # MQA: any size that divides the q heads
    (8, 2, [1, 2, 4, 8], [3, 6, 16]),
    (12, 4, [1, 2, 4, 12], [3, 6, 8]),   # 3 and 6: neither divide 4 KV heads nor a multiple
])
def test_sizes_the_rule_takes_and_refuses(heads, kv, good, bad, monkeypatch) -> None:
    arch = _arch(heads, kv)
    assert arch.valid_tp_sizes(16) == good
    for tp in good:
        assert arch.tp_size_error(tp) is None
        ids = [kv_heads_of_rank(kv, tp, r) for r in range(tp)]
        assert sorted({h for i in ids for h in i}) == list(range(kv))  # every head held
        assert all(len(i) == max(1, kv // tp) for i in ids)
    for tp in bad:
        message = arch.tp_size_error(tp)
        assert message is not None and f"tensor-parallel size {tp} must divide " \
            f"num_heads={heads} and either divide num_kv_heads={kv} or be a multiple" in message
        assert f"valid sizes: {good}" in message
        monkeypatch.setattr(parallel_state, "_TP_GROUP", GroupCoordinator(0, tp))
        with pytest.raises(ValueError, match=f"tensor-parallel size {tp} must divide"):
            LlamaForCausalLM(arch, torch.float32)
        if kv % tp and tp % kv:
            with pytest.raises(ValueError, match=f"size {tp} neither divides num_kv_heads={kv}"):
                kv_heads_of_rank(kv, tp, 0)


def test_engine_refuses_a_size_naming_the_rule(mqa_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 cannot shard this model: "
                                         r"tensor-parallel size 3 must divide num_heads=4.*"
                                         r"valid sizes: \[1, 2, 4\]"):
        LLM(str(mqa_dir), tensor_parallel_size=3, distributed_executor_backend="mp")
