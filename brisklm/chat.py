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
