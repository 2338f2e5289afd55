"""Tool calls on /v1/chat/completions, as vLLM answers them.

    tool_choice            how the call is made                      finish_reason
    "none"                 plain text (the template still sees the tools)   stop / length
    {"function": {name}}   structured outputs: JSON of that function's     stop
                           parameters schema; one call, its arguments
    "required"             structured outputs: a JSON array of >= 1        tool_calls
                           {"name", "parameters"} items, each item's
                           parameters matching its function's schema
    "auto"                 free text, parsed by --tool-call-parser         tool_calls when
                           (hermes: <tool_call>{"name", "arguments"}       a call was found
                           </tool_call> blocks; the rest is the content)

Constrained arguments are compact JSON (no free whitespace between tokens): they are read by
programs, and a model cannot spend its max_tokens on indentation.
"auto" needs --enable-auto-tool-choice and a --tool-call-parser, as in vLLM (else a 400).
Streamed, a tool-call response is sent whole at its end in OpenAI's delta format (a delta with
the role, the content if any, then the calls with their full arguments): named and required
calls are JSON that is only a call once complete, and auto calls are only known once parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from shardserve.entrypoints.server.protocol import ServerError
from shardserve.sampling_params import StructuredOutputsParams

PARSERS = ("hermes",)
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolMode:
    """What a request's tools and tool_choice ask for."""

    kind: str  # "none" | "named" | "required" | "auto"
    tools: dict[str, dict[str, Any]]  # function name → its parameters schema
    name: str | None = None  # the named function
    parallel: bool = True  # parallel_tool_calls: more than one call allowed

    def constraint(self) -> StructuredOutputsParams | None:
        if self.kind == "named":
            return StructuredOutputsParams(json=self.tools[self.name],
                                           disable_any_whitespace=True)
        if self.kind == "required":
            items = [{"type": "object", "required": ["name", "parameters"],
                      "properties": {"name": {"type": "string", "enum": [name]},
                                     "parameters": schema}}
                     for name, schema in self.tools.items()]
            array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputsParams(json=array, disable_any_whitespace=True)
        return None

    def calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a finished generation."""
        if self.kind == "named":
            return None, [_call(self.name, text)]
        if self.kind == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []  # cut by max_tokens: no complete call
            return None, [_call(i["name"], json.dumps(i["parameters"], ensure_ascii=False))
                          for i in items]
        if self.kind == "auto":
            content, calls = parse_hermes(text)
            return content, calls if self.parallel else calls[:1]
        return text, []


def tool_mode(tools: list[dict[str, Any]] | None, tool_choice: Any,
              parser: str | None, parallel: bool | None = None) -> ToolMode | None:
    """The request's ToolMode (None without tools); a 400 naming what is malformed."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise ServerError(400, "tool_choice needs tools", "tool_choice")
        return None
    specs = _tool_specs(tools)
    choice = "auto" if tool_choice is None else tool_choice
    parallel = parallel is not False
    if choice in ("none", "required"):
        return ToolMode(choice, specs, parallel=parallel)
    if choice == "auto":
        if parser is None:
            raise ServerError(400, '"auto" tool choice needs the server started with '
                              '--enable-auto-tool-choice and --tool-call-parser', "tool_choice")
        return ToolMode("auto", specs, parallel=parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise ServerError(400, f"tool_choice must be none, auto, required or "
                          f"{{'type': 'function', 'function': {{'name': ...}}}}, got "
                          f"{choice!r}", "tool_choice")
    if name not in specs:
        raise ServerError(400, f"tool_choice names {name!r}, which is not among the tools "
                          f"({', '.join(specs)})", "tool_choice")
    return ToolMode("named", specs, name, parallel)


def _tool_specs(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    specs = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ServerError(400, f"tools[{i}] must be {{'type': 'function', 'function': "
                              f"{{'name': ..., 'parameters': {{...}}}}}}", "tools")
        parameters = function.get("parameters") or _EMPTY_PARAMETERS
        if not isinstance(parameters, dict):
            raise ServerError(400, f"tools[{i}].function.parameters must be a JSON schema "
                              f"object", "tools")
        specs[function["name"]] = parameters
    return specs


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes-style calls (Qwen2, SmolLM2, Hermes templates): each <tool_call> block holds
    {"name": ..., "arguments": {...}}. Blocks that do not parse stay in the content."""
    calls, kept, last = [], [], 0
    for match in _HERMES.finditer(text):
        try:
            body = json.loads(match.group(1))
            name, arguments = body["name"], body.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(_call(name, arguments if isinstance(arguments, str)
                           else json.dumps(arguments, ensure_ascii=False)))
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
