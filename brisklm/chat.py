"""Chat templates: the model's own Jinja template renders a conversation to a prompt.

Rendered the way transformers' apply_chat_template does (jinja2 sandbox,
trim_blocks/lstrip_blocks, `raise_exception` and `strftime_now` helpers), so a
checkpoint's template behaves as its authors tested it.
"""
from __future__ import annotations

from datetime import datetime

# For checkpoints that carry no template (base models): the ChatML layout.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _raise(message):
    raise ValueError(f"chat template: {message}")


def render(template: str | None, messages: list[dict], add_generation_prompt: bool = True,
           bos_token: str = "", eos_token: str = "") -> str:
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
        return tmpl.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           bos_token=bos_token, eos_token=eos_token)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template error: {e}") from None


def render_marked(template: str | None, messages: list[dict], add_generation_prompt: bool = True,
                  bos_token: str = "", eos_token: str = "") -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans that hold the
    messages' contents: rendered with a mark in each content's place, then the
    contents put in (Tokenizer.encode_literal keeps those spans text). A
    template that drops or alters a mark gets the plain render and no spans."""
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]  # (private-use characters)
    marked = [{**m, "content": mark} if isinstance(m.get("content"), str) else m for m, mark in zip(messages, marks)]
    text = render(template, marked, add_generation_prompt, bos_token, eos_token)
    pieces, spans, at, start = [], [], 0, 0
    for i, mark in enumerate(marks):
        if not isinstance(messages[i].get("content"), str):
            continue
        found = text.find(mark, start)
        if found < 0 or text.count(mark) != 1:
            return render(template, messages, add_generation_prompt, bos_token, eos_token), []
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
