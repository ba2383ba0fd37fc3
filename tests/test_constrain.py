"""Structured output (constrain.py): masked sampling on the device;
speculation under a grammar (drafts cut and verified under each position's
mask: greedy output token for token the constrained output, sampled output
distributed as masked sampling's) on a tiny vocabulary with random models and
on SmolLM2; the tool-call syntaxes of Hermes, Llama 3.1 and Mistral chosen by
their chat templates (parsed whole and streamed, forced calls' grammars) and
<think> reasoning split off; and on the real SmolLM2 (fp32, CPU) outputs that
match their JSON schema, regex or grammar from the Python API and the CLI,
greedy output equal to a reference masked step by step in plain Python, and
one-line errors for bad constraints."""
import json
import os
import subprocess
import sys

import pytest
import torch

from brisklm import chat
from brisklm.errors import BriskError
from brisklm.generate import Generator
from brisklm.model import ModelArgs, build_model, random_state_dict
from brisklm.sampling import SamplingParams, allowed_tokens, logits_to_probs, masked, sample_allowed
from brisklm.speculative import ModelDrafter, NgramDrafter

jsonschema = pytest.importorskip("jsonschema")


def bitmask(allowed: set[int], vocab: int) -> torch.Tensor:
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def test_the_bitmask_layout_is_llguidance_s():
    allowed = {0, 5, 31, 32, 63, 99}
    assert allowed_tokens(bitmask(allowed, 100), 100).nonzero().view(-1).tolist() == sorted(allowed)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=3),
                                    SamplingParams(temperature=1.5, top_p=0.5),
                                    SamplingParams(temperature=1.0, min_p=0.3)])
def test_masked_sampling_picks_only_allowed_tokens_under_every_filter(params):
    torch.manual_seed(0)
    vocab, allowed = 300, {3, 77, 150, 299}
    bits = bitmask(allowed, vocab)
    for _ in range(50):
        logits = torch.randn(1, vocab) * 5
        assert int(sample_allowed(logits, params.on("cpu"), bits)) in allowed


def test_greedy_masked_sampling_is_the_best_allowed_token():
    logits = torch.randn(1, 64)
    allowed = {1, 9, 40}
    best = max(allowed, key=lambda t: logits[0, t])
    assert int(sample_allowed(logits, None, bitmask(allowed, 64))) == best


# --- speculation under a grammar, on a tiny vocabulary and random models -----------

