"""The architecture facts the engine needs about a model, read from an HF config or GGUF metadata.

`ModelArch` is the one shape description shared by the loader (which produces it), the model
(which is built from it) and the config layer (which validates sizes against it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # HF-style rope scaling dict (e.g. {"rope_type": "llama3", "factor": 8.0, ...}) or None.
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    attention_bias: bool = False  # Qwen2 has biases on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    def valid_tp_sizes(self, limit: int = 64) -> list[int]:
        """Tensor-parallel sizes that divide both head counts (the sizes we can shard to)."""
        return [
            n for n in range(1, limit + 1) if self.num_heads % n == 0 and self.num_kv_heads % n == 0
        ]
