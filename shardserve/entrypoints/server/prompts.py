"""Prompt preparation for the server: tokenizing and chat-template rendering, off the event loop.

Both are CPU work proportional to the prompt (a 16 MiB body takes seconds), so they run on a
worker thread and /health and open streams keep answering meanwhile. One thread: HF fast
tokenizers are not safe to share between threads that encode at once, and a queue of prompts
is bounded anyway by the per-request limits.

A text far longer than max_model_len could ever hold is not tokenized in full: only a prefix of
max_model_len * _CHARS_PER_TOKEN characters is, and if that prefix alone is over max_model_len
tokens the prompt is refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from shardserve.entrypoints.server.protocol import ServerError

Prompt = tuple[str | None, list[int]]
T = TypeVar("T")

# Generous: real tokenizers average 3-5 characters per token. A text whose average is higher
# (long runs of whitespace, say) is tokenized in full, so the answer is exact either way.
_CHARS_PER_TOKEN = 16


class PromptPreparer:
    def __init__(self, inputs: Any, tokenizer: Any, max_model_len: int,
                 chat_template: str | None = None) -> None:
        self.inputs = inputs  # engine.input_processor.InputProcessor: the prompt checks
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.chat_template = chat_template  # --chat-template: instead of the model's own
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardserve-tok")

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    # truncate: keep the last k tokens of each prompt (vLLM's truncate_prompt_tokens; -1 is
    # max_model_len), so a longer prompt is cut rather than refused.
    async def completion_prompts(self, prompts: list[str | list[int]],
                                 truncate: int | None = None) -> list[Prompt]:
        return await self._run(lambda: [self._prompt(p, truncate) for p in prompts])

    async def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          template_kwargs: dict[str, Any], truncate: int | None = None
                          ) -> Prompt:
        return await self._run(lambda: self._chat_prompt(
            messages, add_generation_prompt, template_kwargs, truncate))

    # /tokenize and /detokenize: no length check (they report the count and the limit).
    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self._run(lambda: self._tokenize(text, add_special_tokens, "prompt",
                                                      bounded=False))

    async def render_chat(self, messages: list[dict[str, Any]],
                          add_generation_prompt: bool) -> list[int]:
        def render() -> list[int]:
            text = self._render(messages, add_generation_prompt, {})
            return self._tokenize(text, False, "messages", bounded=False)
        return await self._run(render)

    async def decode(self, ids: list[int]) -> str:
        return await self._run(lambda: self.tokenizer.decode(ids))

    def _prompt(self, prompt: str | list[int], truncate: int | None) -> Prompt:
        if isinstance(prompt, str):
            ids = self._tokenize(prompt, add_special_tokens=True, param="prompt",
                                 bounded=truncate is None)
            return self._checked({"prompt": prompt, "prompt_token_ids": ids}, "prompt",
                                 truncate)
        return self._checked(prompt, "prompt", truncate)

    def _chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     template_kwargs: dict[str, Any], truncate: int | None) -> Prompt:
        text = self._render(messages, add_generation_prompt, template_kwargs)
        # As apply_chat_template(tokenize=True) does: the template writes the special tokens.
        ids = self._tokenize(text, add_special_tokens=False, param="messages",
                             bounded=truncate is None)
        return self._checked({"prompt_token_ids": ids}, "messages", truncate)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                template_kwargs: dict[str, Any]) -> str:
        kwargs = dict(template_kwargs)
        if self.chat_template is not None and "chat_template" not in kwargs:
            kwargs["chat_template"] = self.chat_template
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                **kwargs)
        except Exception as e:  # a template may raise on an unexpected conversation
            raise ServerError(400, f"cannot apply the chat template: {e}", "messages") from e

    def _tokenize(self, text: str, add_special_tokens: bool, param: str,
                  bounded: bool = True) -> list[int]:
        bound = self.max_model_len * _CHARS_PER_TOKEN
        if bounded and len(text) > bound:
            head = self.tokenizer.encode(text[:bound], add_special_tokens=add_special_tokens)
            if len(head) > self.max_model_len:
                raise ServerError(
                    400, f"{param} is longer than max_model_len={self.max_model_len} tokens: "
                    f"its first {bound} of {len(text)} characters are already {len(head)} "
                    f"tokens; shorten it (or start the server with a larger --max-model-len)",
                    param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _checked(self, prompt: Any, param: str, truncate: int | None = None) -> Prompt:
        try:
            return self.inputs.process_prompt(prompt, truncate)
        except ValueError as e:
            raise ServerError(400, str(e), param) from e
