"""How a model family writes tool calls: what its chat template is given, how a call looks in the
generated text, and the grammar that makes a call well formed.

A format reads a completion's text as a `ToolView`: the text the client sees as content, and the
calls made so far. While the completion runs (``final=False``) a view withholds whatever may still
turn out to be a call (an open call, the first characters of a call's opening tag, an answer that
so far looks like a call written as bare or fenced JSON), so that each view's content extends the
one before it and a stream of content deltas never takes anything back. The last view
(``final=True``) releases what did not become a call.

Formats (``--tool-call-parser``), chosen from the chat template when not named:

* ``hermes`` (Qwen2.5, Qwen3, Hermes, and any model whose template does not render tools): calls
  written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; an answer that is only
  such an object, bare or in a ```json fence (as Qwen2.5-Coder often writes it), is a call too;
* ``llama3_json`` (Llama 3.1 to 3.3): an answer that is only ``{"name": ..., "parameters":
  {...}}`` objects, separated by ``;``;
* ``mistral`` (Mistral's, chosen where the template writes ``[TOOL_CALLS]``): text, then
  ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}`` calls, or ``name[ARGS]{...}``
  after each ``[TOOL_CALLS]`` (newer tokenizers);
* ``pythonic`` (Llama 3.2 and 4, Gemma 3; named, never guessed): an answer that is only a Python
  list of calls with arguments by name, ``[weather(city="Oslo"), ...]``, bare or in a
  ```tool_code fence (``print(...)`` around it too, as Gemma writes it), read with `ast` and
  never evaluated; JSON's true, false and null are taken for Python's.

A template that does not render tools (SmolLM2's, Gemma's) gets them from sluice instead: the
tools described in the system message, earlier calls and their results written as hermes text.

`ToolFormat.grammar` gives the Lark grammar (llguidance's dialect) that holds a completion to
calls only (``tool_choice`` ``required`` or a named function), or, with ``auto``, lets it write
text and then holds the calls it opens (where the opening tag is a token of the model's own, as
Qwen2.5's ``<tool_call>`` is): each call's arguments follow its function's JSON Schema, written
with the separators ``json.dumps`` uses (what templates render and models imitate), so that they
always parse and validate.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from sluice.engine.errors import EngineError

FIELD = "tools"
# llguidance's JSON options: one way to write the separators, no free whitespace to wander in.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class ToolView:
    content: str
    calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class Tools:
    """The tools of one request, as its chat template and grammar need them."""

    functions: tuple[Mapping[str, Any], ...]  # OpenAI's {"type": "function", "function": {...}}
    choice: str = "auto"  # "auto", "none" or "required" (a named tool_choice is "required")
    forced: str | None = None  # the function a named tool_choice calls
    parallel: bool = True
    names: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", frozenset(_name(t) for t in self.functions))

    @property
    def parsed(self) -> bool:
        """Whether the completion's text is read for calls (not with tool_choice "none")."""
        return self.choice != "none"

    @property
    def constrained(self) -> bool:
        """Whether the completion must be calls and nothing else."""
        return self.choice == "required"


def _name(tool: Mapping[str, Any]) -> str:
    return str(tool["function"]["name"])


