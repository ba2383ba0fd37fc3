"""Structured output and tool calls through the real server (brisk serve, the
bundled SmolLM2 in fp32 on the CPU, one server for the module) with the
official openai client: every response_format reply parses and validates
(the jsonschema library, formats checked) over the kinds of schemas agents
send, greedy and sampled, streamed and not, and a greedy stream's deltas
assemble to the reply itself; forced tool calls (required, named, one or
parallel) always parse and validate, streamed as the same calls; a call fed
back with its result (role tool, tool_call_id) gets a reply under tool_choice
auto; logprobs under a schema are the masked distribution's; a bad schema
is a 400 naming the field."""
import json
import math

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from test_server import post, start, stop  # noqa: E402

pytestmark = pytest.mark.slow
KEY = "structured-key"


def obj(properties: dict, required=None, **more) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, **more}


NAME = {"type": "string", "maxLength": 16}
SCHEMAS = {  # name: (prompt, schema): what agents send, each reply kept short by its bounds
    "person": ("a person", obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    "enum": ("the color of the sky", obj({"color": {"enum": ["red", "green", "blue"]}})),
    "boolean": ("whether water is wet", obj({"answer": {"type": "boolean"}})),
    "bounded_number": ("a temperature", obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}})),
    "exclusive_bounds": ("a probability", obj({"p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}})),
    "tags": ("three tags for a cat photo", obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                         "minItems": 1, "maxItems": 3}})),
    "exact_items": ("two integers", obj({"pair": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                              "maximum": 99},
                                                   "minItems": 2, "maxItems": 2}})),
    "nested": ("a user with an address", obj({"user": obj({"name": NAME, "address": obj({
        "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})})),
    "optional": ("a book, its year if known", obj({"title": NAME, "year": {"type": "integer", "minimum": 1000,
                                                                            "maximum": 2030}}, required=["title"])),
    "ref": ("a line from one point to another", {
        "$defs": {"point": obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                "y": {"type": "integer", "minimum": -9, "maximum": 9}})},
        **obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})}),
    "array_of_objects": ("two fruits and their prices", {"type": "array", "minItems": 1, "maxItems": 2, "items": obj(
        {"fruit": {"type": "string", "maxLength": 10}, "cents": {"type": "integer", "minimum": 1, "maximum": 999}})}),
    "pattern": ("a flight code", obj({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}})),
    "date": ("a date of birth", obj({"born": {"type": "string", "format": "date"}})),
    "email": ("a contact", obj({"email": {"type": "string", "format": "email", "maxLength": 30}})),
    "uuid": ("a record id", obj({"id": {"type": "string", "format": "uuid"}})),
    "ipv4": ("a server address", obj({"ip": {"type": "string", "format": "ipv4"}})),
    "any_of": ("a result, a number or an error text", obj({"result": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 999}, {"type": "string", "maxLength": 12}]}})),
    "nullable": ("a middle name, or null", obj({"middle": {"type": ["string", "null"], "maxLength": 12}})),
    "const": ("a status report", obj({"version": {"const": 2}, "ok": {"type": "boolean"}})),
    "enum_array": ("the days of a weekend", obj({"days": {"type": "array", "minItems": 1,
                                                          "maxItems": 2, "items": {"enum": ["sat", "sun", "mon"]}}})),
    "string_lengths": ("a short password", obj({"password": {"type": "string", "minLength": 6, "maxLength": 10}})),
    "classification": ("the sentiment of 'I love it'", obj({
        "label": {"enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
}
FORMATS = jsonschema.FormatChecker()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 30},
                                                    "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
                   "required": ["query"]}}}
TOOLS = {t["function"]["name"]: t for t in (WEATHER, SEARCH)}


@pytest.fixture(scope="module")
def client(smollm2_gguf):
    proc, url = start(smollm2_gguf, "--api_key", KEY)
    yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300), url
    stop(proc)


def request(model: str, name: str, **more) -> dict:
    prompt, schema = SCHEMAS[name]
    return dict(model=model, messages=[{"role": "user", "content": f"Reply in JSON with {prompt}."}], max_tokens=80,
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                        "strict": True}}, **more)


def streamed(api, **kwargs) -> tuple[str, str, list[dict]]:
    """(the content, the finish reason, the tool calls) a stream's deltas assemble to."""
    content, finish, calls = "", None, {}
    for chunk in api.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
    return content, finish, [calls[i] for i in sorted(calls)]


