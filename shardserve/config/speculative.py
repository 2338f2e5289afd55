"""Speculative decoding without a draft model (`speculative_config`), as vLLM's options name it.

    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
     "prompt_lookup_max": 5}
        prompt lookup: the longest recent n-gram (n in [min, max]) found earlier in the request's
        own tokens proposes the tokens that followed it (worker/spec_decode/ngram.py).
    {"method": "suffix", "num_speculative_tokens": 16}
        suffix decoding: a depth-limited suffix index over the request's prompt and output plus
        the outputs of recently finished requests, proposing the most frequent continuation
        (worker/spec_decode/suffix_tree.py).

`LLM(..., speculative_config={...})` takes a dict, a JSON object string or a SpeculativeConfig;
the CLI and the server take `--speculative-config JSON`. Draft models, EAGLE, Medusa and MTP
are refused: there is no second model to run. Every proposal is verified by the target model,
so outputs are the same as without speculation; these options only trade speed.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from shardserve.config.checks import check

METHODS = ("ngram", "suffix")
# vLLM's methods that need a draft model or extra heads: refused with one clear message.
DRAFT_MODEL_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp",
                       "deepseek_mtp", "dflash")
DRAFT_MODEL_KEYS = ("model", "draft_tensor_parallel_size", "draft_model_config", "quantization",
                    "revision", "code_revision", "speculative_token_tree")
NO_DRAFT_MODEL = "draft-model speculation is not supported; use method 'ngram' or 'suffix'"
# vLLM's older spelling of the n-gram method: {"model": "[ngram]"} (or "ngram").
_NGRAM_MODEL_NAMES = ("ngram", "[ngram]")
_DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min/max when neither is given


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    """ngram (prompt lookup) or suffix (suffix decoding)."""
    num_speculative_tokens: int | None = None
    """k: the most draft tokens one step verifies per request. Required with ngram; with
    suffix it defaults to suffix_decoding_max_tree_depth (a ceiling: the draft adapts)."""
    prompt_lookup_max: int | None = None
    """ngram: the longest n-gram matched. Neither given: both 5; one given: the other copies
    it (vLLM's rule)."""
    prompt_lookup_min: int | None = None
    """ngram: the shortest n-gram matched (<= prompt_lookup_max)."""
    suffix_decoding_max_tree_depth: int = 24
    """suffix: the most tokens of context matched plus proposed (the suffix index's depth)."""
    suffix_decoding_max_cached_requests: int = 1000
    """suffix: finished requests whose outputs stay in the global index, oldest evicted first;
    0 turns the global index off. (vLLM's default is 10000; smaller here because the index
    lives in the worker's Python process.)"""
    suffix_decoding_max_spec_factor: float = 1.0
    """suffix: a draft is at most this factor times the length of the matched context."""
    suffix_decoding_min_token_prob: float = 0.1
    """suffix: propose a token only while its estimated probability (the product of the
    continuation frequencies along the draft) is at least this."""
    min_acceptance_rate: float = 0.25
    """Per request: stop proposing while the recent share of accepted draft tokens is below
    this, probing again after speculation_backoff_steps steps. 0 never stops. Measured break-
    even on the default model (2-core Zen 4, k = 4, batch 1): with the gate off, the free-writing
    set verified 132 drafts in 34 steps, accepted 35 (0.27), and ran 0.96-1.04x no speculation:
    a verify step there costs about two decode steps."""
    speculation_backoff_steps: int = 32
    """Steps a request goes without proposals after its acceptance fell below
    min_acceptance_rate, before one probing proposal. Provisional default."""
    max_batch_for_speculation: int = 2
    """With more running requests than this, propose nothing: a larger batch is no longer bound
    by reading the weights, so verifying drafts costs more than it saves. Measured with
    bench/spec_decode.py on the default model (2-core Zen 4, k = 4, ngram), tok/s over no
    speculation on the code / free sets: 1 running 2.11x / 1.05x, 2 running 1.54x / 1.02x,
    4 running 0.98x / 0.85x (one draft each under max_verify_rows: the few-rows kernels cost
    about in proportion to the rows from 4 rows of x on). A machine with more cores or
    bandwidth per core may raise it."""
    max_verify_rows: int = 8
    """A step's rows (its running requests' tokens plus their drafts) up to which drafts are
    scheduled, shared evenly among the requests; 0: no cap. Verifying pays while a step stays
    on the few-rows kernels (the tiles' rows, quant_rows_max.ROWS_MAX_TILES, were 8 then): measured
    with bench/spec_decode.py on the default model (2-core Zen 4), uncapped drafts at 4 and 8
    running requests took the step to the panel GEMM and ran 0.72-0.92x no speculation."""

    def __post_init__(self) -> None:
        _check_method(self.method)
        _check_int("num_speculative_tokens", self.num_speculative_tokens, minimum=1, none=True)
        if self.method == "ngram":
            self._resolve_ngram()
        else:
            self._resolve_suffix()
        self._check_gates()

    @classmethod
    def from_dict(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a dict of the fields, a JSON object string (the CLI) or a SpeculativeConfig;
        None stays None. ValueError naming what is wrong and what is accepted."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = _parse_json(value)
        check(isinstance(value, dict), f"speculative_config must be a dict, a JSON object string "
              f"or a SpeculativeConfig, got {type(value).__name__}")
        options = _translate_model_key(dict(value))
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(known))
        check(not unknown, f"speculative_config key(s) {', '.join(map(repr, unknown))} are not "
              f"supported; accepted keys: {', '.join(known)}")
        check("method" in options, f"speculative_config needs a method: one of "
              f"{', '.join(map(repr, METHODS))}")
        return cls(**options)

    def _resolve_ngram(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        _check_int("prompt_lookup_min", lo, minimum=1, none=True)
        _check_int("prompt_lookup_max", hi, minimum=1, none=True)
        if lo is None and hi is None:
            lo = hi = _DEFAULT_LOOKUP
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        check(lo <= hi, f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}; lower "
              f"prompt_lookup_min or raise prompt_lookup_max")
        check(self.num_speculative_tokens is not None,
              "speculative_config method 'ngram' needs num_speculative_tokens (the most draft "
              "tokens a step verifies), e.g. 3")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def _resolve_suffix(self) -> None:
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            check(getattr(self, name) is None, f"{name} applies to method 'ngram' only; drop it "
                  f"or use method 'ngram'")
        depth = self.suffix_decoding_max_tree_depth
        _check_int("suffix_decoding_max_tree_depth", depth, minimum=2)
        _check_int("suffix_decoding_max_cached_requests",
                   self.suffix_decoding_max_cached_requests, minimum=0)
        factor = self.suffix_decoding_max_spec_factor
        _check_number("suffix_decoding_max_spec_factor", factor)
        check(factor > 0, f"suffix_decoding_max_spec_factor={factor!r} must be > 0 (a draft "
              f"may be this factor times the matched length; 1.0 is vLLM's default)")
        prob = self.suffix_decoding_min_token_prob
        _check_number("suffix_decoding_min_token_prob", prob)
        check(0 <= prob <= 1, f"suffix_decoding_min_token_prob={prob!r} must be in [0, 1]")
        if self.num_speculative_tokens is None:  # vLLM's default: the draft adapts below it
            object.__setattr__(self, "num_speculative_tokens", depth)

    def _check_gates(self) -> None:
        rate = self.min_acceptance_rate
        _check_number("min_acceptance_rate", rate)
        check(0 <= rate <= 1, f"min_acceptance_rate={rate!r} must be in [0, 1] (0: never stop "
              f"proposing)")
        _check_int("speculation_backoff_steps", self.speculation_backoff_steps, minimum=1)
        _check_int("max_batch_for_speculation", self.max_batch_for_speculation, minimum=1)
        _check_int("max_verify_rows", self.max_verify_rows, minimum=0)


def _check_method(method: object) -> None:
    check(method not in DRAFT_MODEL_METHODS and not str(method).endswith("_mtp"),
          f"speculative_config method={method!r}: {NO_DRAFT_MODEL}")
    check(method in METHODS, f"speculative_config method={method!r} is not supported; choose "
          f"one of {', '.join(map(repr, METHODS))}")


def _translate_model_key(options: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `{"model": "[ngram]"}` means the n-gram method; any other draft-model key is
    refused with the one message that says what exists."""
    model = options.pop("model", None)
    if model in _NGRAM_MODEL_NAMES and options.get("method", "ngram") == "ngram":
        options["method"] = "ngram"
    elif model is not None:
        raise ValueError(f"speculative_config model={model!r}: {NO_DRAFT_MODEL}")
    draft_keys = sorted(set(options) & set(DRAFT_MODEL_KEYS))
    check(not draft_keys, f"speculative_config key(s) {', '.join(map(repr, draft_keys))}: "
          f"{NO_DRAFT_MODEL}")
    return options


def _parse_json(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"speculative_config={text!r} is not a JSON object: {e}; e.g. "
                         f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 3}}'") from e


def _check_int(name: str, value: object, minimum: int, none: bool = False) -> None:
    if none and value is None:
        return
    check(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
          f"{name}={value!r} must be an int >= {minimum}")


def _check_number(name: str, value: object) -> None:
    check(isinstance(value, (int, float)) and not isinstance(value, bool),
          f"{name}={value!r} must be a number")
