"""Per-request limits of `shardserve serve`: what one request may ask for, checked before any
work is queued, so a single request cannot tie up the engine or the server's CPU.

Each limit is a flag (`add_limit_args`); a request over one gets a 400 naming the field, the value
sent and the flag that raises the limit. The body-size limit is enforced by
body_limit.BodySizeLimit (app middleware) before the body is read in full. This module imports
no server extra: `shardserve --help` works without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardserve.entrypoints.cli import FieldFlag, add_flags, collect, dataclass_flags

if TYPE_CHECKING:  # the server extra (pydantic) is imported only when serving
    from shardserve.entrypoints.server.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        ServerError,
    )

MIB = 1 << 20


@dataclass(frozen=True)
class ServerLimits:
    max_n: int = 128
    """Most completions per prompt (`n`, `best_of`)."""
    max_prompts: int = 128
    """Most prompts in one /v1/completions request."""
    max_choices: int = 256
    """Most completions in one request: n x the number of prompts."""
    max_stop: int = 16
    """Most stop strings in one request."""
    max_stop_len: int = 256
    """Longest stop string, in characters (streaming holds back this much text)."""
    max_stop_token_ids: int = 128
    """Most stop_token_ids in one request."""
    max_temperature: float = 100.0
    """Highest temperature (beyond a few, sampling is uniform anyway)."""
    max_request_body_bytes: int = 16 * MIB
    """Largest request body in bytes (16 MiB); a larger one gets HTTP 413 before it is read."""
    trust_request_chat_template: bool = False
    """Let requests send their own chat template (a Jinja program run by the server)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int)
                                    or value < 1):
                raise ValueError(f"{_flag(f.name)} must be an integer >= 1, got {value!r}")
        t = self.max_temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t < math.inf:
            raise ValueError(f"--max-temperature must be a finite number > 0, got {t!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerLimits:
        """The limits with the flags the user gave (add_limit_args); the defaults otherwise."""
        return cls(**collect(args, limit_flags()))

    # ---- the checks: each raises ServerError(400) naming field, value and flag ----
    def check_sampling(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        self._at_most("n", f"n={req.n}", req.n, "max_n")
        best_of = getattr(req, "best_of", None)
        if best_of is not None:
            self._at_most("best_of", f"best_of={best_of}", best_of, "max_n")
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        self._at_most("stop", f"stop has {len(stop)} strings, which", len(stop), "max_stop")
        for i, s in enumerate(stop):
            self._at_most("stop", f"stop[{i}] is {len(s)} characters long, which", len(s),
                          "max_stop_len")
        ids = req.stop_token_ids or []
        self._at_most("stop_token_ids", f"stop_token_ids has {len(ids)} ids, which", len(ids),
                      "max_stop_token_ids")
        if req.temperature is not None and not req.temperature <= self.max_temperature:
            # `not <=` also catches NaN, which compares false to everything
            raise _bad(f"temperature={req.temperature} must be a finite number at "
                       f"most the server's limit of {self.max_temperature} "
                       f"(--max-temperature)", "temperature")

    def check_prompt_count(self, num_prompts: int, n: int) -> None:
        self._at_most("prompt", f"prompt has {num_prompts} prompts, which", num_prompts,
                      "max_prompts")
        if num_prompts * n > self.max_choices:
            raise _bad(f"n={n} x {num_prompts} prompts = {num_prompts * n} "
                       f"completions exceeds the server's limit of {self.max_choices} "
                       f"per request (--max-choices); lower n or send fewer prompts", "n")

    def check_chat_template(self, req: ChatCompletionRequest) -> None:
        if self.trust_request_chat_template:
            return
        if req.chat_template is not None:
            param = "chat_template"
        elif "chat_template" in (req.chat_template_kwargs or {}):
            param = "chat_template_kwargs.chat_template"
        else:
            return
        raise _bad(f"{param}: this server does not run chat templates sent in "
                   f"requests (start it with --trust-request-chat-template to allow "
                   f"them); leave the field out to use the model's template", param)

    def _at_most(self, field: str, got: str, value: int, limit_name: str) -> None:
        limit = getattr(self, limit_name)
        if value > limit:
            raise _bad(f"{got} exceeds the server's limit of {limit} "
                       f"({_flag(limit_name)})", field)


def _bad(message: str, param: str) -> ServerError:
    from shardserve.entrypoints.server.protocol import ServerError

    return ServerError(400, message, param)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def limit_flags() -> list[FieldFlag]:
    return dataclass_flags(ServerLimits, "limits")


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerLimits field: its docstring and default are the help."""
    add_flags(parser.add_argument_group("request limits"), limit_flags())

