"""Per-request sampling parameters, shaped like vLLM's `SamplingParams`.

Users write `SamplingParams(max_tokens=32, temperature=0)`. Everything is validated in
`__post_init__` so a bad request fails at the API boundary with a message naming the field, the
bad value and the valid range, rather than deep inside the sampler on a worker process.

The object crosses process boundaries (pickled to engine-core and workers), so it stays a plain
dataclass holding only builtins.
"""

from __future__ import annotations

import enum
import json
import math
import numbers
from dataclasses import dataclass, field

from shardserve.pooling_params import PoolingSpec

# Below this temperature a request is treated as greedy (argmax), as vLLM does: dividing logits by
# a near-zero temperature would overflow and is argmax in the limit anyway.
_GREEDY_EPS = 1e-5
# Most top-N logprobs a request may ask for (OpenAI's limit).
MAX_LOGPROBS = 20
# Largest |logit_bias| value (OpenAI's range): +100 forces a token, -100 bans it.
_MAX_LOGIT_BIAS = 100.0


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _real(name: str, value: object) -> float:
    """`value` as a finite float, or a ValueError naming the field. Bools are rejected."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return result


def _int(name: str, value: object) -> int:
    """`value` as an int, or a ValueError naming the field. Bools and floats are rejected."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def _normalise_stop(value: object) -> list[str]:
    """`stop` as a list of non-empty strings (a bare string is one stop string)."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop must be a str or a list of str, got {value!r}")
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"stop must contain only str, got {item!r} in {value!r}")
        if item == "":
            raise ValueError(f"stop must not contain an empty string, got {value!r}")
    return list(items)


def _normalise_stop_token_ids(value: object) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of int, got {value!r}")
    ids = [_int("stop_token_ids", item) for item in value]
    for token_id in ids:
        if token_id < 0:
            raise ValueError(f"stop_token_ids must be >= 0, got {token_id} in {value!r}")
    return ids


def _token_id(name: str, value: object) -> int:
    """A token id (int >= 0); a str of digits is taken too (JSON keys are strings)."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be token ids (int, or a str of digits), got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be token ids >= 0, got {value!r}")
    return int(value)


def _normalise_logit_bias(value: object) -> dict[int, float] | None:
    """logit_bias as {token id: bias}, each bias in OpenAI's [-100, 100]; {} becomes None."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {value!r}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = _token_id("logit_bias keys", key)
        number = _real(f"logit_bias[{token}]", bias)
        if not -_MAX_LOGIT_BIAS <= number <= _MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias[{token}] must be in [-{_MAX_LOGIT_BIAS:g}, "
                             f"{_MAX_LOGIT_BIAS:g}], got {bias!r}")
        out[token] = number
    return out or None


def _normalise_allowed_token_ids(value: object) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"allowed_token_ids must be a list of token ids, got {value!r}")
    if not value:
        raise ValueError("allowed_token_ids must not be empty (nothing could be sampled); give "
                         "at least one token id, or None to allow every token")
    return sorted({_token_id("allowed_token_ids", item) for item in value})


def _normalise_bad_words(value: object) -> list[str] | None:
    """bad_words as a list of non-blank strings (a bare string is one word)."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"bad_words must be a list of str, got {value!r}")
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise ValueError(f"bad_words must contain only non-blank str, got {item!r} in "
                             f"{value!r}")
    return list(items) or None