TOKENS = ["a", "b", "c", "ab", "bc", "ca", ",", "[", "]", '"', "1", "2", "{", "}", ":", "<eos>"]
EOS = len(TOKENS) - 1
TINY = ModelArgs(vocab_size=len(TOKENS), hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                 num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
GREEDY = SamplingParams()
TINY_CONSTRAINTS = [
    dict(regex=r"(ab|c|a){4,12}"),
    dict(json_schema={"type": "array", "items": {"enum": ["ab", "bc", "c"]}, "minItems": 3, "maxItems": 9}),
    dict(json_schema={"type": "object", "properties": {
        "a": {"type": "array", "items": {"enum": ["ab", "ca"]}, "maxItems": 6},
        "b": {"type": "integer", "minimum": 0, "maximum": 2222}}, "required": ["a", "b"],
        "additionalProperties": False}),
]


@pytest.fixture(scope="module")
def tiny_tokenizer():
    """A byte-level BPE of TOKENS (llguidance reads it as it reads a real one)."""
    from brisklm.tokenizer import Tokenizer, from_gguf_vocab
    types = [1] * EOS + [3]  # (the last: a control token)
    return Tokenizer(from_gguf_vocab("gpt2", None, TOKENS, types, ["a b", "b c", "c a"], None), eos_ids=[EOS])


def tiny_model(seed=0, args=TINY):
    return build_model(args, random_state_dict(args, torch.float32, seed=seed, std=0.3))


def tiny_drafter(kind, target):
    if kind == "ngram":
        return NgramDrafter()
    if kind == "self":
        return ModelDrafter(target, depth=1)
    draft = tiny_model(seed=7)
    draft.setup_caches(1, 256)
    return ModelDrafter(draft)


def grammar(tokenizer, **given):
    from brisklm.constrain import compile_grammar
    return compile_grammar(tokenizer, TINY.vocab_size, **given)


def test_a_server_s_warm_up_compiles_the_json_object_grammar_before_its_first_request(tiny_tokenizer):
    """LLM.warm_up with neither prompts nor constrained (brisk serve's, load()'s)
    starts llguidance's tokenizer and the json_object grammar on a worker
    thread: the first such request finds them compiled."""
    import time

    from brisklm.api import LLM
    from brisklm.constrain import _compiler
    llm = LLM(tiny_model(), tiny_tokenizer, max_seq_length=64)
    llm.warm_up()
    key = ("json_schema", json.dumps({"type": "object"}))
    deadline = time.monotonic() + 30
    while key not in _compiler(tiny_tokenizer, TINY.vocab_size)[1] and time.monotonic() < deadline:
        time.sleep(0.01)
    ahead = _compiler(tiny_tokenizer, TINY.vocab_size)[1].get(key)
    assert ahead is not None
    assert grammar(tiny_tokenizer, json_schema={"type": "object"}) is ahead


def test_drafts_are_cut_at_the_first_the_grammar_refuses_and_each_row_has_its_position_s_mask(tiny_tokenizer):
    g = grammar(tiny_tokenizer, regex=r"(ab|c)+,")
    ab, c, comma, bc = (TOKENS.index(t) for t in ("ab", "c", ",", "bc"))
    plain, spec = g.constraint(), g.constraint()
    drafts = [ab, c, bc, ab]  # ("bc" may not follow "abc")
    assert spec.allowed_drafts(drafts) == 2
    kept, rows, consumed = spec.draft_masks(drafts)
    assert kept == [ab, c] and consumed == 2 and rows.shape[0] == 3
    for i, token in enumerate([ab, c, None]):  # row i: the mask after the drafts before it
        assert rows[i].tolist() == plain.mask().tolist()
        if token is not None:
            plain.advance(token)
    assert spec.settle(2, [ab, comma]) == [ab, comma]  # the verify kept "ab", then chose ","
    assert spec.done  # (the regex is complete: nothing may follow)
    assert g.constraint().draft_masks([ab, bc], keep_refused=True)[::2] == ([ab, bc], 1)  # (kept, to be rejected)
    spec = g.constraint()
    kept, rows, consumed = spec.draft_masks([c, comma, ab])
    assert kept == [c, comma] and consumed == 2 and rows[2].eq(-1).all()  # (past the end: any token)
    assert spec.settle(2, [c, comma, ab]) == [c, comma]  # nothing past the grammar's end


@pytest.mark.parametrize("kind,k", [("ngram", 4), ("self", 1), ("model", 3)])
def test_greedy_speculative_constrained_output_is_the_constrained_output(tiny_tokenizer, kind, k):
    plain, spec = Generator(tiny_model(), 256), Generator(tiny_model(), 256)
    drafter = tiny_drafter(kind, spec.model)
    prompt = tiny_tokenizer.encode('{"a":["ab","ca","ab","ca"],"b":12}["ab","bc","c","ab","bc","c"]abcabcab')
    drafted = steps = tokens = 0
    for given in TINY_CONSTRAINTS:
        g = grammar(tiny_tokenizer, **given)
        want = list(plain.tokens(prompt, 40, GREEDY, stop_ids=[EOS], constraint=g.constraint()))
        got = list(spec.tokens(prompt, 40, GREEDY, stop_ids=[EOS], drafter=drafter, draft_tokens=k,
                               adapt_drafts=False, constraint=g.constraint()))
        assert got == want, (given, tiny_tokenizer.decode(got), tiny_tokenizer.decode(want))
        drafted, steps, tokens = drafted + spec.stats.drafted_steps, steps + spec.stats.target_steps, tokens + len(got)
    assert drafted > 0
    if kind == "ngram":  # drafts the grammar allowed and the target kept: fewer forwards than tokens
        assert steps < tokens - len(TINY_CONSTRAINTS), (steps, tokens)


def test_speculation_ends_where_the_grammar_does(tiny_tokenizer):
    """Drafts past the end of the grammar (the prompt goes on after ",") are not emitted."""
    g = grammar(tiny_tokenizer, regex=r"(ab|c){1,3},")
    prompt = tiny_tokenizer.encode("ab,abc,cab,cc,ab,abcab")
    want = list(Generator(tiny_model(), 256).tokens(prompt, 30, GREEDY, constraint=g.constraint()))
    got = list(Generator(tiny_model(), 256).tokens(prompt, 30, GREEDY, drafter=NgramDrafter(), draft_tokens=6,
                                                   adapt_drafts=False, constraint=g.constraint()))
    assert got == want and tiny_tokenizer.decode(got).endswith(",")


def masked_distribution(model, tokenizer, g, prompt: list[int], params) -> dict[tuple, float]:
    """The exact probability of each complete output of masked sampling:
    every prefix the grammar allows expanded, each step's logits from a fresh
    forward over the whole sequence."""
    out = {}

    def expand(ids, constraint, p):
        bits = constraint.mask()
        if bits is None:
            out[tuple(ids)] = out.get(tuple(ids), 0.0) + p
            return
        logits = model(torch.tensor([prompt + ids]), torch.arange(len(prompt) + len(ids)))[0, -1]
        probs = logits_to_probs(masked(logits, bits.clone()), params)
        for t in probs.nonzero().view(-1).tolist():
            nxt = constraint.matcher.deep_copy()
            from brisklm.constrain import Constraint
            after = Constraint(nxt, TINY.vocab_size, [EOS])
            after.advance(t)
            expand(ids + [t], after, p * float(probs[t]))

    with torch.no_grad():
        model.setup_caches(1, 64)
        expand([], g.constraint(), 1.0)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ngram", "model"])
def test_sampled_speculative_constrained_outputs_follow_the_masked_distribution(tiny_tokenizer, kind):
    """Outputs of (a|b|c){3} (a token or two or three), drawn 1000 times with
    speculation, against their exact distribution under masked sampling:
    chi-square at p = 0.001 over the outputs expected 5 or more times. A draft
    model's proposals often fall on the 10 tokens the grammar forbids: such a
    draft is rejected by the residual rule (p - q), not cut (which would draw
    from p); drafts cut instead gave a statistic near 490 against a bound
    near 56 here."""
    from test_speculative import wilson_hilferty
    params = SamplingParams(temperature=1.0)
    target = tiny_model(seed=3)
    prompt = tiny_tokenizer.encode("abcabc")
    g = grammar(tiny_tokenizer, regex="(a|b|c){3}")
    exact = masked_distribution(target, tiny_tokenizer, g, prompt, params)
    gen, drafter = Generator(target, 64), tiny_drafter(kind, target)
    n, counts = 1000, {}
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (steps this small run fastest on one thread)
    try:
        for _ in range(n):
            gen.reset()
            out = tuple(gen.tokens(prompt, 3, params, drafter=drafter, draft_tokens=2, adapt_drafts=False,
                                   constraint=g.constraint()))
            counts[out] = counts.get(out, 0) + 1
    finally:
        torch.set_num_threads(threads)
    assert set(counts) <= set(exact)
    cells = [o for o, p in exact.items() if p * n >= 5]
    chi2 = sum((counts.get(o, 0) - exact[o] * n) ** 2 / (exact[o] * n) for o in cells)
    assert chi2 < wilson_hilferty(len(cells) - 1), (chi2, len(cells))


# --- the tool-call layout ---------------------------------------------------------

def test_tool_calls_are_parsed_out_of_a_reply():
    text = 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "g", "arguments": {}}'
    content, calls = chat.parse_tool_calls(text, {"f", "g"})
    assert content == "Let me look."
    assert calls == [{"name": "f", "arguments": '{"x": 1}'}, {"name": "g", "arguments": "{}"}]