def _parameters(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    schema = tool["function"].get("parameters")
    return schema if isinstance(schema, Mapping) else {"type": "object", "properties": {}}


def _as_call(obj: Any, names: frozenset[str] | None, arguments_key: str) -> ToolCall | None:
    """A decoded JSON value as a call: an object with a string name (one of `names` when given)
    and an object of arguments (absent means none)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _decode(text: str) -> Any:
    """JSON as models write it: a line break inside a string (a program written over several
    lines, as small models do) is read as the "\\n" it means."""
    try:
        return json.loads(text, strict=False)
    except ValueError:
        return None


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (0: none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# Fence languages under which an answer written as JSON may be a call.
_CALL_FENCES = frozenset({"", "json", "tool_call", "tool_code"})


def _may_be_whole(text: str, openers: str = "{[", fences: frozenset[str] = _CALL_FENCES) -> bool:
    """Whether an answer so far may still be one bare value (beginning with one of `openers`) or
    one in a fence of one of `fences` (then a view holds it back until the answer ends)."""
    head = text.lstrip()
    if not head or head[0] in openers:
        return True
    if not head.startswith("```"):
        return "```".startswith(head)
    line_end = head.find("\n")
    if line_end < 0:
        return True
    return head[3:line_end].strip().lower() in fences


def _unfenced(text: str) -> str | None:
    """An answer's body: the answer, or what is inside its one fence; None for a fence not
    closed."""
    body = text.strip()
    if body.startswith("```"):
        line_end = body.find("\n")
        if line_end < 0 or not body.endswith("```") or len(body) < line_end + 4:
            return None
        body = body[line_end + 1 : -3].strip()
    return body


def _whole_json(text: str) -> Any:
    """The JSON value an answer consists of, bare or in one fence; None when it is not one."""
    body = _unfenced(text)
    return None if body is None else _decode(body)


class Vocabulary(Protocol):
    """What a format asks of the tokenizer (the engine's `Tokenizer`)."""

    def is_added_token(self, text: str) -> bool: ...


class ToolFormat(ABC):
    """One family's way of writing tool calls (see the module's docstring)."""

    name: ClassVar[str]

    def __init__(self, tokenizer: Vocabulary | None = None):
        self.tokenizer = tokenizer

    @abstractmethod
    def view(self, text: str, tools: Tools, final: bool) -> ToolView:
        """The content and calls of a completion's text."""

    @abstractmethod
    def grammar(self, tools: Tools) -> str | None:
        """The Lark grammar a completion samples by. Calls must be made (``tools.constrained``):
        calls only, one or more (one when `tools.parallel` is false, or a function is forced),
        each to `tools.forced` or any of the tools. Otherwise (``auto``): any text, then calls
        held to the tools' schemas, where the format can tell a call's start from text (its
        opening tag is a token of the model's own); None where it cannot."""

    def system_text(self, tools: Tools) -> str:
        """The tools, described for a model whose chat template does not render them."""
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.functions)
        return (
            "# Tools\n\nYou can call functions to answer. They are described as JSON Schemas "
            f"inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n\nTo call one, answer with "
            "its name and arguments as a JSON object inside <tool_call></tool_call> tags:\n"
            '<tool_call>\n{"name": <function name>, "arguments": <JSON object of arguments>}\n'
            "</tool_call>"
        )

    def calls_text(self, calls: Sequence[Mapping[str, Any]]) -> str:
        """An assistant's earlier calls, written as text for such a model."""
        return "\n".join(
            "<tool_call>\n"
            + json.dumps(
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                ensure_ascii=False,
            )
            + "\n</tool_call>"
            for c in calls
        )

    @staticmethod
    def result_text(content: str) -> str:
        """A tool's result, written as text for such a model."""
        return f"<tool_response>\n{content}\n</tool_response>"

    # -- grammar pieces ------------------------------------------------------------------------

    def _literal(self, text: str) -> str:
        """`text` in a grammar: the model's own token when the vocabulary has one for it (a
        tokenizer's added token is matched as a token, never as its characters)."""
        if self.tokenizer is not None and self.tokenizer.is_added_token(text):
            return text
        return json.dumps(text)

    @staticmethod
    def _call_schema(tools: Tools, arguments_key: str) -> dict[str, Any]:
        chosen = [t for t in tools.functions if tools.forced in (None, _name(t))]
        options = [
            {
                "type": "object",
                "properties": {"name": {"const": _name(t)}, arguments_key: _parameters(t)},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
            for t in chosen
        ]
        schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
        return {"x-guidance": _JSON_STYLE, **schema}

    def _start(self, tools: Tools, calls: str, mark: str) -> str | None:
        """The grammar's start: calls only where they must be made; otherwise any text, then calls,
        where the calls' opening `mark` is a token of the model's own (text cannot spell it: the
        token begins a call, and nothing else); None where it is not."""
        if tools.constrained:
            return f"start: {calls}"
        if self.tokenizer is not None and self.tokenizer.is_added_token(mark):
            return f"start: TEXT | TEXT {calls}\nTEXT: /(?s:.*)/"
        return None

    @staticmethod
    def _calls(tools: Tools, one: str, separator: str) -> str:
        """Calls, and the separator after the last one too (then the end: a model writes the
        separator before it knows whether another call follows)."""
        sep = json.dumps(separator)
        if tools.parallel and tools.forced is None:
            return f"{one} ({sep} {one})* {sep}?"
        return f"{one} {sep}?"


class HermesFormat(ToolFormat):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def view(self, text: str, tools: Tools, final: bool) -> ToolView:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (start := text.find(self.OPEN, pos)) >= 0:
            content.append(text[pos:start])
            end = text.find(self.CLOSE, start)
            if end < 0:  # a call still being written
                if not final:
                    return _settled("".join(content), calls, final)
                call = _as_call(_decode(text[start + len(self.OPEN) :]), None, "arguments")
                if call is None:
                    content.append(text[start:])
                else:  # the model ended without closing it: the call is whole all the same
                    calls.append(call)
                return _settled("".join(content), calls, final)
            call = _as_call(_decode(text[start + len(self.OPEN) : end]), None, "arguments")
            if call is None:  # not a call after all: it is text
                content.append(text[start : end + len(self.CLOSE)])
            else:
                calls.append(call)
            pos = end + len(self.CLOSE)
        rest = text[pos:]
        if pos == 0 and _may_be_whole(text):
            if not final:
                return ToolView("")
            whole = _whole_json(text)
            found = [_as_call(o, tools.names, "arguments") for o in _listed(whole)]
            if found and all(c is not None for c in found):
                return ToolView("", tuple(c for c in found if c is not None))
            return ToolView(text)
        if not final:
            rest = rest[: len(rest) - partial_suffix(rest, self.OPEN)]
        content.append(rest)
        return _settled("".join(content), calls, final)

    def grammar(self, tools: Tools) -> str | None:
        start = self._start(tools, self._calls(tools, "call", "\n"), self.OPEN)
        if start is None:
            return None
        schema = json.dumps(self._call_schema(tools, "arguments"), ensure_ascii=False)
        return "\n".join(
            [
                start,
                f'call: {self._literal(self.OPEN)} "\\n" body "\\n" {self._literal(self.CLOSE)}',
                f"body: %json {schema}",
            ]
        )


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"

    def view(self, text: str, tools: Tools, final: bool) -> ToolView:
        head = text.lstrip()
        if not head or head[0] == "{":
            if not final:
                return ToolView("")
            found = [_as_call(o, tools.names, "parameters") for o in _objects(head)]
            if found and all(c is not None for c in found):
                return ToolView("", tuple(c for c in found if c is not None))
        return ToolView(text)

    def grammar(self, tools: Tools) -> str | None:
        if not tools.constrained:
            return None  # (a call is an answer that is only JSON: no sign of it before it ends)
        schema = json.dumps(self._call_schema(tools, "parameters"), ensure_ascii=False)
        return "\n".join([f"start: {self._calls(tools, 'body', '; ')}", f"body: %json {schema}"])


def _objects(text: str) -> list[Any]:
    """The JSON values of a text that is only JSON values, separated by ';' and white space (a
    ';' inside a string is the string's); [None] when it is anything else."""
    decoder, pos = json.JSONDecoder(strict=False), 0
    out: list[Any] = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        if pos == len(text):
            return out
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return [None]
        out.append(value)


def _settled(content: str, calls: list[ToolCall], final: bool) -> ToolView:
    """A view whose content holds back its trailing white space until the text ends (it is only
    the space between calls when a call follows), and drops it then if calls were made."""
    if not final or calls:
        content = content.rstrip()
    return ToolView(content, tuple(calls))


def _listed(value: Any) -> list[Any]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


class MistralFormat(ToolFormat):
    name = "mistral"
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def view(self, text: str, tools: Tools, final: bool) -> ToolView:
        start = text.find(self.MARK)
        if start < 0:
            if not final:
                text = text[: len(text) - partial_suffix(text, self.MARK)]
            return ToolView(text)
        if not final:  # (the calls are whole once the completion ends)
            return _settled(text[:start], [], final)
        calls = self._calls_after(text[start:])
        if calls is None:  # not calls after all: it is text
            return ToolView(text)
        return _settled(text[:start], calls, final)

    def _calls_after(self, text: str) -> list[ToolCall] | None:
        """Every call after the marks: a JSON array (or object) of calls after one, or a
        ``name[ARGS]{...}`` after each; None when any of it is not a call."""
        calls: list[ToolCall] = []
        for part in text.split(self.MARK)[1:]:
            part = part.strip()
            if self.ARGS in part:
                name, _, arguments = part.partition(self.ARGS)
                found = [
                    _as_call({"name": name.strip(), "arguments": _decode(arguments)}, None, "")
                ]
            else:
                found = [_as_call(o, None, "arguments") for o in _listed(_decode(part))]
            if not found or any(c is None for c in found):
                return None
            calls += [c for c in found if c is not None]
        return calls

    def grammar(self, tools: Tools) -> str | None:
        one = tools.forced is not None or not tools.parallel
        schema = {
            "x-guidance": _JSON_STYLE,
            "type": "array",
            "items": self._call_schema(tools, "arguments"),
            "minItems": 1,
            **({"maxItems": 1} if one else {}),
        }
        start = self._start(tools, f"{self._literal(self.MARK)} body", self.MARK)
        if start is None:
            return None
        return f"{start}\nbody: %json {json.dumps(schema, ensure_ascii=False)}"


class PythonicFormat(ToolFormat):
    name = "pythonic"
    _FENCES = frozenset({"", "tool_code", "python", "py"})

    def view(self, text: str, tools: Tools, final: bool) -> ToolView:
        if _may_be_whole(text, "[", self._FENCES):
            if not final:
                return ToolView("")
            body = _unfenced(text)
            calls = _python_calls(body, tools.names) if body is not None else []
            if calls:
                return ToolView("", tuple(calls))
        return ToolView(text)

    def grammar(self, tools: Tools) -> str | None:
        if not tools.constrained:
            return None  # (a call is an answer that is only a list: no sign of it before it ends)
        chosen = [t for t in tools.functions if tools.forced in (None, _name(t))]
        rules, options = [], []
        for i, tool in enumerate(chosen):
            parameters = _parameters(tool)
            properties = parameters.get("properties") or {}
            required = [p for p in properties if p in (parameters.get("required") or [])]
            optional = [p for p in properties if p not in required]
            words = []
            for j, prop in enumerate(required + optional):
                value = f"v{i}_{j}"
                rules.append(f"{value}: {_python_value(properties[prop])}")
                words.append((f"{json.dumps(prop + '=')} {value}", prop in required))
            options.append(f"c{i}")
            opened = json.dumps(_name(tool) + "(")
            rules.append(f'c{i}: {opened} {_python_arguments(words)} ")"')
        one = "call"
        calls = (
            f'"[" {one} (", " {one})* "]"'
            if tools.parallel and tools.forced is None
            else f'"[" {one} "]"'
        )
        return "\n".join([f"start: {calls}", f"call: {' | '.join(options)}", *rules])

    def system_text(self, tools: Tools) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.functions)
        return (
            "# Tools\n\nYou can call functions to answer. They are described as JSON Schemas:\n"
            f"{listed}\n\nTo call them, answer with nothing but a Python list of the calls, "
            "arguments by name: [function_name(param=value, ...), ...]"
        )

    def calls_text(self, calls: Sequence[Mapping[str, Any]]) -> str:
        written = []
        for c in calls:
            arguments = c["function"]["arguments"]
            pairs = arguments.items() if isinstance(arguments, Mapping) else ()
            said = ", ".join(f"{k}={v!r}" for k, v in pairs)
            written.append(f"{c['function']['name']}({said})")
        return "[" + ", ".join(written) + "]"

    @staticmethod
    def result_text(content: str) -> str:
        return f"```tool_output\n{content}\n```"


def _python_value(schema: Mapping[str, Any]) -> str:
    """A grammar for one argument's value, written as Python (a JSON string or number is one)."""
    if schema.get("type") == "boolean":
        return '"True" | "False"'
    return "%json " + json.dumps({"x-guidance": _JSON_STYLE, **schema}, ensure_ascii=False)


def _python_arguments(words: list[tuple[str, bool]]) -> str:
    """Keyword arguments in the schema's order, required ones first; an optional one may be
    left out only with those after it (a grammar of every subset would be exponential)."""
    required = [w for w, needed in words if needed]
    optional = [w for w, needed in words if not needed]
    if required:
        return " ".join([' ", " '.join(required), _optional_tail(optional)]).strip()
    if not optional:
        return ""
    return f"({optional[0]} {_optional_tail(optional[1:])})?"


def _optional_tail(optional: list[str]) -> str:
    """`(", " o1 (", " o2)?)?`: each optional argument after the one before it."""
    tail = ""
    for word in reversed(optional):
        tail = f'(", " {word} {tail})?'
    return tail


_PYTHON_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False}
_PYTHON_NAMES |= {"null": None}