def test_there_are_twenty_schemas_of_every_kind():
    assert len(SCHEMAS) >= 20
    for _, schema in SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_reply_validates_greedy_and_sampled_and_a_stream_assembles_to_the_reply(client, name):
    api, _ = client
    model = api.models.list().data[0].id
    _, schema = SCHEMAS[name]
    reply = api.chat.completions.create(**request(model, name, temperature=0)).choices[0]
    assert reply.finish_reason == "stop", reply.message.content
    jsonschema.validate(json.loads(reply.message.content), schema, format_checker=FORMATS)
    content, finish, _ = streamed(api, **request(model, name, temperature=0))
    assert (content, finish) == (reply.message.content, "stop")
    sampled = request(model, name, temperature=1.0, top_p=0.95, seed=len(name))
    if len(name) % 2:
        text = streamed(api, **sampled)[0]
    else:
        text = api.chat.completions.create(**sampled).choices[0].message.content
    jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_replies_are_objects(client, stream):
    api, _ = client
    kwargs = dict(model=api.models.list().data[0].id, max_tokens=60, temperature=0.8, seed=1,
                  response_format={"type": "json_object"},
                  messages=[{"role": "user", "content": "Describe a cat as a JSON object with two keys."}])
    text = streamed(api, **kwargs)[0] if stream else api.chat.completions.create(**kwargs).choices[0].message.content
    assert isinstance(json.loads(text), dict)


ASKS = ["What is the weather like in Paris?", "Find me pages about llamas.", "Is it raining in Oslo, in celsius?"]


@pytest.mark.parametrize("choice,parallel,ask", [("required", False, 0), ("get_weather", False, 2),
                                                 ("search", False, 1), ("required", True, 1), ("get_weather", True, 0)])
def test_forced_tool_calls_always_parse_and_validate_and_stream_as_the_same_calls(client, choice, parallel, ask):
    """Greedy and sampled. With parallel calls the grammar lets the model go
    on calling, which this small one does until max_tokens: the calls it
    finished are returned, each valid."""
    api, _ = client
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    kwargs = dict(model=api.models.list().data[0].id, messages=[{"role": "user", "content": ASKS[ask]}],
                  tools=[WEATHER, SEARCH], tool_choice=tool_choice, parallel_tool_calls=parallel,
                  max_tokens=40 if parallel else 60, temperature=0)
    ends = ("tool_calls", "length") if parallel else ("tool_calls",)
    reply = api.chat.completions.create(**kwargs).choices[0]
    assert reply.finish_reason in ends, reply.message
    calls = reply.message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == choice or choice == "required"
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[call.function.name]["function"]["parameters"])
    _, finish, deltas = streamed(api, **kwargs)
    assert finish == reply.finish_reason
    assert [(c["name"], c["arguments"]) for c in deltas] == [(c.function.name, c.function.arguments) for c in calls]
    assert all(d["id"].startswith("call_") for d in deltas)
    sampled = api.chat.completions.create(**{**kwargs, "temperature": 1.0, "seed": ask}).choices[0]
    assert sampled.finish_reason in ends and sampled.message.tool_calls
    for call in sampled.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[call.function.name]["function"]["parameters"])


def test_an_auto_call_round_trips_through_its_tool_result(client):
    """A call the model made (forced here: this small model seldom calls on its
    own) goes back as the assistant's tool_calls with the tool's result
    (role tool, its tool_call_id); under tool_choice auto the model answers,
    in text or in further calls that parse and validate, streamed the same."""
    api, _ = client
    model = api.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather like in Paris?"}]
    first = api.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="required",
                                        max_tokens=40, temperature=0).choices[0].message
    call = first.tool_calls[0]
    messages += [first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21, "sky": "clear"}'}]
    kwargs = dict(model=model, messages=messages, tools=[WEATHER], tool_choice="auto", max_tokens=30, temperature=0)
    reply = api.chat.completions.create(**kwargs).choices[0]
    assert reply.message.content or reply.message.tool_calls
    for again in reply.message.tool_calls or []:
        jsonschema.validate(json.loads(again.function.arguments), WEATHER["function"]["parameters"])
    content, finish, calls = streamed(api, **kwargs)
    assert finish == reply.finish_reason and content == (reply.message.content or "")
    assert [c["arguments"] for c in calls] == [c.function.arguments for c in reply.message.tool_calls or []]