def test_a_call_cut_inside_its_closing_tag_is_a_call_streamed_or_not():
    """A reply that max_tokens ends inside the closing tag: its call's JSON is whole."""
    text = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_'
    assert chat.parse_tool_calls(text, {"f"}) == ("", [{"name": "f", "arguments": '{"x": 1}'}])
    splitter = chat.ToolCallSplitter({"f"})
    events = splitter.push(text) + splitter.finish()
    assert events == [("call", {"name": "f", "arguments": '{"x": 1}'})]
    cut = '<tool_call>\n{"name": "f", "arguments": {"x": '  # (not whole: stays text)
    assert chat.parse_tool_calls(cut, {"f"}) == (cut.strip(), [])


def test_a_block_that_is_not_a_known_call_stays_text():
    text = 'a <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> b <tool_call>oops</tool_call>'
    assert chat.parse_tool_calls(text, {"f"}) == (text, [])


def test_streamed_pieces_split_into_the_same_content_and_calls():
    text = 'Hi <tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}\n</tool_call> bye'
    for size in (1, 2, 5, 100):
        splitter, events = chat.ToolCallSplitter({"f"}), []
        for i in range(0, len(text), size):
            events += splitter.push(text[i:i + size])
        events += splitter.finish()
        content = "".join(v for k, v in events if k == "content")
        assert content == "Hi  bye"
        assert [v for k, v in events if k == "call"] == [{"name": "f", "arguments": '{"x": [1, 2]}'}]


