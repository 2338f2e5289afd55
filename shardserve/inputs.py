"""Prompt shapes `LLM.generate` takes besides a plain string, as vLLM's `vllm.inputs` names them."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A prompt as text (tokenized by the engine, special tokens added)."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids (used as given); `prompt` is only echoed back on the output."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


__all__ = ["TextPrompt", "TokensPrompt"]