def _normalise_token_sequences(value: object) -> list[list[int]] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(seq, (list, tuple)) and seq for seq in value):
        raise ValueError(f"bad_words_token_ids must be a list of non-empty lists of token "
                         f"ids, got {value!r}")
    return [[_token_id("bad_words_token_ids", t) for t in seq] for seq in value] or None


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's `StructuredOutputsParams`): exactly one of `json` (a
    JSON schema, as a dict or its text), `regex`, `choice` (the output is one of the strings),
    `grammar` (EBNF, GBNF style: `root ::= ...`) or `json_object` (any JSON object).

    `disable_any_whitespace` keeps JSON compact (no free whitespace between tokens). vLLM's
    `disable_fallback` is accepted (there is one grammar engine, so nothing falls back);
    `whitespace_pattern`, `structural_tag` and `disable_additional_properties` are refused."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        for name, value in (("whitespace_pattern", self.whitespace_pattern),
                            ("structural_tag", self.structural_tag)):
            if value is not None:
                raise ValueError(f"structured_outputs.{name} is not supported; leave it unset")
        if self.disable_additional_properties:
            raise ValueError("structured_outputs.disable_additional_properties is not "
                             "supported; set additionalProperties: false in the schema")
        for name in ("disable_any_whitespace", "disable_fallback"):
            _bool(f"structured_outputs.{name}", getattr(self, name))
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {', '.join(given) or 'none'}")
        self._check_kind(given[0])

    def _check_kind(self, kind: str) -> None:
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or str), "
                             f"got {type(value).__name__}")
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty str, got "
                             f"{value!r}")
        if kind == "choice" and (not isinstance(value, (list, tuple)) or not value
                                 or not all(isinstance(c, str) and c for c in value)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty "
                             f"str, got {value!r}")
        if kind == "json_object":
            _bool("structured_outputs.json_object", value)

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar", "json_object"):
            if getattr(self, name) not in (None, False):
                return name
        raise AssertionError("validated in __post_init__")

    def key(self) -> tuple:
        """What identifies the compiled grammar (the compile cache's key)."""
        value = getattr(self, self.kind)
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        elif isinstance(value, (list, tuple)):
            value = tuple(value)
        return (self.kind, value, self.disable_any_whitespace)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Normalised to list[str] / list[int] by __post_init__.
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = field(default=None)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: until the context length is reached
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs of each sampled position
    prompt_logprobs: int | None = None  # top-N logprobs of each prompt position (from the 2nd)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Logits controls, applied per request in the batched sampler (vocabulary ids are checked
    # against the model by the front end's input processor).
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never completed, in any tokenization
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: max_model_len
    detokenize: bool = True  # False: token ids only, text stays ""
    # bad_words as token-id sequences, filled in by the front end's input processor (each
    # word's tokenizations with and without a leading space); the workers ban by these.
    bad_words_token_ids: list[list[int]] | None = None
    # Set by LLM.embed and /v1/embeddings, not by users: a pooling request (a prefill that
    # samples nothing and returns the pooled hidden state; see pooling_params.py).
    pooling: PoolingSpec | None = None

    def __post_init__(self) -> None:
        self._coerce_types()
        self._check_ranges()
        self._check_lengths()
        self.stop = _normalise_stop(self.stop)
        self._normalise_logits_controls()
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")

    def _normalise_logits_controls(self) -> None:
        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        self.allowed_token_ids = _normalise_allowed_token_ids(self.allowed_token_ids)
        self.bad_words = _normalise_bad_words(self.bad_words)
        self.bad_words_token_ids = _normalise_token_sequences(self.bad_words_token_ids)
        k = self.truncate_prompt_tokens
        if k is not None:
            k = self.truncate_prompt_tokens = _int("truncate_prompt_tokens", k)
        if k is not None and k < 1 and k != -1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1 (keep the last k prompt "
                             f"tokens) or -1 (keep max_model_len of them), got {k!r}")
        _bool("detokenize", self.detokenize)
        if not self.detokenize and self.stop:
            raise ValueError(f"stop strings need detokenize=True (they are matched in the "
                             f"text), got stop={self.stop!r} with detokenize=False; drop stop "
                             f"or use stop_token_ids")

    def check_token_ids(self, vocab_size: int) -> None:
        """ValueError naming the first logit_bias / allowed_token_ids / bad_words_token_ids id
        outside the model's vocabulary [0, vocab_size)."""
        fields = (("logit_bias", list(self.logit_bias or ())),
                  ("allowed_token_ids", self.allowed_token_ids or []),
                  ("bad_words_token_ids",
                   [t for seq in self.bad_words_token_ids or () for t in seq]))
        for name, ids in fields:
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} contains token id {bad[0]}, outside the vocabulary "
                                 f"[0, {vocab_size}) of this model (vocab size {vocab_size})")

    @property
    def has_logits_controls(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    def _coerce_types(self) -> None:
        """Type checks; numeric fields are normalised (temperature=0 becomes 0.0)."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            setattr(self, name, _real(name, getattr(self, name)))
        for name in ("n", "top_k", "min_tokens"):
            setattr(self, name, _int(name, getattr(self, name)))
        for name in ("max_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, _int(name, value))
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            _bool(name, getattr(self, name))

    def _check_ranges(self) -> None:
        checks = [
            ("n", self.n >= 1, ">= 1"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= -1, ">= -1 (0 or -1 disables it)"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
        ]
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                checks.append((name, 0 <= getattr(self, name) <= MAX_LOGPROBS,
                               f"in [0, {MAX_LOGPROBS}]"))
        for name, ok, valid in checks:
            if not ok:
                raise ValueError(f"{name} must be {valid}, got {getattr(self, name)!r}")

    def _check_lengths(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (or None), got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens!r}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


@dataclass
class BeamSearchParams:
    """LLM.beam_search's parameters, as vLLM's: `beam_width` beams kept per prompt, each grown
    by up to `max_tokens` tokens; `length_penalty` is the exponent of the sequence length that
    divides a beam's cumulative logprob when beams are ranked; `temperature` is that of the
    token sampled beside the top 2 * beam_width ones each step (0: argmax)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # the server's text keeps the EOS token's text

    def __post_init__(self) -> None:
        self.beam_width = _int("beam_width", self.beam_width)
        self.max_tokens = _int("max_tokens", self.max_tokens)
        self.temperature = _real("temperature", self.temperature)
        self.length_penalty = _real("length_penalty", self.length_penalty)
        _bool("ignore_eos", self.ignore_eos)
        _bool("include_stop_str_in_output", self.include_stop_str_in_output)
        # Each step asks for 2 * beam_width logprobs per beam, at most MAX_LOGPROBS.
        widest = MAX_LOGPROBS // 2
        if not 1 <= self.beam_width <= widest:
            raise ValueError(f"beam_width must be in [1, {widest}] (each step takes the top "
                             f"2 * beam_width logprobs, at most {MAX_LOGPROBS}), got "
                             f"{self.beam_width!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