def test_tools_go_into_the_system_message_and_results_into_user_turns():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "content": "42", "tool_call_id": "1"}]
    out = chat.with_tools(messages, tools)
    assert out[0]["role"] == "system" and '"name": "f"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}


def test_strict_schemas_close_their_objects():
    from brisklm.constrain import closed
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "array", "items": {"type": "object", "properties": {}}}},
              "$defs": {"d": {"type": "object", "properties": {"e": {}}, "additionalProperties": True}}}
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["items"]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is True  # (what a schema says stays)


# --- other families' tool-call syntaxes and reasoning, by their chat templates ---------
# (condensed from the families' own templates: the parts that render tools, calls,
# results and thinking as the real ones do)

LLAMA31 = (
    "{{- bos_token }}{%- if not tools is defined %}{%- set tools = none %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}{%- if tools is not none %}"
    "{{- 'Environment: ipython\n' }}{%- endif %}{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- if tools is not none %}{%- set first_user_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}"
    "{{- 'Given the following functions, please respond with a JSON for a function call with its proper '"
    " 'arguments that best answers the given prompt.\n\n' }}"
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}. Do not use variables.\n\n' }}{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\n\n' }}"
    "{%- endfor %}{{- first_user_message + '<|eot_id|>'}}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}{%- set tool_call = message.tool_calls[0].function %}"
    "{%- if builtin_tools is defined and tool_call.name in builtin_tools %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{{- '<|python_tag|>' + tool_call.name + '.call(' }}"
    "{{- ')' }}{%- else %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}"
    "{{- '}' }}{%- endif %}{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}{{- message.content }}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")
MISTRAL = (
    "{%- if not tools is defined %}{%- set tools = none %}{%- endif %}"
    "{%- set user_messages = messages | selectattr('role', 'equalto', 'user') | list %}{{- bos_token }}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{%- if tools is not none and (message == user_messages[-1]) %}{{- '[AVAILABLE_TOOLS] [' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}"
    "{{- '][/AVAILABLE_TOOLS]' }}{%- endif %}{{- '[INST] ' + message['content'] + '[/INST]' }}"
    "{%- elif message.tool_calls is defined and message.tool_calls is not none %}{{- '[TOOL_CALLS] [' }}"
    "{%- for tool_call in message.tool_calls %}{{- {'name': tool_call.function.name, "
    "'arguments': tool_call.function.arguments, 'id': tool_call.id} | tojson }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- ']' + eos_token }}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- elif message['role'] == 'tool' %}{{- '[TOOL_RESULTS] {\"content\": ' + message.content|string + ', ' }}"
    "{{- '\"call_id\": \"' + message.tool_call_id + '\"}[/TOOL_RESULTS]' }}{%- endif %}{%- endfor %}")
QWEN3 = (
    "{%- if tools %}{{- '<|im_start|>system\n' }}{%- if messages[0].role == 'system' %}"
    "{{- messages[0].content + '\n\n' }}{%- endif %}{{- '# Tools\n\n<tools>' }}{%- for tool in tools %}"
    "{{- '\n' }}{{- tool | tojson }}{%- endfor %}{{- '\n</tools>\n\nFor each function call, return a json object '"
    " 'with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set content = message.content or '' %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\n' + content }}{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}{{- '\n<tool_call>\n{\"name\": \"' + tool_call.function.name + "
    "'\", \"arguments\": ' + tool_call.function.arguments | tojson + '}\n</tool_call>' }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\n' }}{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}")
