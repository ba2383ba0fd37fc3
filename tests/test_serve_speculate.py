"""brisk serve --speculate ngram, started as a real subprocess (test_server's
start) on the bundled SmolLM2 in fp32, driven by the official openai client:
replies equal plain decoding's, each response's usage block says how many
drafts were kept and rejected and how many forwards of the model it took
(streamed too), /metrics adds them up, and a request asked again is drafted
from the first answer."""
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from test_server import start, stop  # noqa: E402

pytestmark = pytest.mark.slow
LIST = ("Copy this list exactly, one item a line: apple, banana, cherry, date, elderberry, fig, grape, "
        "honeydew, kiwi, lemon.")


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    # (uncompiled, start's default: whether drafting pays is the draft policy's measure of the steps,
    # and these tests count drafts; the compiled CPU step, switched to mid-module, changes that measure)
    proc, url = start(smollm2_gguf, "--speculate", "ngram", "--model_name", "m")
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)


def drafts(usage) -> tuple[int, int, int]:
    """(kept, rejected, target steps) from a usage block, through the client's own types."""
    details = usage.completion_tokens_details
    return details.accepted_prediction_tokens, details.rejected_prediction_tokens, details.target_steps


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def test_a_speculated_reply_is_the_plain_reply_and_its_usage_counts_the_drafts(client, smol_llm):
    messages = [{"role": "user", "content": LIST}]
    out = client.chat.completions.create(model="m", messages=messages, max_tokens=48, temperature=0)
    assert out.choices[0].message.content == smol_llm.chat(messages, max_new_tokens=48, temperature=0)
    kept, rejected, steps = drafts(out.usage)
    assert kept + steps == out.usage.completion_tokens - 1  # (each forward: its kept drafts and one token more)
    assert kept > 0 and rejected >= 0


def test_a_completion_and_a_stream_report_the_drafts_too(client, smol_llm):
    prompt = "Repeat: red, green, blue, yellow. Again: red, green, blue, yellow. Again: red,"
    out = client.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0)
    assert out.choices[0].text == smol_llm.generate(prompt, max_new_tokens=24, temperature=0)
    kept, _, steps = drafts(out.usage)
    assert kept + steps == out.usage.completion_tokens - 1
    chunks = list(client.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    kept, _, steps = drafts(chunks[-1].usage)
    assert kept + steps == chunks[-1].usage.completion_tokens - 1


def test_a_sampled_reply_reports_its_drafts(client):
    """(Drafts drawn against differ from run to run, as the draft policy's
    measured step costs do, and so does the sample a seed gives: only its
    distribution is plain sampling's, tested in test_speculative.py.)"""
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": LIST}], max_tokens=32,
                                         temperature=0.7, seed=3)
    kept, _, steps = drafts(out.usage)
    assert kept + steps == out.usage.completion_tokens - 1


def test_metrics_add_up_the_drafts_of_every_request(server, client):
    names = ("brisk_speculative_accepted_tokens_total", "brisk_speculative_draft_tokens_total",
             "brisk_speculative_target_steps_total")
    before = [metric(server, name) for name in names]
    out = client.completions.create(model="m", prompt="One, two, three, four. One, two, three, four. One,",
                                    max_tokens=16, temperature=0)
    kept, rejected, steps = drafts(out.usage)
    after = [metric(server, name) for name in names]
    assert [b - a for a, b in zip(before, after)] == [kept, kept + rejected, steps]


def test_a_request_asked_again_is_drafted_from_its_first_answer(client):
    """The server remembers earlier requests' text (NgramDrafter's memory):
    an open question, where the prompt gives little to copy, asked twice."""
    messages = [{"role": "user", "content": "Write two sentences about a lighthouse keeper."}]
    first, again = (client.chat.completions.create(model="m", messages=messages, max_tokens=40, temperature=0)
                    for _ in range(2))
    assert again.choices[0].message.content == first.choices[0].message.content
    assert drafts(again.usage)[2] < drafts(first.usage)[2] / 2, (first.usage, again.usage)


def test_a_reply_with_logprobs_is_speculated_then_scored_and_counts_its_drafts(client):
    """(Not streamed: the tokens come from speculative decoding, their
    log-probabilities from one scoring pass after it.)"""
    out = client.completions.create(model="m", prompt="The capital of France is", max_tokens=4, temperature=0,
                                    logprobs=1)
    details = out.usage.completion_tokens_details
    assert details is not None and 1 <= details.target_steps <= out.usage.completion_tokens
    assert len(out.choices[0].logprobs.tokens) == out.usage.completion_tokens
