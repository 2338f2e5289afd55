"""Tokenizers: HF folders through AutoTokenizer, GGUF files built straight from their metadata.

transformers' GGUF tokenizer path re-parses the whole file with `GGUFReader` (several seconds);
here we reuse the header `gguf_loader` already parsed and build the same byte-level BPE
`tokenizers.Tokenizer` that transformers produces for `tokenizer.ggml.model == "gpt2"`.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from shardserve.model.gguf_loader import read_gguf

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# llama.cpp token_type values (llama_token_type): 3 = CONTROL (special), 4 = USER_DEFINED.
_CONTROL, _USER_DEFINED = 3, 4

# tokenizer.ggml.pre names whose merges were learned on a split other than GPT-2's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _spell(token: str, alphabet: set[str], table: dict[int, str]) -> str:
    """Tokens are stored in the byte alphabet already; respell any that are not (raw UTF-8)."""
    if set(token) <= alphabet:
        return token
    return "".join(table[b] for b in token.encode("utf-8"))


def _byte_level_bpe(md: dict[str, Any]) -> Tokenizer:
    table = _byte_alphabet()
    alphabet = set(table.values())
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    vocab = {_spell(tok, alphabet, table): i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split = _PRE_SPLITS.get(md.get("tokenizer.ggml.pre"))
    if split is None:  # GPT-2's own regex (smollm, gpt2, starcoder, ...)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    _add_special_tokens(tok, md, alphabet)
    return tok


def _add_special_tokens(tok: Tokenizer, md: dict[str, Any], alphabet: set[str]) -> None:
    """CONTROL tokens become special added tokens, USER_DEFINED plain added ones, so the
    pre-tokenizer never cuts them apart. A control token spelled outside the byte alphabet is a
    llama.cpp mislabel, not a vocabulary entry, so it is skipped (as transformers does)."""
    tokens, types = md["tokenizer.ggml.tokens"], md.get("tokenizer.ggml.token_type") or []
    typed = list(zip(tokens, types, strict=False))
    control = [t for t, k in typed if k == _CONTROL and set(t) <= alphabet]
    user = [t for t, k in typed if k == _USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast  # see load_tokenizer_from

    gf, _ = read_gguf(path)
    md = gf.metadata
    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{path}: GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' "
            "(byte-level BPE)"
        )
    tokens = md["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        idx = md.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    return PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_bpe(md),
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=md.get("tokenizer.chat_template"),
        add_bos_token=bool(md.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(md.get("tokenizer.ggml.add_eos_token", False)),
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer_from(path: Path, trust_remote_code: bool = False) -> PreTrainedTokenizerFast:
    """Tokenizer for a resolved model path (HF folder or .gguf file)."""
    if path.is_dir():
        # Imported here, not at module level: `import transformers` takes ~0.35 s of a cold
        # start, and AutoTokenizer another ~0.4 s (it indexes every model transformers has),
        # which a GGUF file, the default model, never needs.
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                            trust_remote_code=trust_remote_code)
        if not isinstance(tok, PreTrainedTokenizerFast):
            raise ValueError(f"{path}: expected a fast (tokenizer.json) tokenizer, got {type(tok)}")
        return tok
    return _gguf_tokenizer(path)
