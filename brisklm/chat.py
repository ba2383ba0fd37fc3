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
    block counts if it parses (the end token can come before the tag)."""
    calls, kept, at = [], [], 0
    while (start := text.find(TOOL_CALL_OPEN, at)) >= 0:
        end = text.find(TOOL_CALL_CLOSE, start)
        body = text[start + len(TOOL_CALL_OPEN):end if end >= 0 else len(text)]
        call = _call(body, names)
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
        body = body[:-len(TOOL_CALL_CLOSE)] if body.endswith(TOOL_CALL_CLOSE) else body
        call = _call(body, self.names)
        return [("call", call)] if call is not None else [("content", block)]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


def tool_call_grammar(tools: list[dict], name: str | None = None, parallel: bool = True) -> str:
    """A Lark grammar (llguidance's, with embedded JSON schemas) of a reply
    that is only calls in the Hermes layout: to the function `name`, or to
    any of `tools`, each call's arguments valid against that function's
    parameters; one call, or one or more where parallel."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    options, defs = [], {}
    for f in functions:
        parameters = dict(f.get("parameters") or {"type": "object"})
        for key in ("$defs", "definitions"):  # ("#/$defs/..." refers to the root: moved there)
            defs.setdefault(key, {}).update(parameters.pop(key, {}))
        options.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": parameters},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, **{k: v for k, v in defs.items() if v}, "x-guidance": {"whitespace_flexible": False}}
    calls = 'call ("\\n" call)*' if parallel else "call"
    return (f"start: {calls}\n"
            f'call: "{TOOL_CALL_OPEN}\\n" body "\\n{TOOL_CALL_CLOSE}"\n'
            f"body: %json {json.dumps(schema)}\n")
