"""LoRA on the model (float32, the tiny Llama): logits equal HF + peft on the same adapter
(rank 8 and 16, all seven projections, rsLoRA, peft's rank_pattern / alpha_pattern /
layers_to_transform), a step mixing base and two adapters equals each alone, the
tensor-parallel shards of an adapter rebuild the full product, and a GGUF-quantized base with
an adapter agrees with its dequantized float32 base with the same adapter.

Every adapter has random non-zero A and B (tests/lora_helpers.py); each test also asserts that
the adapter moves the logits, so a path that silently skipped the add could not pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_helpers import make_peft_adapter, peft_model

from shardserve.config.lora import LoRAConfig
from shardserve.lora.request import LoRARequest
from shardserve.model import layers, native_kernels
from shardserve.model.layers import ColumnParallelLinear, RowParallelLinear
from shardserve.model.llama import LlamaForCausalLM
from shardserve.model.loader import iter_weights, read_arch
from shardserve.model.lora import LoRABatch, LoRAWeights
from shardserve.model.quantization import QuantizedTensor
from shardserve.worker.lora_manager import LoRAManager
from tests.model.test_llama import PagedRunner

TOL = {"rtol": 1e-4, "atol": 1e-4}
MIN_EFFECT = 0.05  # max |dlogit| an adapter must cause (measured 0.5-2 with these adapters)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(hf, tmp_path_factory) -> dict[str, Path]:
    """Adapters made by peft on the tiny model, once for the module."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "r8": make_peft_adapter(hf, root / "r8", rank=8, seed=1),
        "r16": make_peft_adapter(hf, root / "r16", rank=16, seed=2),
        "rslora": make_peft_adapter(hf, root / "rslora", rank=16, alpha=8, seed=3,
                                    use_rslora=True),
        "patterns": make_peft_adapter(
            hf, root / "patterns", rank=8, seed=4, targets=["q_proj", "k_proj", "down_proj"],
            rank_pattern={"down_proj": 4}, alpha_pattern={"k_proj": 32},
            layers_to_transform=[1]),
    }


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 12, 5)]


def load(folder: Path, weights=None, lora: LoRAConfig | None = None):
    """Our float32 model of `folder` (or of the given weights) and its LoRA manager."""
    arch = read_arch(folder)
    model = LlamaForCausalLM(arch, torch.float32)
    model.load_weights(weights if weights is not None else iter_weights(folder))
    manager = LoRAManager(model.eval(), lora or LoRAConfig(max_loras=2, max_lora_rank=16),
                          torch.float32)
    return model, manager


def step(runner: PagedRunner, manager: LoRAManager,
         work: list[tuple[str, list[int], LoRARequest | None]]) -> list[torch.Tensor]:
    manager.prepare([w[2] for w in work], [len(w[1]) for w in work])
    return runner.step([(rid, toks) for rid, toks, _ in work])


def peft_logits(hf, folder: Path, ids: list[list[int]]) -> list[torch.Tensor]:
    model = peft_model(hf, folder)
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].float() for p in ids]


@pytest.mark.parametrize("name", ["r8", "r16", "rslora", "patterns"])
def test_logits_equal_peft(name: str, hf, adapters, tiny_llama_dir: Path,
                           kernel_path: str) -> None:
    """One prefill of three prompts through the adapter, then one decode token each (the C
    kernel's add and torch's)."""
    model, manager = load(tiny_llama_dir)
    req = LoRARequest(name, 1, str(adapters[name]))
    assert manager.add(req)
    ids = prompts(model.arch.vocab_size)
    runner = PagedRunner(model)
    got = step(runner, manager, [(str(i), p[:-1], req) for i, p in enumerate(ids)])
    last = step(runner, manager, [(str(i), p[-1:], req) for i, p in enumerate(ids)])
    want = peft_logits(hf, adapters[name], ids)
    base = PagedRunner(model)
    manager.prepare([None] * 3, [len(p) for p in ids])
    base_rows = base.step([(str(i), p) for i, p in enumerate(ids)])
    for g, lst, w, b in zip(got, last, want, base_rows, strict=True):
        torch.testing.assert_close(torch.cat([g, lst]), w, **TOL)
        assert (w - b).abs().max() > MIN_EFFECT  # the adapter matters


