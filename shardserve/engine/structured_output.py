"""Structured outputs in the engine core: grammars compiled off the step's path, one matcher per
constrained request, and each step's token bitmask (xgrammar, as vLLM uses).

    add_request ──▶ compile on the grammar thread (cached by spec) ──▶ the request waits
    schedule    ──▶ SchedulerOutput.structured_positions {request: output index it samples}
    bitmask     ──▶ GrammarOutput (one packed row a constrained request) ──▶ sample_tokens
    update_from_output ──▶ the matcher accepts the sampled token

Speculative decoding: a constrained request verifies only the drafts its grammar accepts
(RequestGrammar.valid_drafts, when the scheduler takes them: every earlier token is then
folded in), and its bitmask has a row for every verified position, filled with the matcher
advanced through the drafts before it and rolled back after.

The ordering constraint (asynchronous scheduling): the row of a request that samples output
token p can only be filled once its matcher has accepted tokens 0..p-1, and with two steps in
flight token p-1 may still be sampling. `bitmask()` returns None until then; the engine core
then starts the step's forward pass anyway and sends its `sample_tokens` once the earlier step's
tokens are folded in (see core.py).

xgrammar is imported only when a constrained request arrives (its import takes seconds).
"""

from __future__ import annotations

import json
import logging
import math
import re
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shardserve.idle_threads import QuietThreadPool
from shardserve.messages import GrammarOutput, SchedulerOutput
from shardserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


def _xgr() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise ValueError(f"structured outputs need xgrammar ({e}); pip install xgrammar") from e
    return xgrammar


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


_CHECKED: dict[tuple, None] = {}  # specs that parsed (insertion-ordered, bounded)
_CHECKED_MAX = 256


def check_grammar(spec: StructuredOutputsParams) -> None:
    """Parse the spec's grammar without a tokenizer (milliseconds): a ValueError naming the
    problem for a schema, regex or grammar that cannot compile. Front ends call this before a
    request reaches the engine, so a bad grammar is a 400, not a request that never runs."""
    key = spec.key()
    if key in _CHECKED:
        return
    _parse(spec)
    if len(_CHECKED) >= _CHECKED_MAX:
        del _CHECKED[next(iter(_CHECKED))]
    _CHECKED[key] = None


def _parse(spec: StructuredOutputsParams) -> None:
    xgr = _xgr()
    kind, value = spec.kind, getattr(spec, spec.kind)
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(value if isinstance(value, str) else json.dumps(value),
                                         any_whitespace=not spec.disable_any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(value)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(value)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(list(value)))
    except (RuntimeError, ValueError, TypeError) as e:
        text = str(e).strip()
        # xgrammar's messages start with "[time] source.cc:line: "; the rest names the problem.
        message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[-1]) if text \
            else type(e).__name__
        raise ValueError(f"structured_outputs.{kind} does not compile: {message}") from e


