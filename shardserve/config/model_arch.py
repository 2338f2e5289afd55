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

    def shards_heads(self, tp_size: int) -> bool:
        """Whether `tp_size` ranks can shard the attention heads: the query heads split evenly;
        the KV heads split evenly too, or (more ranks than KV heads, tp_size a multiple of
        them) each rank holds one KV head, replicated on tp_size // num_kv_heads ranks: the
        one its query heads read (see `kv_heads_of_rank`)."""
        kv = self.num_kv_heads
        return tp_size >= 1 and self.num_heads % tp_size == 0 and (
            kv % tp_size == 0 or tp_size % kv == 0)

    def tp_size_error(self, tp_size: int) -> str | None:
        """Why `tp_size` cannot shard this model (None: it can), naming the rule and the sizes
        that can."""
        if self.shards_heads(tp_size):
            return None
        return (
            f"tensor-parallel size {tp_size} must divide num_heads={self.num_heads} and either "
            f"divide num_kv_heads={self.num_kv_heads} or be a multiple of it (each rank then "
            f"holds one KV head, replicated); valid sizes: "
            f"{self.valid_tp_sizes(max(16, tp_size))}"
        )

    def valid_tp_sizes(self, limit: int = 64) -> list[int]:
        """Tensor-parallel sizes up to `limit` that can shard the heads (`shards_heads`)."""
        return [n for n in range(1, limit + 1) if self.shards_heads(n)]


def kv_heads_of_rank(num_kv_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """The global KV head ids TP rank `tp_rank` holds, in its local order.

    tp_size <= num_kv_heads: a contiguous run of num_kv_heads // tp_size heads. More ranks than
    KV heads: the one head rank r's query heads read, r // (tp_size // num_kv_heads) (rank r
    holds q heads [r*Hq/tp, (r+1)*Hq/tp), which all fall in that head's GQA group because
    Hq/tp divides Hq/num_kv_heads), so the K/V rows are replicated, not split."""
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(f"tensor-parallel size {tp_size} neither divides num_kv_heads="
                         f"{num_kv_heads} nor is a multiple of it")
    if tp_size <= num_kv_heads:
        per_rank = num_kv_heads // tp_size
        return list(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))
    return [tp_rank // (tp_size // num_kv_heads)]
