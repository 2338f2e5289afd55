"""The Llama-family model against HF transformers, through the paged KV cache.

Tiny random-weight HF models (built from transformers configs, fixed seed) are the reference.
Every KV cache starts filled with NaN, so any read of an unwritten or padding slot that leaks
into a result shows up as NaN instead of passing silently.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from shardserve.config.model_arch import ModelArch
from shardserve.distributed import parallel_state
from shardserve.model.attention import AttentionMetadata, allocate_kv_cache
from shardserve.model.llama import LlamaForCausalLM, check_tp_size

TOL = {"rtol": 1e-4, "atol": 1e-4}
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=500,
    max_position_embeddings=512,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def _hf_config(kind: str):
    import transformers as tf

    if kind == "llama":
        return tf.LlamaConfig(**SMALL, num_hidden_layers=2)
    if kind == "llama3_rope":
        return tf.LlamaConfig(**SMALL, num_hidden_layers=2, rope_parameters=LLAMA3_ROPE)
    if kind == "tied_mqa":  # SmolLM-like: tied embeddings; one KV head shared by all 4 heads
        return tf.LlamaConfig(
            **{**SMALL, "num_key_value_heads": 1}, num_hidden_layers=3, tie_word_embeddings=True
        )
    if kind == "qwen2":  # qkv bias; odd vocab exercises vocab padding under TP
        return tf.Qwen2Config(**{**SMALL, "vocab_size": 503}, num_hidden_layers=2)
    if kind == "mistral":  # head_dim != hidden / heads
        return tf.MistralConfig(**SMALL, num_hidden_layers=2, head_dim=32, sliding_window=None)
    raise KeyError(kind)


def arch_from_hf(cfg) -> ModelArch:
    rope = dict(cfg.rope_parameters or {})
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ModelArch(
        architecture=cfg.architectures[0] if cfg.architectures else _ARCH[cfg.model_type],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=bool(cfg.tie_word_embeddings),
        max_position_embeddings=cfg.max_position_embeddings,
        attention_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
    )


_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def make_hf(kind: str):
    """(HF model in eval mode, its ModelArch); weights are seeded and deterministic."""
    import transformers as tf

    cfg = _hf_config(kind)
    cfg._attn_implementation = "eager"
    torch.manual_seed(1234)
    hf = tf.AutoModelForCausalLM.from_config(cfg).eval()
    return hf, arch_from_hf(cfg)


def build_model(hf, arch: ModelArch, dtype=torch.float32) -> LlamaForCausalLM:
    model = LlamaForCausalLM(arch, dtype)
    model.load_weights(hf.state_dict().items())
    return model


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


class PagedRunner:
    """Drives a model step by step over a paged cache with shuffled (non-contiguous) blocks."""

    def __init__(self, model: LlamaForCausalLM, block_size: int = 4, num_blocks: int = 96,
                 check_last_rows: bool = True):
        self.model = model
        # The logits of the last rows alone must equal those rows of the whole step (not so
        # with quantized weights: one row runs the int8 path, a step's rows the dense one).
        self.check_last_rows = check_last_rows
        self.block_size = block_size
        self.caches = allocate_kv_cache(
            model.num_layers, num_blocks, block_size, model.local_num_kv_heads,
            model.head_dim, model.dtype,
        )  # fmt: skip
        for cache in self.caches:
            # Stands in for stale K/V of freed blocks: large, finite, and read (masked) by the
            # whole-block gathers; exact results prove the mask hides it.
            cache.uniform_(-1e3, 1e3, generator=torch.Generator().manual_seed(3))
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7)).tolist()
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, work: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Run one step; work = [(request id, new tokens)]. Returns each request's logits rows."""
        query_lens, seq_lens, tables, ids = [], [], [], []
        for rid, toks in work:
            new_len = self.lens.get(rid, 0) + len(toks)
            table = self.tables.setdefault(rid, [])
            while len(table) * self.block_size < new_len:
                table.append(self.free.pop())
            self.lens[rid] = new_len
            query_lens.append(len(toks))
            seq_lens.append(new_len)
            tables.append(list(table))
            ids.extend(toks)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), meta, self.caches)
            logits = self.model.compute_logits(hidden)
            last = self.model.compute_logits(hidden[meta.logits_indices])
        rows = list(torch.split(logits, query_lens))
        if self.check_last_rows:
            torch.testing.assert_close(last, torch.stack([r[-1] for r in rows]))
        return rows


def prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths[:n]]


@pytest.mark.parametrize("kind", ["llama", "llama3_rope", "tied_mqa", "qwen2", "mistral"])
def test_prefill_matches_hf(kind: str, kernel_path: str) -> None:
    hf, arch = make_hf(kind)
    model = build_model(hf, arch)
    ps = prompts(3, [5, 13, 9], arch.vocab_size)
    rows = PagedRunner(model, block_size=4).step([(f"r{i}", p) for i, p in enumerate(ps)])
    for p, got in zip(ps, rows, strict=True):
        torch.testing.assert_close(got, hf_logits(hf, p), **TOL)


def decode_scenario(model: LlamaForCausalLM, vocab: int, block_size: int) -> dict[str, list]:
    """Prefill two prompts, then decode both together for 6 steps (greedy on our logits)."""
    runner = PagedRunner(model, block_size=block_size)
    seqs = dict(zip(["a", "b"], prompts(2, [7, 18], vocab, seed=1), strict=True))
    outs = {rid: [r[-1]] for rid, r in zip(seqs, runner.step(list(seqs.items())), strict=True)}
    for _ in range(6):
        nxt = {rid: int(outs[rid][-1].argmax()) for rid in seqs}
        for rid in seqs:
            seqs[rid].append(nxt[rid])
        rows = runner.step([(rid, [nxt[rid]]) for rid in seqs])
        for rid, r in zip(seqs, rows, strict=True):
            outs[rid].append(r[-1])
    return {rid: [seqs[rid], torch.stack(outs[rid])] for rid in seqs}


@pytest.mark.parametrize(("kind", "block_size"), [("llama", 4), ("qwen2", 16), ("tied_mqa", 4)])
def test_incremental_decode_matches_hf(kind: str, block_size: int, kernel_path: str) -> None:
    hf, arch = make_hf(kind)
    model = build_model(hf, arch)
    for rid, (seq, got) in decode_scenario(model, arch.vocab_size, block_size).items():
        ref = hf_logits(hf, seq)[-got.shape[0] :]  # last prompt position, then each decode step
        torch.testing.assert_close(got, ref, **TOL, msg=f"request {rid}")


def mixed_scenario(model: LlamaForCausalLM, vocab: int) -> tuple[dict, dict]:
    """Step 1: chunk 1 of A, prefills of B and C. Step 2: [B decode, A chunk 2, C decode, D].

    Returns (full token sequences, logits rows from step 2) per request.
    """
    runner = PagedRunner(model, block_size=4)
    a, b, c, d = prompts(4, [14, 6, 11, 5], vocab, seed=2)
    runner.step([("a", a[:6]), ("b", b), ("c", c)])
    seqs = {"a": a, "b": b + [3], "c": c + [4], "d": d}
    work = [("b", [3]), ("a", a[6:]), ("c", [4]), ("d", d)]
    rows = runner.step(work)
    return seqs, {rid: r for (rid, _), r in zip(work, rows, strict=True)}


@pytest.mark.parametrize("kind", ["llama", "tied_mqa"])
def test_mixed_batch_chunked_prefill_and_decodes(kind: str, kernel_path: str) -> None:
    hf, arch = make_hf(kind)
    model = build_model(hf, arch)
    seqs, got = mixed_scenario(model, arch.vocab_size)
    for rid, rows in got.items():
        ref = hf_logits(hf, seqs[rid])[-rows.shape[0] :]
        torch.testing.assert_close(rows, ref, **TOL, msg=f"request {rid}")