DEEPSEEK_R1 = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
               "{{ '<|User|>' + message['content'] }}{% elif message['role'] == 'assistant' %}"
               "{% set content = message['content'].split('</think>')[-1] %}{{ '<|Assistant|>' + content + "
               "'<|end_of_sentence|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|Assistant|><think>\n' }}{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
ASKED = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "abcdefghi", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "tool_call_id": "abcdefghi", "content": '{"temperature": 21}'}]


@pytest.mark.parametrize("family,syntax,turn", [
    ("llama31", "llama3_json", ("assistant<|end_header_id|>\n\n", "<|eot_id|>")),
    ("mistral", "mistral", ("[/INST]", "</s>")), ("qwen3", "hermes", ("<|im_start|>assistant\n", "<|im_end|>"))])
def test_a_template_s_tool_call_syntax_parses_the_calls_it_renders(family, syntax, turn):
    """The syntax chosen for a template reads back the call that the template
    renders in an assistant's turn (what the family's model learnt to write),
    and the template shows the tools and the result."""
    template = TEMPLATES[family]
    found = chat.tool_syntax(template)
    assert found.name == syntax
    text = chat.render(template, ASKED, tools=[WEATHER], eos_token="</s>", add_generation_prompt=False)
    assert "get_weather" in text[:text.index("Paris?")] and '{"temperature": 21}' in text
    start = text.index(turn[0], text.index("Paris?")) + len(turn[0])
    content, calls = found.parse(text[start:text.index(turn[1], start)], {"get_weather"})
    assert (content, calls) == ("", [{"name": "get_weather", "arguments": '{"city": "Paris"}'}])
    assert chat.tool_syntax(None).name == chat.tool_syntax(DEEPSEEK_R1).name == "hermes"


REPLIES = {  # syntax: (reply, content, calls)
    "llama3_json": [('{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
                     [("get_weather", {"city": "Paris"})]),
                    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                     '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}', "",
                     [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome", "unit": "c"})]),
                    ('It is {"name": "get_weather"} they say', 'It is {"name": "get_weather"} they say', []),
                    ('{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', []),
                    ('{"a": 1}', '{"a": 1}', [])],
    "mistral": [('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "",
                 [("get_weather", {"city": "Paris"})]),
                ('Let me see. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                 '{"name": "get_weather", "arguments": {"city": "Rome"}}]', "Let me see.",
                 [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]),
                ("No [TOOL_CALLS] here", "No [TOOL_CALLS] here", [])],
    "hermes": [('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
                [("get_weather", {"city": "Paris"})])],
}
SYNTAXES = {"llama3_json": LLAMA31, "mistral": MISTRAL, "hermes": QWEN3}
TEMPLATES = {"llama31": LLAMA31, "mistral": MISTRAL, "qwen3": QWEN3}


@pytest.mark.parametrize("syntax,case", [(s, i) for s, cases in REPLIES.items() for i in range(len(cases))])
def test_a_reply_s_calls_are_parsed_whole_and_streamed(syntax, case):
    reply, content, calls = REPLIES[syntax][case]
    found = chat.tool_syntax(SYNTAXES[syntax])
    got_content, got = found.parse(reply, {"get_weather"})
    assert got_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls
    for size in (1, 3, 7, 1000):
        splitter, events = found.splitter({"get_weather"}), []
        for i in range(0, len(reply), size):
            events += splitter.push(reply[i:i + size])
        events += splitter.finish()
        assert "".join(v for k, v in events if k == "content").strip() == content
        assert [v for k, v in events if k == "call"] == got