def _python_calls(text: str, names: frozenset[str]) -> list[ToolCall]:
    """The calls of an answer that is a Python list of them (or one call, or print() of them,
    as models write them); [] when it is anything else."""
    import ast

    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return []
    if isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name) and tree.func.id == "print":
        tree = tree.args[0] if len(tree.args) == 1 and not tree.keywords else tree
    items = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for item in items:
        if not (isinstance(item, ast.Call) and isinstance(item.func, ast.Name)):
            return []
        if item.func.id not in names or item.args:
            return []
        try:
            arguments = {k.arg: _literal(k.value) for k in item.keywords if k.arg is not None}
        except ValueError:
            return []
        if len(arguments) != len(item.keywords):
            return []
        calls.append(ToolCall(item.func.id, json.dumps(arguments, ensure_ascii=False)))
    return calls


def _literal(node: Any) -> Any:
    """A Python literal's value; JSON's true, false and null are taken too (models mix them)."""
    import ast

    if isinstance(node, ast.Name) and node.id in _PYTHON_NAMES:
        return _PYTHON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("a ** in a dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


FORMATS: dict[str, type[ToolFormat]] = {
    f.name: f for f in (HermesFormat, Llama3JsonFormat, MistralFormat, PythonicFormat)
}


def detect(template: str | None) -> type[ToolFormat]:
    """The format a chat template's model writes calls in."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return MistralFormat
    if "<tool_call>" not in text and "tools" in text:
        if '"parameters"' in text or "python_tag" in text:
            return Llama3JsonFormat
    return HermesFormat  # (for a template without tools, sluice writes them in hermes' form)


def template_renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in (template or "")


def named(name: str) -> type[ToolFormat]:
    try:
        return FORMATS[name]
    except KeyError:
        raise EngineError(
            f"unknown tool-call parser {name!r} (known: {', '.join(sorted(FORMATS))})",
            "tool_call_parser",
        ) from None


def _arguments_object(call: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI call with its arguments decoded (templates write them with `tojson`)."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        decoded = _decode(arguments)
        function["arguments"] = decoded if isinstance(decoded, dict) else arguments
    return {**call, "function": function}


def template_inputs(
    fmt: ToolFormat,
    renders_tools: bool,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for a chat template: as they are for a template that renders tools (with
    each earlier call's arguments decoded, as templates expect them); for one that does not, the
    tools described in the system message and earlier calls and results written as text."""
    if renders_tools:
        out = [
            {**m, "tool_calls": [_arguments_object(c) for c in m["tool_calls"]]}
            if m.get("tool_calls")
            else dict(m)
            for m in messages
        ]
        return out, [dict(t) for t in tools] if tools else None
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        calls = [_arguments_object(c) for c in messages[len(out)].get("tool_calls") or []]
        if calls:
            written = fmt.calls_text(calls)
            m["content"] = f"{m['content']}\n{written}" if m.get("content") else written
        if m["role"] == "tool":
            m = {"role": "user", "content": fmt.result_text(m.get("content") or "")}
        out.append(m)
    if tools:
        described = fmt.system_text(Tools(tuple(tools)))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out, None
