"""Llama-family causal LM (Llama 2/3, SmolLM, Mistral, Qwen2) over a paged KV cache.

The model works on a flat token batch (every request's new tokens concatenated) described by
an `AttentionMetadata`. Layers are tensor-parallel: attention heads and MLP columns are split
across the TP group (with more ranks than KV heads each rank holds one KV head whole, the one
its query heads read: `kv_head_ids`), the vocab is split for the embedding and the LM head, and
`load_weights` takes full HF tensors and lets each layer keep its own slice.

Per layer the hot path is: norm, one fused qkv matmul, in-place RoPE on q and k together,
paged attention, o_proj, fused add+norm, one fused gate_up matmul, SiLU*up, down_proj.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.config.lora import LoRAConfig
from shardserve.config.model_arch import ModelArch, kv_heads_of_rank
from shardserve.distributed.parallel_state import get_tp_group
from shardserve.model import lora, native_kernels
from shardserve.model.attention import AttentionMetadata, paged_attention
from shardserve.model.fused_decode import FusedDecode
from shardserve.model.layers import (
    MatmulLayer,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from shardserve.model.rotary import RopeStep, RotaryEmbedding


def check_tp_size(arch: ModelArch, tp_size: int) -> None:
    """Refuse a TP size that cannot shard the attention heads (ModelArch.shards_heads)."""
    if problem := arch.tp_size_error(tp_size):
        raise ValueError(problem)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, device="cpu") -> None:
        super().__init__()
        tp_size = get_tp_group().world_size
        self.num_heads = arch.num_heads // tp_size
        self.head_dim = arch.head_dim
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size,
            arch.head_dim,
            arch.num_heads,
            arch.num_kv_heads,
            bias=arch.attention_bias,
            dtype=dtype,
            device=device,
            rope_interleave=True,
        )
        # One replicated KV head per rank when there are more ranks than KV heads; this rank's
        # q heads all read it (their GQA group is contiguous), so attention needs no change.
        self.num_kv_heads = len(self.qkv_proj.kv_head_ids)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            arch.num_heads * arch.head_dim, arch.hidden_size, False, dtype, device
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeStep,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q | k | v], contiguous
        # q and k are adjacent in qkv, so one in-place rotation covers both (rows were permuted
        # to interleaved RoPE pairs at load time; the cached K keeps that order).
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
        rope.apply_(qk)
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        kv = qkv[:, self.q_size :].view(t, 2, self.num_kv_heads, self.head_dim)
        return self.o_proj(paged_attention(q, kv, kv_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, device="cpu") -> None:
        super().__init__()
        inter = arch.intermediate_size
        self.local_inter = inter // get_tp_group().world_size
        self.gate_up_proj = MergedColumnParallelLinear(
            arch.hidden_size, [inter, inter], False, dtype, device
        )
        self.down_proj = RowParallelLinear(inter, arch.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.dim() == 2 and gate_up.is_contiguous() and native_kernels.supports(
            gate_up.dtype, gate_up.device
        ):
            return self.down_proj(native_kernels.silu_mul(gate_up))
        gate, up = gate_up.split(self.local_inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, device="cpu") -> None:
        super().__init__()
        eps = arch.rms_norm_eps
        self.self_attn = LlamaAttention(arch, dtype, device)
        self.mlp = LlamaMLP(arch, dtype, device)
        self.input_layernorm = RMSNorm(arch.hidden_size, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeStep,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately and added inside the next norm.
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """The decoder layers [start, end) of one pipeline stage (all of them by default): the
    embedding only on the stage that starts at layer 0, the final norm only on the one that ends
    at the last layer. Other stages take and return the (hidden, residual) pair in between."""

    def __init__(
        self, arch: ModelArch, dtype: torch.dtype, device="cpu",
        layer_range: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.start, self.end = layer_range or (0, arch.num_layers)
        self.is_first, self.is_last = self.start == 0, self.end == arch.num_layers
        if self.is_first:
            self.embed_tokens = VocabParallelEmbedding(
                arch.vocab_size, arch.hidden_size, dtype, device
            )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, dtype, device) for _ in range(self.end - self.start)
        )
        if self.is_last:
            self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.rotary = RotaryEmbedding(
            arch.head_dim, arch.rope_theta, arch.rope_scaling, dtype, device
        )
        self.dtype = dtype
        self.reset_fused()

    def reset_fused(self) -> None:
        """Forget the fused decode table (weights are about to change); rebuilt on next use."""
        self._fused: FusedDecode | None | bool = False  # False: not built yet

    def _fused_decode(self) -> FusedDecode | None:
        if self._fused is False:
            self._fused = FusedDecode.build(list(self.layers), self.dtype)
        return self._fused  # type: ignore[return-value]

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states on the last stage, else the (hidden, residual) pair to hand on.
        `intermediate` is the previous stage's pair (every stage but the first)."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV caches, got {len(kv_caches)}")
        rope = self.rotary.for_step(meta.positions, meta.max_seq_len)  # shared by all layers
        if self.is_first:
            x, residual = self.embed_tokens(input_ids), None
        else:
            if intermediate is None:
                raise ValueError(f"the stage starting at layer {self.start} needs the "
                                 f"previous stage's hidden states")
            x, residual = intermediate
        fused = self._fused_decode()
        if fused is not None and fused.applies(meta, x):
            x, residual = fused.run(x, residual, meta, rope, kv_caches)
        else:
            for layer, cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, rope, cache, meta)
        if not self.is_last:
            assert residual is not None  # every stage has at least one layer
            return x, residual
        return self.norm(x, residual)[0]


# HF checkpoint name pieces -> (our module name piece, shard id) for fused parameters.
_STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_STACKED_RE = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# Non-parameter tensors some checkpoints carry; safe to drop.
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$|rotary_emb\.")


class LlamaForCausalLM(nn.Module):
    """The whole model, or with `layer_range` one pipeline stage of it: the LM head lives on the
    last stage (a copy of the embedding there when the two are tied and on different stages)."""

    def __init__(
        self, arch: ModelArch, dtype: torch.dtype, device="cpu",
        layer_range: tuple[int, int] | None = None, quantization: str = "none",
    ) -> None:
        super().__init__()
        tp = get_tp_group()
        self.quantization = quantization
        check_tp_size(arch, tp.world_size)
        if arch.intermediate_size % tp.world_size:
            raise ValueError(
                f"intermediate_size={arch.intermediate_size} is not divisible by "
                f"tensor-parallel size {tp.world_size}"
            )
        self.arch = arch
        self.dtype = dtype
        self.model = LlamaModel(arch, dtype, device, layer_range)
        self.is_first, self.is_last = self.model.is_first, self.model.is_last
        if self.is_last:
            self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, dtype, device)
            if arch.tie_word_embeddings and self.is_first:
                self.lm_head.tie_to(self.model.embed_tokens)
        # The global KV heads this rank caches, in local order (one, replicated, when there
        # are more TP ranks than KV heads): decode context parallelism shards what this holds.
        self.kv_head_ids: list[int] = kv_heads_of_rank(arch.num_kv_heads, tp.world_size,
                                                       tp.rank)
        self.local_num_kv_heads = len(self.kv_head_ids)  # max(1, num_kv_heads // tp)
        self.head_dim = arch.head_dim
        self.num_layers = len(self.model.layers)  # this stage's: its KV cache has one per layer
        self.lora_batch: lora.LoRABatch | None = None  # set by enable_lora
        self.lora_layers: dict[int, dict[str, lora.LoRAWeights]] = {}

    def forward(
        self,
        input_ids: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [num_tokens, hidden] after the final norm (last stage), or the
        (hidden, residual) pair for the next stage."""
        return self.model(input_ids, attn_metadata, kv_caches, intermediate)

    def enable_lora(self, config: LoRAConfig, dtype: torch.dtype) -> None:
        """Give this stage's projections `config.max_loras` adapter slots in `dtype` (after
        load: they live beside the loaded weights); `lora_batch` selects them per token and
        `lora_layers` maps global layer index -> module path -> slots (worker/lora_manager.py
        fills both)."""
        self.lora_batch, self.lora_layers = lora.attach(
            self.model.layers, self.model.start, config.max_loras, config.max_lora_rank, dtype)
        self.model.reset_fused()  # its table points at the slots too

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab_size] over the full vocab (gathered across TP ranks)."""
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) HF tensors; each layer keeps its TP slice."""
        self.model.reset_fused()
        self._set_packed(False)  # loaders write into the dense parameters
        params = dict(self.named_parameters())
        expected = _expected_pieces(params)
        loaded: set[tuple[str, object]] = set()
        unknown: list[str] = []
        for hf_name, tensor in weights:
            target = self._resolve(hf_name)
            if target is None:
                continue
            name, shard_id = target
            if name not in params:
                unknown.append(hf_name)
                continue
            param = params[name]
            with torch.no_grad():
                if isinstance(tensor, torch.Tensor):
                    tensor = tensor.detach()
                param.weight_loader(param, tensor, shard_id)
            loaded.add((name, shard_id))
        if unknown:
            raise ValueError(f"unknown weights in checkpoint: {sorted(unknown)}")
        missing = sorted(f"{n}" + ("" if s is None else f"[{s}]") for n, s in expected - loaded)
        if missing:
            raise ValueError(f"weights missing from checkpoint: {missing}")
        self._finalize_quantized()
        self._set_packed(True)

    def _finalize_quantized(self) -> None:
        """Quantized weights: what a GGUF file handed over quantized stays so (the embedding
        before the LM head, which may share its table); with quantization="int8" the decoder
        layers' linear weights are quantized per output channel.

        Pieces of a stacked linear that lie apart in the file are copied into one segment
        only where every linear can be one, which the fused decode needs; else they stay
        views of the file. The layers finalize on a thread pool: their repacks and copies
        (numpy, single-threaded each) release the GIL. A tied LM head takes the embedding's
        table, so it goes after."""
        embed, head = getattr(self.model, "embed_tokens", None), getattr(self, "lm_head", None)
        matmuls = [m for m in self.modules() if isinstance(m, MatmulLayer)]
        join = all(len(m.quantized_types()) <= 1 for m in matmuls)
        last = [head] if head in matmuls and head.tied else []
        # An embedding only looked up stays in the file's layout: a repacked copy would make
        # its whole table resident (a lookup touches a few rows of the file).
        lookup_only = embed if embed is not None and not last else None
        with ThreadPoolExecutor(max_workers=torch.get_num_threads()) as pool:
            list(pool.map(lambda m: m.finalize_quantized(join, repack=m is not lookup_only),
                          [m for m in matmuls if m not in last]))
        for module in last:
            module.finalize_quantized(join)
        if self.quantization == "int8":
            for module in matmuls:
                if module is not embed and module is not head:
                    module.quantize_int8()

    def _set_packed(self, packed: bool) -> None:
        """Switch matmul layers to (or back from) prepacked weights where the dtype gains."""
        for module in self.modules():
            if isinstance(module, MatmulLayer) and module is not getattr(
                self.model, "embed_tokens", None
            ):
                if packed:
                    module.pack_weight()
                else:
                    module.unpack_weight()

    def _resolve(self, hf_name: str) -> tuple[str, object] | None:
        """Our parameter name and shard id for an HF tensor name; None to skip it."""
        if _IGNORED_RE.search(hf_name):
            return None
        hf_name = self._stage_name(hf_name)
        if not hf_name:
            return None  # another pipeline stage's weight
        if hf_name == "lm_head.weight" and self.arch.tie_word_embeddings and self.is_first:
            return None  # tied: the embedding supplies it (some checkpoints store a copy)
        match = _STACKED_RE.search(hf_name)
        if match is None:
            return hf_name, None
        fused, shard_id = _STACKED[match.group(1)]
        return hf_name.replace(f".{match.group(1)}.", f".{fused}."), shard_id

    def _stage_name(self, hf_name: str) -> str:
        """The name in this stage's modules ('' if another stage holds the weight): layers are
        renumbered from the stage's first; a tied LM head on its own stage loads the
        embedding's tensor."""
        model = self.model
        if match := _LAYER_RE.match(hf_name):
            index = int(match.group(1))
            if not model.start <= index < model.end:
                return ""
            return f"model.layers.{index - model.start}.{hf_name[match.end():]}"
        if hf_name == "model.embed_tokens.weight":
            if model.is_first:
                return hf_name
            return "lm_head.weight" if self.arch.tie_word_embeddings and self.is_last else ""
        if hf_name == "model.norm.weight" or hf_name == "lm_head.weight":
            return hf_name if self.is_last else ""
        return hf_name


def _expected_pieces(params: dict[str, nn.Parameter]) -> set[tuple[str, object]]:
    """Every (parameter, shard id) that a complete checkpoint must fill."""
    expected: set[tuple[str, object]] = set()
    for name in params:
        if ".qkv_proj." in name:
            expected |= {(name, s) for s in ("q", "k", "v")}
        elif ".gate_up_proj." in name:
            expected |= {(name, 0), (name, 1)}
        else:
            expected.add((name, None))
    return expected