@pytest.mark.parametrize("syntax", ["llama3_json", "mistral", "hermes"])
def test_a_forced_call_s_grammar_takes_the_family_s_syntax_and_the_schema(tiny_tokenizer, syntax):
    """The grammar of a forced call, in each family's syntax: the canonical
    call's text is allowed whole, one with an argument off its schema is not."""
    from brisklm.tokenizer import Tokenizer, from_gguf_vocab
    found = chat.tool_syntax(SYNTAXES[syntax])
    tools = [{"function": {"name": "ab", "parameters": {"type": "object", "properties": {"c": {"enum": ["ab", "bc"]}},
                                                      "required": ["c"], "additionalProperties": False}}}]
    key = {"llama3_json": "parameters"}.get(syntax, "arguments")
    call = f'{{"name":"ab","{key}":{{"c":"bc"}}}}'
    good = {"llama3_json": call, "mistral": f"[TOOL_CALLS][{call}]",
            "hermes": f"<tool_call>\n{call}\n</tool_call>"}[syntax]
    letters = sorted(set(good + "ac") - {"\n"}) + ["\n", "[TOOL_CALLS]", "<tool_call>", "</tool_call>", "<eos>"]
    letters = list(dict.fromkeys(letters))
    tok = Tokenizer(from_gguf_vocab("gpt2", None, [t.replace("\n", "Ċ") for t in letters],
                                    [1] * (len(letters) - 4) + [3] * 4, [], None), eos_ids=[len(letters) - 1])
    from brisklm.constrain import compile_grammar
    g = compile_grammar(tok, len(letters), grammar=found.grammar(tools, "ab", parallel=False, tokenizer=tok))
    ids = tok.encode(good)
    assert g.constraint().matcher.validate_tokens(ids) == len(ids)
    bad = tok.encode(good.replace('"bc"', '"ac"'))
    assert g.constraint().matcher.validate_tokens(bad) < len(bad)
    content, calls = found.parse(good, {"ab"})
    assert calls == [{"name": "ab", "arguments": '{"c": "bc"}'}]


@pytest.mark.parametrize("reply,opened,reasoning,content", [
    ("<think>\nThe user asks.\n</think>\n\nParis.", False, "\nThe user asks.\n", "Paris."),
    ("Just text.", False, None, "Just text."),
    ("Weighing it up.</think> Paris.", True, "Weighing it up.", "Paris."),
    ("<think>still going", False, "still going", ""),
    ("<think></think><tool_call>x", False, "", "<tool_call>x"),
])
def test_reasoning_is_split_off_whole_and_streamed(reply, opened, reasoning, content):
    assert chat.split_reasoning(reply, opened) == (reasoning, content)
    for size in (1, 2, 5, 1000):
        splitter, events = chat.ReasoningSplitter(opened), []
        for i in range(0, len(reply), size):
            events += splitter.push(reply[i:i + size])
        events += splitter.finish()
        assert "".join(v for k, v in events if k == "content") == content
        assert "".join(v for k, v in events if k == "reasoning") == (reasoning or "")


def test_the_templates_that_think_and_the_prompts_that_open_a_thought():
    assert chat.uses_reasoning(QWEN3) and chat.uses_reasoning(DEEPSEEK_R1) and not chat.uses_reasoning(LLAMA31)
    assert chat.opens_reasoning(chat.render(DEEPSEEK_R1, ASKED[:1]))
    assert not chat.opens_reasoning(chat.render(QWEN3, ASKED[:1]))
    done = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>hm</think>Hello"},
            {"role": "user", "content": "Bye"}]
    assert "hm" not in chat.render(QWEN3, done) and "Hello" in chat.render(QWEN3, done)


# --- on the real model --------------------------------------------------------------

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -99, "maximum": 99},
        "y": {"type": "integer", "minimum": -99, "maximum": 99}},
                                           "required": ["x", "y"], "additionalProperties": False}},
     "properties": {"start": {"$ref": "#/$defs/point"}, "label": {"type": "string", "maxLength": 10}},
     "required": ["start"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
]
PERSON = [{"role": "user", "content": "Describe a person, a color or a point as JSON."}]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SCHEMAS)))
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_api_output_validates_against_its_schema(smol_llm, index, temperature):
    text = smol_llm.chat(PERSON, max_new_tokens=80, json_schema=SCHEMAS[index], temperature=temperature,
                         top_p=0.95, seed=index)
    jsonschema.validate(json.loads(text), SCHEMAS[index])


