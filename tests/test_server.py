"""brisk serve, started as a real subprocess on a free loopback port with the
bundled SmolLM2 (fp32 on the CPU), driven by the official openai client and by
raw HTTP: completions, chat, streaming, stop strings, logprobs with echo,
usage, the OpenAI error format, the API key, the queue limit, clients that
disconnect, and generated bodies that must never give a 5xx."""
import concurrent.futures
import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.slow
KEY = "test-key-123"
GREEDY = dict(temperature=0, max_tokens=12)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(gguf: str, *flags: str, base=("--dtype", "float32", "--quantize", "none", "--max_seq_length", "1024")):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "brisklm", "serve", "--checkpoint_path", gguf, "--port", str(port),
                             *base, *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url
        except (urllib.error.URLError, ConnectionError, OSError):
            if proc.poll() is not None:
                raise RuntimeError(proc.stdout.read())
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


def stop(proc):
    proc.terminate()  # SIGTERM: a graceful shutdown, exit 0
    assert proc.wait(timeout=30) == 0, proc.stdout.read()[-2000:]


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    proc, url = start(smollm2_gguf, "--api_key", KEY)
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def post(url: str, body, key=KEY, raw: bytes | None = None, headers=None):
    """(status, parsed JSON body) of a POST."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {}),
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_completion_streamed_equals_the_plain_one_greedy_and_seeded(client, model_id):
    for sampling in (GREEDY, dict(temperature=0.8, top_p=0.9, seed=7, max_tokens=12)):
        plain = client.completions.create(model=model_id, prompt="The capital of France is", **sampling)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model_id, prompt="The capital of France is", stream=True, **sampling))
        assert streamed == plain.choices[0].text and plain.choices[0].text
        assert plain.usage.prompt_tokens == 5 and 1 <= plain.usage.completion_tokens <= 12
        assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
    assert "Paris" in client.completions.create(model=model_id, prompt="The capital of France is",
                                                **GREEDY).choices[0].text


def test_chat_streamed_equals_the_plain_reply_and_stops_before_a_stop_string(client, model_id):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(model=model_id, messages=messages, **GREEDY)
    text = plain.choices[0].message.content
    chunks = list(client.chat.completions.create(model=model_id, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert plain.choices[0].finish_reason in ("stop", "length") and plain.choices[0].message.role == "assistant"
    word = text.split()[1]
    cut = client.chat.completions.create(model=model_id, messages=messages, stop=[word], **GREEDY)
    assert cut.choices[0].message.content == text[:text.index(word)] and cut.choices[0].finish_reason == "stop"


def test_echo_logprobs_are_the_models_log_likelihoods(client, model_id, smol_llm):
    """The prompt's per-token log-probabilities, from the server, against the
    same fp32 model's logits computed here: within 1e-4."""
    text = "The quick brown fox jumps over the lazy dog."
    out = client.completions.create(model=model_id, prompt=text, echo=True, logprobs=2, max_tokens=3, temperature=0)
    lp = out.choices[0].logprobs
    ids = smol_llm.tokenizer.encode(text)
    with torch.no_grad():
        logits = smol_llm.model(torch.tensor([ids]), torch.arange(len(ids)), kv_len=len(ids))[0].float()
    smol_llm.generator.reset()
    want = logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + 3
    got = torch.tensor(lp.token_logprobs[1:len(ids)])
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert out.choices[0].text.startswith(text) and all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]


