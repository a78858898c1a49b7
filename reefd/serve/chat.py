"""The provider-neutral chat turn: request, completion, chat templates and tool-call parsing.

Both provider APIs convert to and from these types; engines consume and produce them.
Renders an HF chat template and tokenizes with `tokenizers` + `jinja2` (no torch), so the
token ids an engine receives are exactly the ones recorded. Knows nothing about HTTP.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


@dataclass
class ChatRequest:
    """One chat turn to generate. Messages are OpenAI-shaped; tool-call arguments are JSON text."""

    messages: list[dict[str, Any]]
    max_tokens: int
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # SGLang's and vLLM's extension: generate to max_tokens
    top_logprobs: int = 0  # record the engine's top-K logprobs of every generated token (a recipe asks for it)
    routing_key: str | None = None  # keeps a conversation on one engine replica (the record's session)

    def __post_init__(self) -> None:
        # JSON Schema counts 2.0 as an integer, so the APIs take it for one: engines get the int it stands for
        # (one beyond 64 bits stays a float, which engines refuse, as reefd refuses such an integer)
        for name in ("max_tokens", "top_k", "seed"):
            if isinstance(value := getattr(self, name), float) and -(2**63) <= value < 2**63:
                setattr(self, name, int(value))


def add_system_text(chat: ChatRequest, block: str) -> None:
    """Add text (a harness) to the system prompt: after the client's own system text (kept as it is), or as a
    system message of its own when the client sent none. Every API is folded into these messages, so Chat
    Completions, Messages (`system`) and Responses (`instructions`) all get it in the same place."""
    if not block:
        return
    first = chat.messages[0] if chat.messages else None
    if first is not None and first.get("role") in ("system", "developer"):
        content = first.get("content")
        if isinstance(content, list):
            first = {**first, "content": [*content, {"type": "text", "text": block}]}
        else:
            first = {**first, "content": f"{content}\n\n{block}" if content else block}
        chat.messages = [first, *chat.messages[1:]]
    else:
        chat.messages = [{"role": "system", "content": block}, *chat.messages]


@dataclass
class Completion:
    """What the engine produced, already split into text and tool calls."""

    text: str | None
    finish_reason: str  # stop | length | tool_calls
    prompt_tokens: int
    completion_tokens: int
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    stop_sequence: str | None = None
    raw_text: str = ""
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float | None] | None = None
    # the engine's top-K per generated token: ids and logprobs, K of each per token (None: not captured)
    completion_top_ids: list[list[int]] | None = None
    completion_top_logprobs: list[list[float]] | None = None
    top_k_capture: str | None = None  # "full", or "partial" (the engine left some out: the channel is off)
    weight_version: str | None = None  # the weights that answered, as the engine reported them
    weights_reported: bool = False  # the engine reports its weight version (SGLang's meta_info.weight_version)


# ---------------------------------------------------------------- chat templates


def _special(value: Any) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        return value.get("content")
    return value if isinstance(value, str) else None


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class ChatTemplate:
    """An HF model folder's tokenizer and chat template, rendered the way transformers does."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        source = cfg.get("chat_template")
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.exists():
            source = jinja_file.read_text()
        if isinstance(source, list):  # named templates: take the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not source:
            raise ValueError(f"{model_dir}: the model has no chat template")
        self.source: str = source
        self.specials = {k: _special(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self.supports_tools = "tools" in source
        # No token stands for more characters than the longest in the vocabulary, and a normalizer merges at most
        # 3 characters into one (Unicode composition: Hangul jamo), so a text longer than 3 x that x the context
        # cannot fit: it is refused without being tokenized.
        self.max_token_chars = 3 * max((len(t) for t in self.tokenizer.get_vocab(with_added_tokens=True)), default=1)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True) -> str:
        if not self.supports_tools:  # e.g. SmolLM2: spell tools out in the Hermes convention
            messages, tools = fold_tools(messages, tools or []), None
        prepared = [_template_message(m) for m in messages]
        kwargs: dict[str, Any] = {k: v for k, v in self.specials.items() if v is not None}
        try:
            return self._template.render(messages=prepared, tools=tools or None,
                                         add_generation_prompt=add_generation_prompt, **kwargs)
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise TemplateError(f"the model's chat template cannot render this conversation: "
                                f"{exc}") from exc

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while the tokenizer works: a long prompt does not stall other threads
        return list(self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)

    def prompt_ids(self, req: ChatRequest, limit: int | None = None) -> list[int]:
        """The prompt's token ids, or PromptTooLong when they are more than `limit`.

        A tokenizer's memory grows with what it tokenizes at once, and stays with the process (9 MB of text took
        the tiny model's tokenizer to 880 MB). So a long text is first measured in slices, stopping as soon as it
        is surely over the limit (or refused unmeasured when even the longest tokens could not fit it), and only a
        text that fits is tokenized whole.
        """
        tools = [] if req.tool_choice == "none" else _chosen_tools(req.tools, req.tool_choice)
        text = self.render(req.messages, tools)
        if limit is not None and len(text) > MEASURE_SLICE:
            if len(text) > limit * self.max_token_chars:
                raise PromptTooLong(-(-len(text) // self.max_token_chars), limit)
            at_least = self._at_least(text, limit)
            if at_least > limit:
                raise PromptTooLong(at_least, limit)
        return self.encode(text)

    def _at_least(self, text: str, limit: int) -> int:
        """A lower bound of `text`'s tokens, measured slice by slice until it passes `limit`.

        Slices end before a space, where tokenizers start a new word anyway; should a cut still change the
        tokens near it, it changes them by at most two, which the bound takes off.
        """
        counted = cuts = start = 0
        while start < len(text) and counted - 2 * cuts <= limit:
            end = start + MEASURE_SLICE
            if end < len(text):
                space = text.rfind(" ", start + MEASURE_SLICE // 2, end)
                end = space if space > start else end
                cuts += 1
            counted += len(self.tokenizer.encode_batch([text[start:end]], add_special_tokens=False)[0])
            start = end
        return counted - 2 * cuts

    def count_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int:
        return len(self.encode(self.render(messages, tools)))


MEASURE_SLICE = 1 << 16  # characters a long prompt is measured by


class TemplateError(ValueError):
    """The conversation does not fit the model's chat template (a client error)."""


class PromptTooLong(ValueError):
    """The prompt has at least `at_least` tokens, more than the `limit` the model takes."""

    def __init__(self, at_least: int, limit: int):
        super().__init__(f"at least {at_least} tokens > {limit}")
        self.at_least = at_least
        self.limit = limit


HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def fold_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools, tool calls and tool results as plain text, for templates that know no tools."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = _template_message(m)["tool_calls"]
            text = "\n".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                             ensure_ascii=False) + "\n</tool_call>" for c in calls)
            head = m.get("content") or ""
            out.append({"role": m["role"], "content": f"{head}\n{text}" if head else text})
        else:
            out.append({**m, "content": m.get("content") or ""})
    if tools:
        block = HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _chosen_tools(tools: list[dict[str, Any]], choice: Any) -> list[dict[str, Any]]:
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        return [t for t in tools if t.get("function", {}).get("name") == name]
    return tools


def _template_message(msg: dict[str, Any]) -> dict[str, Any]:
    """transformers' convention: tool-call arguments are objects inside templates."""
    if not msg.get("tool_calls"):
        return msg
    calls = []
    for call in msg["tool_calls"]:
        fn = dict(call.get("function", {}))
        if isinstance(fn.get("arguments"), str):
            with contextlib.suppress(json.JSONDecodeError):
                fn["arguments"] = json.loads(fn["arguments"])
        calls.append({**call, "function": fn})
    return {**msg, "tool_calls": calls}


# ---------------------------------------------------------------- tool calls (Hermes convention)

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_BLOCK = re.compile(re.escape(TOOL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CLOSE) + r"|$)", re.DOTALL)


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split model output into (content, tool_calls). Malformed markup stays plain text."""
    start = text.find(TOOL_OPEN)
    if start < 0:
        return text, []
    calls: list[dict[str, Any]] = []
    for body in _TOOL_BLOCK.findall(text[start:]):
        try:
            parsed = json.loads(body.strip())
        except json.JSONDecodeError:
            return text, []
        for item in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return text, []
            args = item.get("arguments", item.get("parameters", {}))
            if isinstance(args, str):  # some models write the arguments as a JSON string
                with contextlib.suppress(json.JSONDecodeError):
                    args = json.loads(args)
            if not isinstance(args, dict):  # arguments are an object in every tool API
                return text, []
            calls.append({"id": new_tool_call_id(), "type": "function",
                          "function": {"name": item["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    content = text[:start].strip()
    return (content or None), calls