def test_fresh_prefill_next_to_decodes() -> None:
    # One fresh prefill among decodes takes the gather-free causal path; check it in a mix.
    hf, arch = make_hf("llama")
    model = build_model(hf, arch)
    runner = PagedRunner(model, block_size=4)
    a, b, c = prompts(3, [9, 4, 12], arch.vocab_size, seed=3)
    runner.step([("a", a), ("b", b)])
    rows = runner.step([("a", [1]), ("c", c), ("b", [2])])
    for seq, got in zip([a + [1], c, b + [2]], rows, strict=True):
        torch.testing.assert_close(got, hf_logits(hf, seq)[-got.shape[0] :], **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_fp32(dtype: torch.dtype, kernel_path: str) -> None:
    hf, arch = make_hf("llama")
    ref = decode_scenario(build_model(hf, arch), arch.vocab_size, 4)
    model = build_model(hf, arch, dtype)
    got = decode_scenario(model, arch.vocab_size, 4)
    for rid in ref:
        want, have = ref[rid][1], got[rid][1]
        assert have.dtype == torch.float32 and torch.isfinite(have).all()
        scale = want.abs().max().item()
        assert (have - want).abs().max().item() < 0.05 * scale, f"request {rid}"


def test_tp_size_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    _, arch = make_hf("llama")  # 4 heads, 2 KV heads: 4 ranks hold one KV head each
    check_tp_size(arch, 2)
    check_tp_size(arch, 4)
    with pytest.raises(ValueError, match=r"valid sizes: \[1, 2, 4\]"):
        check_tp_size(arch, 8)
    # The model reads the TP size from the process group and refuses it the same way.
    monkeypatch.setattr(parallel_state, "_TP_GROUP", parallel_state.GroupCoordinator(0, 3))
    with pytest.raises(ValueError, match=r"tensor-parallel size 3 .*valid sizes: \[1, 2, 4\]"):
        LlamaForCausalLM(arch, torch.float32)


def test_load_weights_rejects_unknown_and_missing() -> None:
    hf, arch = make_hf("qwen2")
    state = hf.state_dict()
    model = LlamaForCausalLM(arch, torch.float32)
    with pytest.raises(ValueError, match="model.layers.0.mlp.bogus.weight"):
        model.load_weights([*state.items(), ("model.layers.0.mlp.bogus.weight", torch.ones(1))])
    partial = [(k, v) for k, v in state.items() if k != "model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"qkv_proj\.bias\[k\]"):
        LlamaForCausalLM(arch, torch.float32).load_weights(partial)
    # Tensors of another dtype are cast; a repeated load (after packing) works too.
    model.load_weights((k, v.to(torch.bfloat16)) for k, v in state.items())
    model.load_weights(state.items())
    rows = PagedRunner(model).step([("x", [1, 2, 3])])
    torch.testing.assert_close(rows[0], hf_logits(hf, [1, 2, 3]), **TOL)


# ---- tensor parallelism: two spawned gloo ranks ----

TP_KINDS = ("llama", "qwen2")


def _scenario_logits(model: LlamaForCausalLM, vocab: int) -> list[torch.Tensor]:
    dec = decode_scenario(model, vocab, 4)
    seqs, mixed = mixed_scenario(model, vocab)
    return [dec["a"][1], dec["b"][1], *mixed.values()]


def _tp_worker(rank: int, world: int, store: str, inputs: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    # A file store, as the mp executor uses: a port chosen here and bound later by rank 0 could
    # be taken in between by any other process on the machine.
    parallel_state.init_distributed(rank, world, f"file://{store}", "gloo")
    try:
        data = torch.load(inputs, weights_only=False)
        results = {}
        for kind in TP_KINDS:
            arch, state = data[kind]
            model = LlamaForCausalLM(arch, torch.float32)
            assert model.local_num_kv_heads == arch.num_kv_heads // world
            model.load_weights(state.items())
            results[kind] = _scenario_logits(model, arch.vocab_size)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        # Both ranks leave together: a rank tearing down gloo while its peer is still in a
        # collective (or the store host leaving first) aborts the other process.
        parallel_state.get_tp_group().barrier()
    finally:
        parallel_state.destroy_distributed()


def test_tensor_parallel_two_ranks_match_single(tmp_path: Path) -> None:
    data, expected = {}, {}
    for kind in TP_KINDS:
        hf, arch = make_hf(kind)
        data[kind] = (arch, hf.state_dict())
        expected[kind] = _scenario_logits(build_model(hf, arch), arch.vocab_size)
    torch.save(data, tmp_path / "inputs.pt")
    mp.spawn(_tp_worker, args=(2, str(tmp_path / "store"), str(tmp_path / "inputs.pt"),
                               str(tmp_path)), nprocs=2, join=True)  # fmt: skip
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for kind in TP_KINDS:
            for want, have in zip(expected[kind], got[kind], strict=True):
                assert have.shape == want.shape  # full vocab on every rank, padding trimmed
                torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4)