@pytest.mark.parametrize("schema,said", [({"type": "object", "properties": {"a": {"type": "nope"}}}, "nope"),
                                         ({"$ref": "#/$defs/missing"}, "missing"),
                                         ({"type": "string", "pattern": "[a-"}, "")])
def test_a_bad_schema_is_a_400_naming_the_field(client, schema, said):
    api, url = client
    status, answer = post(url + "/v1/chat/completions", {
        "model": api.models.list().data[0].id, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}, key=KEY)
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == "response_format.json_schema.schema" and said in error["message"]
    assert "\n" not in error["message"] and "Traceback" not in error["message"]


def test_logprobs_under_a_schema_are_the_masked_distribution_s_streamed_the_same(client):
    """The enum's value has a few allowed first tokens: their masked
    probabilities, all listed among 20 alternatives, sum to 1; greedy picks
    the likeliest; the tokens tile the reply, which is the one without logprobs."""
    api, _ = client
    kwargs = request(api.models.list().data[0].id, "enum", temperature=0, logprobs=True, top_logprobs=20)
    reply = api.chat.completions.create(**kwargs).choices[0]
    entries = reply.logprobs.content
    assert "".join(e.token for e in entries) == reply.message.content
    assert reply.message.content == api.chat.completions.create(**request(kwargs["model"], "enum", temperature=0)) \
        .choices[0].message.content
    assert all(e.logprob <= 0 and e.logprob == max(a.logprob for a in e.top_logprobs) for e in entries)
    whole = [e for e in entries if len(e.top_logprobs) < 20]
    assert whole and all(abs(sum(math.exp(a.logprob) for a in e.top_logprobs) - 1) < 1e-3 for e in whole)
    chunks = list(api.chat.completions.create(stream=True, **kwargs))
    streamed_entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed_entries] == [(e.token, round(e.logprob, 4)) for e in entries]


# --- other families, on a tiny random model whose template is theirs ---------------

def family_server(tmp_path_factory, template: str):
    """(client, model) of a server over a tiny random Llama (test_harness's)
    whose chat template is `template`."""
    pytest.importorskip("transformers")
    from test_harness import tiny_hf_folder
    folder = tmp_path_factory.mktemp("family")
    tiny_hf_folder(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(template)
    proc, url = start(str(folder), "--model_name", "tiny", base=("--dtype", "float32", "--max_seq_length", "2048",
                                                             "--allow_long_context"))
    return proc, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llama31(tmp_path_factory):
    from test_constrain import LLAMA31
    proc, api = family_server(tmp_path_factory, LLAMA31)
    yield api
    stop(proc)


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    from test_constrain import DEEPSEEK_R1
    proc, api = family_server(tmp_path_factory, DEEPSEEK_R1)
    yield api
    stop(proc)


@pytest.mark.parametrize("parallel", [False, True])
def test_a_llama_template_s_forced_calls_come_in_its_json_form_and_parse(llama31, parallel):
    """Llama 3.1's template: the forced call's grammar is its {"name",
    "parameters"} form, parsed back into tool_calls, streamed the same."""
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, SEARCH],
                  tool_choice="required", parallel_tool_calls=parallel, max_tokens=80, temperature=0)
    reply = llama31.chat.completions.create(**kwargs).choices[0]
    calls = reply.message.tool_calls
    assert calls and reply.finish_reason in ("tool_calls", "length"), reply.message
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[call.function.name]["function"]["parameters"])
    _, finish, deltas = streamed(llama31, **kwargs)
    assert finish == reply.finish_reason
    assert [(c["name"], c["arguments"]) for c in deltas] == [(c.function.name, c.function.arguments) for c in calls]


def test_a_prompt_that_opens_a_thought_gives_reasoning_content_streamed_the_same(thinking):
    """DeepSeek-R1's template opens <think> for the model: the reply up to
    </think> (all of it here: a random model does not close it) is
    reasoning_content, in the message and in the stream's deltas."""
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Why?"}], max_tokens=12, temperature=0)
    message = thinking.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra.get("reasoning_content")
    assert reasoning and message.content == ""
    chunks = list(thinking.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == ""
    constrained = thinking.chat.completions.create(**kwargs, response_format={"type": "json_object"}).choices[0]
    assert "reasoning_content" not in constrained.message.model_extra  # (a schema shapes the reply from its start)
    assert isinstance(json.loads(constrained.message.content), dict) or constrained.finish_reason == "length"
