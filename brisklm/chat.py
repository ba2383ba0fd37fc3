"""Chat templates: the model's own Jinja template renders a conversation to a prompt.

Rendered the way transformers' apply_chat_template does (jinja2 sandbox,
trim_blocks/lstrip_blocks, `raise_exception` and `strftime_now` helpers), so a
checkpoint's template behaves as its authors tested it.
"""
from __future__ import annotations

import json
from datetime import datetime

# For checkpoints that carry no template (base models): the ChatML layout.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _raise(message):
    raise ValueError(f"chat template: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson: plain JSON text (jinja2's own is HTML-safe markup,
    which escapes the text a template adds to it: `'...' + x | tojson`)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render(template: str | None, messages: list[dict], add_generation_prompt: bool = True,
           bos_token: str = "", eos_token: str = "", tools: list[dict] | None = None) -> str:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content'")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    try:
        tmpl = env.from_string(template or CHATML)
        extra = {"tools": tools} if tools else {}  # (templates test `tools is defined`)
        return tmpl.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           bos_token=bos_token, eos_token=eos_token, **extra)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template error: {e}") from None


def render_marked(template: str | None, messages: list[dict], add_generation_prompt: bool = True,
                  bos_token: str = "", eos_token: str = "", tools: list[dict] | None = None
                  ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans that hold the
    messages' contents: rendered with a mark in each content's place, then the
    contents put in (Tokenizer.encode_literal keeps those spans text). A
    template that drops or alters a mark gets the plain render and no spans."""
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]  # (private-use characters)
    marked = [{**m, "content": mark} if isinstance(m.get("content"), str) else m for m, mark in zip(messages, marks)]
    text = render(template, marked, add_generation_prompt, bos_token, eos_token, tools)
    pieces, spans, at, start = [], [], 0, 0
    for i, mark in enumerate(marks):
        if not isinstance(messages[i].get("content"), str):
            continue
        found = text.find(mark, start)
        if found < 0 or text.count(mark) != 1:
            return render(template, messages, add_generation_prompt, bos_token, eos_token, tools), []
        pieces.append(text[start:found])
        at += found - start
        content = messages[i]["content"]
        pieces.append(content)
        spans.append((at, at + len(content)))
        at += len(content)
        start = found + len(mark)
    pieces.append(text[start:])
    return "".join(pieces), spans


def drop_oldest_turns(messages: list[dict], fits) -> tuple[list[dict], int]:
    """The conversation less its oldest turns (a user message and the replies
    after it; a leading system message stays) until fits(messages) holds or
    only the last message is left -> (messages, how many were dropped)."""
    head = messages[:1] if messages and messages[0].get("role") == "system" else []
    body = list(messages[len(head):])
    dropped = 0
    while len(body) > 1 and not fits(head + body):
        cut = 1
        while cut < len(body) - 1 and body[cut].get("role") != "user":
            cut += 1
        body, dropped = body[cut:], dropped + cut
    return head + body, dropped


# --- tool calls ------------------------------------------------------------------
# A template that names `tools` renders them itself (transformers passes the
# same variable). Others (SmolLM2's) get the Hermes layout, which Qwen 2.5 and
# SmolLM3 are trained on: the tools' schemas in the system message, each call a
# <tool_call> JSON object {"name", "arguments"}, each result a <tool_response>.

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"

TOOLS_PROMPT = ("You can call functions to help answer. The functions, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
                "To call functions, reply with one JSON object per call, each inside <tool_call></tool_call> tags:\n"
                "<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}}\n</tool_call>")


def renders_tools(template: str | None) -> bool:
    """Whether a chat template renders the `tools` variable itself."""
    return bool(template) and "tools" in template


def tool_call_text(call: dict) -> str:
    """One call {"name", "arguments" (a dict or its JSON text)} in the Hermes layout."""
    arguments = call.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    body = json.dumps({"name": call.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def with_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """A conversation with tools, tool calls and tool results as plain
    messages, for a template that knows none of them: the tools in the system
    message, an assistant's calls in its content, a result as a user turn."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "\n".join(tool_call_text(c.get("function", c)) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": content})
    if tools:
        listed = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{listed}"}
        else:
            out.insert(0, {"role": "system", "content": listed})
    return out


def parse_tool_calls(text: str, names=None) -> tuple[str, list[dict]]:
    """(the text outside the calls, the calls {"name", "arguments" (JSON
    text)}) of a reply in the Hermes layout; a block that is not a call's
    JSON, or names a function not in `names`, stays text. An unclosed last
    block counts if it parses (the end token, or max_tokens, can come before
    the tag, or inside it)."""
    calls, kept, at = [], [], 0
    while (start := text.find(TOOL_CALL_OPEN, at)) >= 0:
        end = text.find(TOOL_CALL_CLOSE, start)
        body = text[start + len(TOOL_CALL_OPEN):end if end >= 0 else len(text)]
        call = _call(body if end >= 0 else _without_tag_start(body), names)
        if call is None:
            kept.append(text[at:end + len(TOOL_CALL_CLOSE) if end >= 0 else len(text)])
        else:
            kept.append(text[at:start])
            calls.append(call)
        at = end + len(TOOL_CALL_CLOSE) if end >= 0 else len(text)
    kept.append(text[at:])
    return "".join(kept).strip(), calls


def _call(body: str, names) -> dict | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if names is not None and value["name"] not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}


