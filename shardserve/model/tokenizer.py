"""Tokenizers: HF folders through AutoTokenizer, GGUF files built straight from their metadata.

transformers' GGUF tokenizer path re-parses the whole file with `GGUFReader` (several seconds);
here we reuse the header `gguf_loader` already parsed and build the same byte-level BPE
`tokenizers.Tokenizer` that transformers produces for `tokenizer.ggml.model == "gpt2"`.

The engine holds an `EngineTokenizer`: for a GGUF file whose tokenizer has been built before, it
encodes and detokenizes with the `tokenizers` backend from a cache and builds the transformers
tokenizer only when something asks for it (a chat template, `LLM.get_tokenizer()`); importing
transformers and building the tokenizer is ~0.5 s of a cold start.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from shardserve import envs
from shardserve.model.gguf_loader import read_gguf

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

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


# ---- the engine's tokenizer: the backend at once, the transformers tokenizer on first use ----
class EngineTokenizer:
    """What the engine needs from a model's tokenizer, and the full one (`full`) on demand.

    `encode` and the `_tokenizer` / `clean_up_tokenization_spaces` attributes that the output
    processor reads (see output_processor._fast_backend) give what the transformers tokenizer
    gives: for a GGUF file they come from the backend that tokenizer held when it was last built
    (cached, see _backend_cache_file), since its encode is the backend's encode with its
    post-processor; anything else goes through `full`, built here on first use."""

    def __init__(self, path: Path, trust_remote_code: bool = False) -> None:
        self._path, self._trust_remote_code = Path(path), trust_remote_code
        self._full: PreTrainedTokenizerFast | None = None
        cached = _load_cached_backend(self._path)
        if cached is None:
            self._full = load_tokenizer_from(self._path, trust_remote_code)
            self._tokenizer = getattr(self._full, "_tokenizer", None)
            self.clean_up_tokenization_spaces = bool(
                getattr(self._full, "clean_up_tokenization_spaces", False))
            _store_backend(self._path, self._full)
        else:
            self._tokenizer, self.clean_up_tokenization_spaces = cached

    @property
    def full(self) -> PreTrainedTokenizerFast:
        """The transformers tokenizer (what `load_tokenizer` returns), built on first use."""
        if self._full is None:
            self._full = load_tokenizer_from(self._path, self._trust_remote_code)
        return self._full

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._full is not None:
            return self._full.encode(text, add_special_tokens=add_special_tokens)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        return self.full.decode(ids, **kwargs)


def _backend_cache_file(path: Path) -> Path | None:
    """Where a GGUF file's backend is cached: keyed by the file (path, size, mtime) and by what
    builds the tokenizer (this module's source, the transformers and tokenizers versions), so a
    changed file or an upgrade rebuilds it. None for an HF folder: AutoTokenizer may pick a
    class whose encode does more than its backend's."""
    if path.is_dir():
        return None
    stat = path.stat()
    try:
        transformers_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None
    key = json.dumps([str(path.resolve()), stat.st_size, stat.st_mtime_ns, transformers_version,
                      tokenizers.__version__, Path(__file__).read_text(encoding="utf-8")])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return Path(envs.cache_dir()) / "tokenizers" / f"{digest}.json"


def _load_cached_backend(path: Path) -> tuple[Tokenizer, bool] | None:
    """(backend, clean_up_tokenization_spaces) from the cache; None on a miss or a bad entry."""
    file = _backend_cache_file(path)
    if file is None or not file.is_file():
        return None
    try:
        entry = json.loads(file.read_text(encoding="utf-8"))
        return Tokenizer.from_str(entry["backend"]), bool(entry["clean_up_tokenization_spaces"])
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON; rebuilt below
        logger.debug("tokenizer cache %s unreadable (%s); rebuilding", file, e)
        return None


def _store_backend(path: Path, full: Any) -> None:
    """Cache the backend of a freshly built GGUF tokenizer (atomically; a cache that cannot be
    written only costs the next start the build)."""
    file = _backend_cache_file(path)
    backend = getattr(full, "_tokenizer", None)
    if file is None or not isinstance(backend, Tokenizer):
        return
    entry = {"backend": backend.to_str(),
             "clean_up_tokenization_spaces": bool(full.clean_up_tokenization_spaces)}
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tokenizer-", suffix=".json", dir=file.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(entry, f)
        os.replace(tmp, file)
    except OSError as e:
        logger.debug("cannot write the tokenizer cache %s: %s", file, e)