@pytest.mark.slow
def test_api_output_matches_its_regex_and_grammar(smol_llm):
    import re
    out = smol_llm.generate("Today's date:", max_new_tokens=16, regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", out), out
    gbnf = 'root ::= answer "." \nanswer ::= "yes" | "no"'
    assert smol_llm.generate("Is water wet? Answer:", max_new_tokens=8, grammar=gbnf) in ("yes.", "no.")
    lark = 'start: "The answer is " NUMBER\nNUMBER: /[0-9]{1,3}/'
    assert re.fullmatch(r"The answer is [0-9]{1,3}", smol_llm.generate("2 + 2?", max_new_tokens=10, grammar=lark))


@pytest.mark.slow
def test_streamed_constrained_text_is_the_generated_text(smol_llm):
    schema = SCHEMAS[1]
    streamed = "".join(smol_llm.chat_stream(PERSON, max_new_tokens=30, json_schema=schema))
    assert streamed == smol_llm.chat(PERSON, max_new_tokens=30, json_schema=schema)


def reference_under_regex(llm, prompt_ids: list[int], pattern: str, n: int) -> list[int]:
    """Greedy decoding masked step by step in plain Python: each step's logits
    from a fresh forward over the whole sequence, the allowed tokens those
    whose text keeps the output a prefix of a match (the `regex` module's
    partial matching), an end token once the output matches whole."""
    regex = pytest.importorskip("regex")
    tok, vocab = llm.tokenizer, llm.model.args.vocab_size
    texts = [tok.decode([i]) for i in range(vocab)]
    special = set(tok.backend.tok.get_added_tokens_decoder())
    ids, out, made = list(prompt_ids), "", []
    for _ in range(n):
        allowed = [t for t in range(vocab) if t not in special and texts[t]
                   and regex.fullmatch(pattern, out + texts[t], partial=True)]
        if not allowed:  # (the match is complete: nothing may follow it)
            break
        allowed += tok.eos_ids if regex.fullmatch(pattern, out) else []
        llm.generator.reset()
        logits = llm.generator.logits(ids, 0, last=len(ids) - 1)[0, -1]
        best = max(allowed, key=lambda t: logits[t].item())
        made.append(best)
        if best in tok.eos_ids:
            break
        out, ids = out + texts[best], ids + [best]
    return made


@pytest.mark.slow
@pytest.mark.parametrize("prompt,pattern", [
    ("Is the sky blue? Answer:", r" ?(yes|no|maybe)(, because [a-z ]{1,30})?\."),
    ("The year and city of the first Olympics:", r"[0-9]{4}, [A-Z][a-z]+")])
def test_greedy_constrained_output_equals_a_plain_python_masked_reference(smol_llm, prompt, pattern):
    ids = smol_llm.tokenizer.encode(prompt)
    expected = reference_under_regex(smol_llm, ids, pattern, 12)
    smol_llm.generator.reset()
    assert list(smol_llm.stream_ids(ids, 12, regex=pattern)) == expected


@pytest.mark.slow
@pytest.mark.parametrize("kind,k", [("ngram", 4), ("self", 3)])
def test_speculative_constrained_output_is_the_constrained_output_on_the_real_model(smol_llm, kind, k):
    """SmolLM2 in fp32 on JSON that repeats its keys: prompt lookup's drafts
    are kept where the grammar and the model agree, and the output is the
    constrained output token for token."""
    from brisklm.constrain import compile_grammar
    from brisklm.speculative import ModelDrafter, NgramDrafter
    tok, gen = smol_llm.tokenizer, smol_llm.generator
    schema = {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "price": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "price"], "additionalProperties": False}, "minItems": 3, "maxItems": 4}
    grammar = compile_grammar(tok, smol_llm.model.args.vocab_size, json_schema=schema)
    ids = smol_llm.chat_ids([{"role": "user", "content": 'Copy this list as JSON: [{"name": "apple", "price": 3}, '
                                                          '{"name": "pear", "price": 4}, {"name": "fig", "price": 5}]'}])
    gen.reset()
    want = list(gen.tokens(ids, 48, GREEDY, stop_ids=tok.eos_ids, constraint=grammar.constraint()))
    gen.reset()
    drafter = NgramDrafter() if kind == "ngram" else ModelDrafter(gen.model, depth=8)
    got = list(gen.tokens(ids, 48, GREEDY, stop_ids=tok.eos_ids, drafter=drafter, draft_tokens=k,
                          adapt_drafts=False, constraint=grammar.constraint()))
    assert got == want, (tok.decode(got), tok.decode(want))
    jsonschema.validate(json.loads(tok.decode(got)), schema)
    assert gen.stats.drafted_steps > 0
    assert kind != "ngram" or gen.stats.tokens_per_step > 1.5  # (the keys and names repeat)