class ToolCallSplitter:
    """A streamed reply split into content and tool calls: push pieces of
    text, get ("content", text) and ("call", {"name", "arguments"}) events.
    Text that could be the start of a <tool_call> tag is held back until it
    is decided; a call is given once its closing tag (or the end) arrives."""

    def __init__(self, names=None):
        self.names, self.pending, self.inside = names, "", False

    def push(self, piece: str) -> list[tuple[str, object]]:
        self.pending += piece
        events = []
        while True:
            if not self.inside:
                start = self.pending.find(TOOL_CALL_OPEN)
                if start < 0:
                    hold = _partial_suffix(self.pending, TOOL_CALL_OPEN)
                    if len(self.pending) > hold:
                        events.append(("content", self.pending[:len(self.pending) - hold]))
                        self.pending = self.pending[len(self.pending) - hold:]
                    return events
                if start:
                    events.append(("content", self.pending[:start]))
                self.pending, self.inside = self.pending[start:], True
            end = self.pending.find(TOOL_CALL_CLOSE)
            if end < 0:
                return events
            block = self.pending[:end + len(TOOL_CALL_CLOSE)]
            self.pending, self.inside = self.pending[len(block):], False
            events += self._block(block)

    def finish(self) -> list[tuple[str, object]]:
        block, self.pending = self.pending, ""
        if not block:
            return []
        return self._block(block) if self.inside else [("content", block)]

    def _block(self, block: str) -> list[tuple[str, object]]:
        body = block[len(TOOL_CALL_OPEN):]
        body = body[:-len(TOOL_CALL_CLOSE)] if body.endswith(TOOL_CALL_CLOSE) else _without_tag_start(body)
        call = _call(body, self.names)
        return [("call", call)] if call is not None else [("content", block)]


def _without_tag_start(body: str) -> str:
    """An unclosed block's body less a closing tag's start at its end (a reply cut inside the tag)."""
    return body[:len(body) - _partial_suffix(body, TOOL_CALL_CLOSE)]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


def lark_text(text: str, tokenizer=None) -> str:
    """A grammar's term for text: the special token it is, by id, where the
    tokenizer has one (llguidance's matcher takes a special token only so),
    else the literal text."""
    if tokenizer is not None and tokenizer.backend.special_pattern().fullmatch(text):
        ids = tokenizer.encode(text, add_bos=False)
        if len(ids) == 1:
            return f"<[{ids[0]}]>"
    return json.dumps(text)