def test_bad_requests_get_openai_errors_never_a_5xx(server, model_id):
    url = server + "/v1/completions"
    cases = [(dict(raw=b"{not json"), 400), (dict(body={"model": model_id}), 400),  # no prompt
             (dict(body={"prompt": 5}), 400), (dict(body={"prompt": "hi", "max_tokens": -3}), 400),
             (dict(body={"prompt": "hi", "max_tokens": "many"}), 400), (dict(body=[1, 2]), 400),
             (dict(body={"prompt": "hi", "model": "gpt-9"}), 404),
             (dict(body={"prompt": "hi", "temperature": 9}), 400),
             (dict(body={"prompt": [99999999]}), 400),
             (dict(body={"prompt": "hi", "unknown_field": 1, "max_tokens": 2}), 200),  # ignored, as OpenAI does
             (dict(body={"prompt": "hi"}, key=None), 401), (dict(body={"prompt": "hi"}, key="wrong"), 401)]
    for kwargs, status in cases:
        got, body = post(url, kwargs.get("body"), key=kwargs.get("key", KEY), raw=kwargs.get("raw"))
        assert got == status, (kwargs.get("body"), got, body)
        if status != 200:
            assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    host, port = server.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)  # a body declared over the limit: 413 unread
    conn.putrequest("POST", "/v1/completions")
    for name, v in (("Content-Type", "application/json"), ("Content-Length", str(5 << 20)),
                    ("Authorization", f"Bearer {KEY}")):
        conn.putheader(name, v)
    conn.endheaders(b"{}")
    answer = conn.getresponse()
    assert answer.status == 413 and "limit" in json.loads(answer.read())["error"]["message"]
    conn.close()
    got, body = post(url, {"prompt": "word " * 1100, "max_tokens": 10})
    assert got == 400 and "1101 tokens" in body["error"]["message"] and "1024" in body["error"]["message"]
    got, body = post(server + "/v1/nothing", {})
    assert got == 404 and "error" in body
    with urllib.request.urlopen(server + "/health") as r:  # no key needed
        assert json.loads(r.read()) == {"status": "ok"}
    req = urllib.request.Request(server + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req) as r:
        metrics = r.read().decode()
    assert 'brisk_requests_total{path="/v1/completions",status="400"}' in metrics
    assert "brisk_time_to_first_token_seconds_bucket" in metrics and "brisk_queue_depth" in metrics


def test_concurrent_clients_some_disconnecting_all_others_served(server, client, model_id):
    """8 clients x 3 requests, half streaming, some dropping the stream after
    two chunks: no 5xx, every kept request a full body, and greedy text after
    the storm equals greedy text before it."""
    before = client.completions.create(model=model_id, prompt="Once upon a time", **GREEDY).choices[0].text

    def one(i):
        if i % 2:
            stream = client.completions.create(model=model_id, prompt=f"Story {i}:", stream=True, max_tokens=16,
                                               temperature=0.7, seed=i)
            for n, _ in enumerate(stream):
                if i % 4 == 1 and n == 1:
                    stream.close()  # the client goes away mid-stream
                    return "dropped"
            return "streamed"
        out = client.chat.completions.create(model=model_id, max_tokens=16,
                                             messages=[{"role": "user", "content": f"Count to {i}"}])
        assert out.choices[0].message.content is not None
        return "done"

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(24)))
    assert results.count("dropped") == 6 and results.count("done") == 12
    assert client.completions.create(model=model_id, prompt="Once upon a time", **GREEDY).choices[0].text == before


def test_generated_bodies_never_give_a_5xx(server):
    """Bodies drawn by hypothesis (JSON values, and objects with the API's field
    names holding any JSON value): every answer is 2xx or 4xx with a JSON body."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    scalar = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False) | st.text(max_size=20)
    value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3)
                         | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
    fields = ["prompt", "max_tokens", "messages", "temperature", "top_p", "top_k", "min_p", "stop", "n",
              "stream", "logprobs", "echo", "seed", "model"]
    body = value | st.fixed_dictionaries({"prompt": st.just("Hi"), "max_tokens": st.just(2)},
                                         optional={f: value for f in fields[3:]}) \
        | st.dictionaries(st.sampled_from(fields), value, max_size=5)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(body, st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    def check(b, path):
        if isinstance(b, dict) and isinstance(b.get("max_tokens"), int) and b["max_tokens"] > 4:
            b["max_tokens"] = 4  # (keep generation short; huge ones are tested above)
        if isinstance(b, dict) and isinstance(b.get("n"), int):
            b["n"] = min(b["n"], 2)
        status, answer = post(server + path, b)
        assert status < 500, (b, status, answer)

    check()


def test_a_full_queue_answers_429_and_sigterm_ends_cleanly(smollm2_gguf):
    proc, url = start(smollm2_gguf, "--queue", "0")
    try:
        slow = {"prompt": "Tell me a long story.", "max_tokens": 400, "stream": True, "temperature": 0.8,
                "ignore_eos": True}  # (busy for all 400 tokens: an end token cannot free the engine early)
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(slow).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        first = urllib.request.urlopen(req, timeout=60)
        first.readline()  # generating now
        status, body = post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 2}, key=None)
        assert status == 429 and body["error"]["type"] == "rate_limit_error"
        first.close()
    finally:
        stop(proc)
