"""`shardserve generate`: offline generation from the command line.

Prompts come from the arguments, from `--input FILE` (one prompt per line, or JSONL with one of
{"prompt": str}, {"prompt_token_ids": [int]}, {"messages": [{"role", "content"}]} per line;
"-" is stdin), or from stdin when no prompt is given and stdin is not a terminal.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

from shardserve.entrypoints.cli import (
    CLIError,
    add_engine_args,
    add_flags,
    collect,
    dataclass_flags,
    engine_kwargs,
)
from shardserve.outputs import CompletionOutput, RequestOutput
from shardserve.sampling_params import SamplingParams

_SAMPLING_HELP = {
    "n": "Completions per prompt.",
    "temperature": "Sampling temperature; 0 is greedy.",
    "top_p": "Nucleus sampling: keep the smallest set of tokens with this much probability.",
    "top_k": "Keep the k most likely tokens; 0 or -1 disables it.",
    "min_p": "Drop tokens less likely than min_p times the most likely one.",
    "seed": "Per-request sampling seed (the engine's seed is --engine-seed).",
    "stop": "Stop string (repeat the flag for several).",
    "stop_token_ids": "Token ids that end generation.",
    "ignore_eos": "Keep generating past the end-of-sequence token.",
    "max_tokens": "Most tokens to generate per completion.",
    "min_tokens": "Generate at least this many tokens before EOS or stop tokens may end it.",
    "logprobs": "Report the top-N logprobs of each generated token (in --output).",
}


def sampling_flags():
    # `pooling` is set by LLM.embed, not a user's option.
    return dataclass_flags(SamplingParams, "sampling", frozenset({"pooling"}),
                           extra_help=_SAMPLING_HELP)


@dataclass
class PromptItem:
    """One prompt as the user gave it (`source`, echoed in --output) and in LLM.generate's form."""

    source: str | list[int] | list[dict[str, Any]]
    prompt: str | dict[str, Any] | None = None
    messages: list[dict[str, Any]] | None = None  # templated once the tokenizer is loaded


class GenerateCommand:
    name = "generate"
    help = "Generate completions for prompts (arguments, --input file, or stdin)."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("prompts", nargs="*", metavar="PROMPT", help="Prompt texts.")
        parser.add_argument(
            "--input", metavar="FILE", help='One prompt per line, or JSONL with "prompt", '
            '"prompt_token_ids" or "messages" per line; "-" reads stdin.'
        )
        parser.add_argument(
            "--output", metavar="FILE", help="Write one JSON object per completion: prompt, "
            "text, token_ids, finish_reason (and logprobs with --logprobs)."
        )
        parser.add_argument(
            "--chat", action="store_true",
            help="Apply the model's chat template: each text prompt becomes one user message.",
        )
        add_flags(parser.add_argument_group("sampling options"), sampling_flags())
        add_engine_args(parser)

    def run(self, args: argparse.Namespace) -> int:
        from shardserve.entrypoints.llm import LLM

        params = SamplingParams(**collect(args, sampling_flags()))
        items = gather_prompts(args)
        out_file = open(args.output, "w", encoding="utf-8") if args.output else None  # noqa: SIM115
        llm = None
        try:
            llm = LLM(args.model, **engine_kwargs(args))
            prompts = [to_prompt(item, llm.get_tokenizer) for item in items]
            start = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=True)
            elapsed = time.perf_counter() - start
            print_results(items, results, sys.stdout)
            if out_file is not None:
                write_jsonl(items, results, out_file, llm.get_tokenizer())
            print(summary_line(results, elapsed), file=sys.stderr)
        finally:
            if out_file is not None:
                out_file.close()
            if llm is not None:
                llm.shutdown()
        return 0


# ---- reading prompts ----
def gather_prompts(args: argparse.Namespace) -> list[PromptItem]:
    items = [text_item(p, f"prompt {i}", args.chat) for i, p in enumerate(args.prompts, 1)]
    if args.input == "-" or (args.input is None and not items and not sys.stdin.isatty()):
        items += parse_lines(sys.stdin, "<stdin>", args.chat)
    elif args.input is not None:
        try:
            with open(args.input, encoding="utf-8") as f:
                items += parse_lines(f, args.input, args.chat)
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"cannot read --input {args.input!r}: {e}") from e
    if not items:
        raise CLIError("no prompts: give them as arguments, with --input FILE, or on stdin")
    return items