def test_qwen2_logits_equal_peft(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    """q/k/v biases (added by the base product, before the adapter) and a tied LM head."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir,
                                                           dtype=torch.float32).eval()
    folder = make_peft_adapter(hf, tmp_path / "q", rank=8, seed=6)
    model, manager = load(tiny_qwen2_dir)
    req = LoRARequest("q", 1, str(folder))
    ids = prompts(model.arch.vocab_size)
    got = step(PagedRunner(model), manager, [(str(i), p, req) for i, p in enumerate(ids)])
    for g, w in zip(got, peft_logits(hf, folder, ids), strict=True):
        torch.testing.assert_close(g, w, **TOL)


def test_mixed_batch_equals_each_alone(adapters, tiny_llama_dir: Path, kernel_path: str) -> None:
    """Base, A, B and A again (A's tokens not adjacent) in one step equal each run alone."""
    model, manager = load(tiny_llama_dir)
    a = LoRARequest("a", 1, str(adapters["r8"]))
    b = LoRARequest("b", 2, str(adapters["r16"]))
    ids = prompts(model.arch.vocab_size)
    ids.append(ids[1][:4])
    loras = [None, a, b, a]
    mixed = step(PagedRunner(model), manager, [(str(i), p, r) for i, (p, r) in
                                               enumerate(zip(ids, loras, strict=True))])
    for i, (p, r) in enumerate(zip(ids, loras, strict=True)):
        alone = step(PagedRunner(model), manager, [(str(i), p, r)])[0]
        torch.testing.assert_close(mixed[i], alone, rtol=1e-5, atol=1e-5)
    assert (mixed[1][:4] - mixed[3]).abs().max() < 1e-4  # same prompt start, same adapter
    with_b = step(PagedRunner(model), manager, [("x", ids[3], b)])[0]
    assert (with_b - mixed[3]).abs().max() > MIN_EFFECT  # a and b really differ
    assert (with_b - mixed[0][:4]).abs().max() > MIN_EFFECT


class _RankGroup:
    """Stands in for the TP group of rank `rank` of `size` without processes: the test does
    the all-reduce itself (the sum of the ranks' partial outputs)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.world_size = rank, size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


def _adapted(make, names: tuple[str, ...], rank: int, size: int, monkeypatch,
             weights: dict, subs: list) -> ColumnParallelLinear | RowParallelLinear:
    """Rank `rank`'s layer with the full base weights loaded and the adapter in slot 1."""
    monkeypatch.setattr(layers, "get_tp_group", lambda: _RankGroup(rank, size))
    layer = make()
    for shard_id, w in weights.items():
        layer.weight_loader(layer.weight, w, None if shard_id == "" else shard_id)
    layer.lora = LoRAWeights(layer, names, 2, 4, torch.float32, LoRABatch())
    layer.lora.write(1, layer.lora.shard(subs))
    layer.lora.batch.set([1, -1, 1, 1])  # the second token is the base model's
    return layer


# TP3's shape: hidden 96, 6 heads and 3 KV heads of 16, intermediate 192.
_KINDS = {
    "qkv": (lambda: layers.QKVParallelLinear(96, 16, 6, 3, False, torch.float32,
                                             rope_interleave=True),
            ("q_proj", "k_proj", "v_proj"), {"q": (96, 96), "k": (48, 96), "v": (48, 96)}),
    "gate_up": (lambda: layers.MergedColumnParallelLinear(96, [192, 192], False, torch.float32),
                ("gate_proj", "up_proj"), {0: (192, 96), 1: (192, 96)}),
    "down": (lambda: layers.RowParallelLinear(192, 96, False, torch.float32), ("down_proj",),
             {"": (96, 192)}),
}


@pytest.mark.parametrize("kind", list(_KINDS))
def test_tp3_shards_rebuild_the_full_layer(kind: str, monkeypatch) -> None:
    """Each rank's layer (base + adapter, q/k in RoPE order) against the whole layer: column
    layers' rank outputs are its row slices, row layers' partial sums add up to it."""
    make, names, shapes = _KINDS[kind]
    g = torch.Generator().manual_seed(0)
    weights = {k: torch.randn(*shape, generator=g) for k, shape in shapes.items()}
    subs = [(torch.randn(4, shape[1], generator=g), torch.randn(shape[0], 4, generator=g), 0.5)
            for shape in shapes.values()]
    subs[-1] = None if len(subs) > 1 else subs[-1]  # v / up left alone by the adapter
    x = torch.randn(4, next(iter(shapes.values()))[1], generator=g)
    full = _adapted(make, names, 0, 1, monkeypatch, weights, subs)
    with torch.inference_mode():
        want = full(x)
        ranks = [_adapted(make, names, r, 3, monkeypatch, weights, subs) for r in range(3)]
        if isinstance(full, RowParallelLinear):
            got = sum(layer(xr) for layer, xr in zip(ranks, x.chunk(3, dim=1), strict=True))
        else:
            parts = [layer(x).split(layer.local_sizes, dim=1) for layer in ranks]
            got = torch.cat([torch.cat(p, dim=1) for p in zip(*parts, strict=True)], dim=1)
        assert full.lora is not None
        full.lora.batch.set(None)
        base = full(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert (want[1] == base[1]).all()  # the base token untouched
    assert (want[0] - base[0]).abs().max() > MIN_EFFECT


def _quantized_weights(folder: Path) -> list[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The tiny model's projection matrices as Q8_0 / Q4_1 blocks (gguf's own quantizer),
    the rest float: what a GGUF file of it would hand over."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    out: list[tuple[str, torch.Tensor | QuantizedTensor]] = []
    for name, t in iter_weights(folder):
        if ".layers." in name and name.endswith("proj.weight"):
            kind = GGMLQuantizationType.Q4_1 if "mlp" in name else GGMLQuantizationType.Q8_0
            raw = quantize(t.numpy().astype(np.float32), kind)
            t = QuantizedTensor(torch.from_numpy(raw.copy()), int(kind), t.shape[1])
        out.append((name, t))
    return out


@pytest.mark.skipif(not native_kernels.compiler_available(), reason="no C compiler")
def test_quantized_base_with_adapter_agrees_with_float(adapters, tiny_llama_dir: Path) -> None:
    """Teacher-forced top-1, prefill and token by token (the quantized decode path, where
    the fused C stack would run without an adapter), >= 99% of 4 x 24 positions."""
    quantized = _quantized_weights(tiny_llama_dir)
    dequantized = [(n, t.dequantize() if isinstance(t, QuantizedTensor) else t)
                   for n, t in quantized]
    q_model, q_manager = load(tiny_llama_dir, quantized)
    f_model, f_manager = load(tiny_llama_dir, dequantized)
    assert q_model.model.layers[0].mlp.down_proj.qweight is not None
    req = LoRARequest("a", 1, str(adapters["r16"]))
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, q_model.arch.vocab_size, (24,), generator=g).tolist()
            for _ in range(4)]
    agree = total = 0
    for seq in seqs:
        want = step(PagedRunner(f_model), f_manager, [("r", seq, req)])[0]
        runner = PagedRunner(q_model, check_last_rows=False)
        one_by_one = torch.cat([step(runner, q_manager, [("r", [t], req)])[0] for t in seq])
        prefill = step(PagedRunner(q_model, check_last_rows=False), q_manager,
                       [("r", seq, req)])[0]
        base = step(PagedRunner(q_model, check_last_rows=False), q_manager, [("r", seq, None)])
        assert (base[0] - one_by_one).abs().max() > MIN_EFFECT  # the adapter ran token by token
        for got in (prefill, one_by_one):
            agree += int((got.argmax(-1) == want.argmax(-1)).sum())
            total += len(seq)
    assert agree / total >= 0.99, f"top-1 agreement {agree}/{total}"