@pytest.mark.slow
def test_speculation_s_own_policy_under_a_schema_gives_the_constrained_output(smol_llm):
    """The path a user gets (the draft policy on: plain runs between
    drafting steps, judged for free) on a prompt whose reply does not repeat
    its prompt: still token for token the constrained output."""
    from brisklm.constrain import compile_grammar
    from brisklm.speculative import NgramDrafter
    tok, gen = smol_llm.tokenizer, smol_llm.generator
    schema = {"type": "object", "properties": {"name": {"enum": ["get_weather", "search"]}, "arguments": {
        "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query"], "additionalProperties": False}}, "required": ["name", "arguments"],
        "additionalProperties": False}
    grammar = compile_grammar(tok, smol_llm.model.args.vocab_size, json_schema=schema)
    ids = smol_llm.chat_ids([{"role": "user", "content": "List a few open issues of a software project as JSON "
                                                          "records, with ids, titles, a status and a score each."}])
    gen.reset()
    want = list(gen.tokens(ids, 40, GREEDY, stop_ids=tok.eos_ids, constraint=grammar.constraint()))
    for _ in range(2):  # (the second run starts from the step costs the first measured)
        gen.reset()
        got = list(gen.tokens(ids, 40, GREEDY, stop_ids=tok.eos_ids, drafter=NgramDrafter(), draft_tokens=4,
                              constraint=grammar.constraint()))
        assert got == want, (tok.decode(got), tok.decode(want))


@pytest.mark.slow
@pytest.mark.parametrize("given,named", [
    (dict(json_schema="{"), "json_schema: not valid JSON"),
    (dict(json_schema={"type": "nope"}), "json_schema: "),
    (dict(json_schema={"$ref": "#/$defs/missing"}), "json_schema: "),
    (dict(regex="[a-"), "regex: "),
    (dict(grammar="start: undefined_rule"), "grammar: "),
    (dict(grammar='root ::= "a" ('), "grammar: "),
    (dict(regex="a", grammar="start: \"a\""), "give one constraint"),
])
def test_a_bad_constraint_is_one_line_naming_it(smol_llm, given, named):
    with pytest.raises(BriskError) as e:
        smol_llm.generate("x", max_new_tokens=4, **given)
    assert str(e.value).startswith(named) and "\n" not in str(e.value)


def brisk(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "brisklm", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))})


@pytest.mark.slow
def test_cli_output_validates_against_the_schema_file(tmp_path, smollm2_gguf):
    schema = SCHEMAS[0]
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    done = brisk("generate", "--checkpoint_path", smollm2_gguf, "--json_schema", str(tmp_path / "schema.json"),
                 "--chat", "--prompt", "Describe a person as JSON.", "--max_new_tokens", "60", "--quiet")
    assert done.returncode == 0, done.stderr[-2000:]
    jsonschema.validate(json.loads(done.stdout), schema)


@pytest.mark.slow
@pytest.mark.parametrize("flags,said", [(["--json_schema", "missing.json"], "cannot read it"),
                                        (["--json_schema", "bad.json"], "json_schema: "),
                                        (["--regex", "[a-"], "regex: "),
                                        (["--regex", "a", "--json_object"], "give one of")])
def test_cli_a_bad_constraint_is_one_error_line_before_loading(tmp_path, flags, said):
    (tmp_path / "bad.json").write_text('{"type": "nope"}')
    flags = [str(tmp_path / f) if f.endswith(".json") else f for f in flags]
    done = brisk("generate", *flags, timeout=60)
    assert done.returncode != 0
    assert said in done.stderr and "Traceback" not in done.stderr and "Loading" not in done.stderr