def call_schema(tools: list[dict], name: str | None = None, key: str = "arguments") -> dict:
    """The JSON schema of one call, {"name", key}: to the function `name`, or
    to any of `tools`, with that function's parameters under key."""
    options, defs = [], {}
    for f in (t["function"] for t in tools if name is None or t["function"]["name"] == name):
        parameters = dict(f.get("parameters") or {"type": "object"})
        for k in ("$defs", "definitions"):  # ("#/$defs/..." refers to the root: moved there)
            defs.setdefault(k, {}).update(parameters.pop(k, {}))
        options.append({"type": "object", "properties": {"name": {"const": f["name"]}, key: parameters},
                        "required": ["name", key], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, **{k: v for k, v in defs.items() if v}, "x-guidance": {"whitespace_flexible": False}}


def tool_call_grammar(tools: list[dict], name: str | None = None, parallel: bool = True, tokenizer=None) -> str:
    """A Lark grammar (llguidance's, with embedded JSON schemas) of a reply
    that is only calls in the Hermes layout (call_schema's, one call, or one
    or more where parallel)."""
    calls = 'call ("\\n" call)*' if parallel else "call"
    opened, closed = lark_text(TOOL_CALL_OPEN, tokenizer), lark_text(TOOL_CALL_CLOSE, tokenizer)
    return (f"start: {calls}\n"
            f'call: {opened} "\\n" body "\\n" {closed}\n'
            f"body: %json {json.dumps(call_schema(tools, name))}\n")


# --- other families' tool-call syntaxes, chosen by the chat template -------------------
# Llama 3.1 replies with the call's JSON itself, {"name", "parameters"} (after
# <|python_tag|> when it calls a built-in tool), several separated by "; ";
# Mistral with [TOOL_CALLS] and a JSON list of {"name", "arguments"}. Both run
# from their start to the reply's end.

PYTHON_TAG, MISTRAL_TAG = "<|python_tag|>", "[TOOL_CALLS]"


def _json_values(text: str, separator: str) -> list | None:
    """The JSON values text holds one after another (separator and spaces
    between them), or None where it holds anything else."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return values or None
        if values and text.startswith(separator, at):
            at += len(separator)
            continue
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


def _calls_of(values, names) -> list[dict] | None:
    calls = [_call(json.dumps(v), names) for v in values]
    return calls if calls and None not in calls else None


class HermesSyntax:
    """<tool_call> blocks of {"name", "arguments"} (Qwen 2.5 and 3, SmolLM3, Hermes; our default)."""
    name = "hermes"

    def parse(self, text: str, names=None) -> tuple[str, list[dict]]:
        return parse_tool_calls(text, names)

    def splitter(self, names=None) -> "ToolCallSplitter":
        return ToolCallSplitter(names)

    def grammar(self, tools: list[dict], name: str | None = None, parallel: bool = True, tokenizer=None) -> str:
        return tool_call_grammar(tools, name, parallel, tokenizer)


class TrailingCallSyntax:
    """A syntax whose calls run from a trigger to the end of the reply."""
    name, trigger, separator, key = "", "", "", "arguments"
    anywhere = True  # whether text may come before the trigger

    def start(self, text: str) -> int:
        """Where the calls begin in text (-1: not, or not yet)."""
        return text.find(self.trigger)

    def held(self, text: str) -> int:
        """How many characters at text's end could still begin the calls."""
        return _partial_suffix(text, self.trigger)

    def body(self, text: str) -> list | None:
        """The calls' JSON values in the text from the trigger on."""
        return _json_values(text[len(self.trigger):], self.separator)

    def parse(self, text: str, names=None) -> tuple[str, list[dict]]:
        at = self.start(text)
        values = self.body(text[at:]) if at >= 0 else None
        calls = values is not None and _calls_of(values, names)
        return (text[:at].strip(), calls) if calls else (text, [])

    def splitter(self, names=None) -> "TrailingCallSplitter":
        return TrailingCallSplitter(self, names)

class Llama3Syntax(TrailingCallSyntax):
    """Llama 3.1-3.3: the reply is the calls' JSON, {"name", "parameters"}, "; " between calls."""
    name, trigger, separator, key = "llama3_json", PYTHON_TAG, ";", "parameters"
    anywhere = False

    def start(self, text: str) -> int:
        head = text.lstrip()
        return len(text) - len(head) if head.startswith((PYTHON_TAG, "{")) else -1

    def held(self, text: str) -> int:
        head = text.lstrip()
        return len(text) if PYTHON_TAG.startswith(head) else 0

    def body(self, text: str) -> list | None:
        return _json_values(text[len(PYTHON_TAG):] if text.startswith(PYTHON_TAG) else text, self.separator)

    def grammar(self, tools: list[dict], name: str | None = None, parallel: bool = True, tokenizer=None) -> str:
        calls = 'call ("; " call)*' if parallel else "call"
        return f"start: {calls}\ncall: %json {json.dumps(call_schema(tools, name, self.key))}\n"


class MistralSyntax(TrailingCallSyntax):
    """Mistral (v0.3 and its kin): [TOOL_CALLS] then a JSON list of {"name", "arguments"}."""
    name, trigger, separator, key = "mistral", MISTRAL_TAG, ",", "arguments"

    def body(self, text: str) -> list | None:
        values = _json_values(text[len(self.trigger):], self.separator)
        if values and all(isinstance(v, list) for v in values):  # (a list of calls; a bare call as well)
            values = [c for v in values for c in v]
        return values

    def grammar(self, tools: list[dict], name: str | None = None, parallel: bool = True, tokenizer=None) -> str:
        items = {"type": "array", "items": call_schema(tools, name, self.key), "minItems": 1,
                 "x-guidance": {"whitespace_flexible": False}}
        if not parallel:
            items["maxItems"] = 1
        return f"start: {lark_text(MISTRAL_TAG, tokenizer)} body\nbody: %json {json.dumps(items)}\n"


class TrailingCallSplitter:
    """ToolCallSplitter's events for a TrailingCallSyntax: text flows as
    content until the calls begin (text that could begin them held back),
    then the rest is kept and parsed at the end (text that does not parse
    as calls is given as content then)."""

    def __init__(self, syntax: TrailingCallSyntax, names=None):
        self.syntax, self.names, self.pending, self.inside, self.said = syntax, names, "", False, False

    def push(self, piece: str) -> list[tuple[str, object]]:
        self.pending += piece
        if self.inside:
            return []
        at = self.syntax.start(self.pending) if self.syntax.anywhere or not self.said else -1
        if at >= 0:
            head, self.pending, self.inside = self.pending[:at], self.pending[at:], True
            return [("content", head)] if head else []
        hold = self.syntax.held(self.pending) if self.syntax.anywhere or not self.said else 0
        if len(self.pending) == hold:
            return []
        out, self.pending = self.pending[:len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        self.said = True
        return [("content", out)]

    def finish(self) -> list[tuple[str, object]]:
        text, self.pending = self.pending, ""
        if not text:
            return []
        if not self.inside:
            return [("content", text)]
        content, calls = self.syntax.parse(text, self.names)
        return ([("content", content)] if content else []) + [("call", c) for c in calls]


HERMES = HermesSyntax()


def tool_syntax(template: str | None):
    """The tool-call syntax a chat template teaches its model (Hermes where it
    names none, or renders no tools: with_tools lays them out as Hermes)."""
    if not renders_tools(template):
        return HERMES
    if MISTRAL_TAG in template:
        return MistralSyntax()
    if PYTHON_TAG in template or ('"parameters"' in template and "<|eot_id|>" in template):
        return Llama3Syntax()
    return HERMES


# --- reasoning: <think> ... </think> ----------------------------------------------------

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def uses_reasoning(template: str | None) -> bool:
    """Whether a chat template's family thinks in <think> blocks (Qwen3, SmolLM3, DeepSeek-R1)."""
    return bool(template) and THINK_OPEN in template


def opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside a <think> block (DeepSeek-R1's opens it for the model)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(the reasoning, the content) of a reply: its leading <think> block
    (from the start where the prompt opened it), None where it has none. An
    unclosed block is all reasoning; the content starts at its first non-space."""
    head = text.lstrip()
    if not opened and not head.startswith(THINK_OPEN):
        return None, text
    body = head[len(THINK_OPEN):] if head.startswith(THINK_OPEN) else text
    end = body.find(THINK_CLOSE)
    if end < 0:
        return body, ""
    return body[:end], body[end + len(THINK_CLOSE):].lstrip()


class ReasoningSplitter:
    """split_reasoning for a stream: push pieces, get ("reasoning", text) and
    ("content", text) events, which join to split_reasoning's two texts."""

    def __init__(self, opened: bool = False):
        self.state = "inside" if opened else "start"  # start -> inside -> after (the spaces) -> content
        self.pending = ""

    def push(self, piece: str) -> list[tuple[str, str]]:
        self.pending += piece
        out = []
        if self.state == "start":
            head = self.pending.lstrip()
            if THINK_OPEN.startswith(head) and head != THINK_OPEN:  # (could still open a block)
                return out
            if head.startswith(THINK_OPEN):
                self.state, self.pending = "inside", head[len(THINK_OPEN):]
            else:
                self.state = "content"
        if self.state == "inside":
            end = self.pending.find(THINK_CLOSE)
            if end < 0:
                hold = _partial_suffix(self.pending, THINK_CLOSE)
                said, self.pending = self.pending[:len(self.pending) - hold], self.pending[len(self.pending) - hold:]
                return [("reasoning", said)] if said else []
            if end:
                out.append(("reasoning", self.pending[:end]))
            self.state, self.pending = "after", self.pending[end + len(THINK_CLOSE):]
        if self.state == "after":
            self.pending = self.pending.lstrip()
            if self.pending:
                self.state = "content"
        if self.state == "content" and self.pending:
            out.append(("content", self.pending))
            self.pending = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        text, self.pending = self.pending, ""
        if not text or self.state == "after":
            return []
        return [("reasoning" if self.state == "inside" else "content", text)]