def text_item(text: str, origin: str, chat: bool) -> PromptItem:
    if not isinstance(text, str) or text == "":
        raise CLIError(f"{origin}: prompt is empty")
    if chat:
        return PromptItem(text, messages=[{"role": "user", "content": text}])
    return PromptItem(text, prompt=text)


def parse_lines(lines: Iterable[str], origin: str, chat: bool) -> list[PromptItem]:
    """Plain text (one prompt per line; blank lines skipped), or JSONL when the first
    non-blank line is a JSON object."""
    numbered = [(i, line.rstrip("\r\n")) for i, line in enumerate(lines, 1)]
    numbered = [(i, line) for i, line in numbered if line.strip()]
    if numbered and _is_json_object(numbered[0][1]):
        return [json_item(line, f"{origin}:{i}", chat) for i, line in numbered]
    return [text_item(line, f"{origin}:{i}", chat) for i, line in numbered]


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def json_item(line: str, origin: str, chat: bool) -> PromptItem:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise CLIError(f"{origin}: not valid JSON ({e})") from e
    keys = [k for k in ("prompt", "prompt_token_ids", "messages") if isinstance(obj, dict)
            and k in obj]
    if len(keys) != 1:
        raise CLIError(
            f"{origin}: expected a JSON object with exactly one of 'prompt', "
            f"'prompt_token_ids' or 'messages', got {line.strip()[:80]!r}"
        )
    value = obj[keys[0]]
    if keys[0] == "prompt":
        return text_item(value, origin, chat)
    if keys[0] == "prompt_token_ids":
        if not value or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise CLIError(f"{origin}: prompt_token_ids must be a non-empty list of ints")
        return PromptItem(value, prompt={"prompt_token_ids": value})
    if not value or not all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        raise CLIError(f"{origin}: messages must be a non-empty list of {{role, content}} objects")
    return PromptItem(value, messages=value)


def to_prompt(item: PromptItem, get_tokenizer: Callable[[], Any]) -> str | dict[str, Any]:
    """The item in LLM.generate's form; conversations go through the chat template (the
    tokenizer is asked for only then: a plain prompt's first token does not wait for it)."""
    if item.messages is None:
        return item.prompt
    tokenizer = get_tokenizer()
    ids = tokenizer.apply_chat_template(
        item.messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    text = tokenizer.decode(list(ids))
    return {"prompt": text, "prompt_token_ids": list(ids)}


# ---- writing results ----
def display(item: PromptItem) -> str:
    if isinstance(item.source, str):
        return item.source
    if item.messages is not None:
        return str(item.messages[-1].get("content", ""))
    return json.dumps(item.source)


def print_results(items: list[PromptItem], results: list[RequestOutput], out: IO[str]) -> None:
    for i, (item, result) in enumerate(zip(items, results, strict=True), 1):
        print(f"--- prompt {i} ---", file=out)
        print(display(item), file=out)
        for c in result.outputs:
            tag = f"{i}" if len(result.outputs) == 1 else f"{i}.{c.index + 1}"
            print(f"--- output {tag} (finish_reason={c.finish_reason}) ---", file=out)
            print(c.text, file=out)
    out.flush()


def completion_record(item: PromptItem, c: CompletionOutput, tokenizer: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "prompt": item.source,
        "index": c.index,
        "text": c.text,
        "token_ids": list(c.token_ids),
        "finish_reason": c.finish_reason,
    }
    if c.logprobs is not None:
        record["cumulative_logprob"] = c.cumulative_logprob
        record["logprobs"] = [
            [{"token_id": tid, "token": tokenizer.decode([tid]), "logprob": lp.logprob,
              "rank": lp.rank} for tid, lp in position.items()]
            for position in c.logprobs
        ]
    return record


def write_jsonl(
    items: list[PromptItem], results: list[RequestOutput], out: IO[str], tokenizer: Any
) -> None:
    for item, result in zip(items, results, strict=True):
        for c in result.outputs:
            out.write(json.dumps(completion_record(item, c, tokenizer), ensure_ascii=False) + "\n")


def summary_line(results: list[RequestOutput], elapsed: float) -> str:
    prompt_tokens = sum(len(r.prompt_token_ids) for r in results)
    output_tokens = sum(len(c.token_ids) for r in results for c in r.outputs)
    rate = output_tokens / elapsed if elapsed > 0 else 0.0
    return (
        f"summary: requests={len(results)} prompt_tokens={prompt_tokens} "
        f"output_tokens={output_tokens} elapsed_s={elapsed:.2f} output_tokens_per_s={rate:.1f}"
    )