@dataclass(eq=False)
class RequestGrammar:
    """One constrained request's grammar: compiling, then a matcher fed every output token."""

    compiled: Future
    matcher: Any = None
    num_accepted: int = 0  # output tokens the matcher has taken
    failed: str | None = None  # why the request cannot run (compile error, rejected token)
    # Output tokens produced before the request reached this core (a moved request): the
    # matcher takes them as soon as it exists, before any step of the request.
    replay: list[int] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        """Compiled (or failed): the scheduler may take the request."""
        if self.matcher is not None or self.failed is not None:
            return True
        if not self.compiled.done():
            return False
        try:
            self.matcher = _xgr().GrammarMatcher(self.compiled.result())
        except Exception as e:  # noqa: BLE001 - reported on the request
            self.failed = f"the grammar did not compile: {e}"
            return True
        replay, self.replay = self.replay, []
        for token in replay:
            if not self.accept(token):
                break
        return True

    def accept(self, token: int) -> bool:
        """Advance past one sampled token; False when the grammar rejects it."""
        self.num_accepted += 1
        if self.matcher is None or self.matcher.accept_token(token):
            return True
        self.failed = f"the grammar rejected token {token}"
        return False

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The leading drafts the grammar accepts after the tokens it has taken, up to one that
        would end it (a draft the grammar rejects is never verified, so never accepted; the
        token that ends the grammar is left to be sampled). The matcher is left as it was."""
        if self.matcher is None or not drafts:
            return drafts
        accepted = taken = 0
        for token in drafts:
            if not self.matcher.accept_token(token):
                break
            accepted += 1
            if self.matcher.is_terminated():
                break
            taken += 1
        if accepted:
            self.matcher.rollback(accepted)
        return drafts[:taken]

    def fill_rows(self, view: Any, row: int, drafts: list[int]) -> None:
        """Bitmask rows row .. row + len(drafts): the tokens allowed at each verified position,
        after the drafts before it (which valid_drafts let through); the matcher is left as it
        was."""
        self.matcher.fill_next_token_bitmask(view, row)
        for j, token in enumerate(drafts, start=1):
            self.matcher.accept_token(token)
            self.matcher.fill_next_token_bitmask(view, row + j)
        if drafts:
            self.matcher.rollback(len(drafts))


class StructuredOutputManager:
    """Compiles grammars on one background thread (cached by spec) and builds step bitmasks."""

    def __init__(self, tokenizer_path: Path, vocab_size: int, stop_token_ids: tuple[int, ...],
                 trust_remote_code: bool = False):
        self.tokenizer_path = tokenizer_path
        self.trust_remote_code = trust_remote_code
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.words = math.ceil(vocab_size / 32)
        self._pool: QuietThreadPool | None = None  # idle, it lets mp workers fork
        self._compiler: Any = None  # made on the grammar thread
        self._cache: dict[tuple, Future] = {}

    def grammar_for(self, spec: StructuredOutputsParams) -> RequestGrammar:
        key = spec.key()
        future = self._cache.get(key)
        if future is None:
            if self._pool is None:
                self._pool = QuietThreadPool("shardserve-grammar")
            future = self._cache[key] = self._pool.submit(self._compile, spec)
        return RequestGrammar(future)

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        xgr = _xgr()
        if self._compiler is None:
            from shardserve.model.loader import load_tokenizer

            info = xgr.TokenizerInfo.from_huggingface(
                load_tokenizer(self.tokenizer_path, self.trust_remote_code),
                vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        kind, value = spec.kind, getattr(spec, spec.kind)
        if kind == "json":
            schema = value if isinstance(value, str) else json.dumps(value)
            return self._compiler.compile_json_schema(
                schema, any_whitespace=not spec.disable_any_whitespace)
        if kind == "json_object":
            return self._compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return self._compiler.compile_regex(value)
        if kind == "choice":
            return self._compiler.compile_grammar(choice_ebnf(list(value)))
        return self._compiler.compile_grammar(value)

    def bitmask(self, so: SchedulerOutput, grammars: dict[str, RequestGrammar | None]
                ) -> GrammarOutput | None:
        """The step's rows, or None while a row's earlier tokens are not all accepted yet.
        `grammars`: each constrained request of the step → its grammar (None: it has finished
        meanwhile; its row allows everything, and its token is discarded)."""
        rows = so.structured_positions
        for rid, position in rows.items():
            grammar = grammars.get(rid)
            if grammar is not None and grammar.num_accepted < position:
                return None
        # Speculative decoding: a request verifying d drafts has 1 + d rows, its id repeated.
        spec = so.scheduled_spec_decode_tokens
        req_ids = [rid for rid in rows for _ in range(1 + len(spec.get(rid, ())))]
        bitmask = np.full((len(req_ids), self.words), -1, dtype=np.int32)
        import torch  # xgrammar fills torch tensors; the array shares their memory

        view = torch.from_numpy(bitmask)
        row = 0
        for rid in rows:
            grammar, drafts = grammars.get(rid), spec.get(rid, [])
            if grammar is not None and grammar.matcher is not None:
                grammar.fill_rows(view, row, drafts)
            row += 1 + len(drafts)
        return GrammarOutput(req_ids=req_ids, token_bitmask=bitmask)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
