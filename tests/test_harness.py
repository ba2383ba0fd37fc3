"""lm-evaluation-harness through brisk eval --tasks, on the bundled SmolLM2
and on tiny random models built here.

The harness's requests are answered by the engine (api.LLM.score and its
generation); the numbers are checked against the engine's own perplexity
path (evaluate.negative_log_likelihood: plain windows of one forward each,
its own model instance), and against lm-eval's own `hf` model on the same
weights, in fp32, to 1e-4."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")

import brisklm  # noqa: E402
import forked_brisk  # noqa: E402
from brisklm.evaluate import negative_log_likelihood  # noqa: E402
from brisklm.errors import BriskError  # noqa: E402
from brisklm.harness import BriskLM  # noqa: E402

QUESTIONS = [("What is the capital of France?", [" Paris", " Berlin", " Madrid"], 0),
             ("How many legs does a spider have?", [" six", " eight", " ten"], 1),
             ("What color is the sky on a clear day?", [" green", " red", " blue"], 2)]


class Request:  # (the harness's Instance: its args are all the model reads)
    def __init__(self, *args):
        self.args = args


TEXT = ("The river rises in the hills north of the town and runs south through fields of wheat. "
        "Question: What is the capital of France? Answer: Paris. How many legs does a spider have? Eight. "
        "Once upon a time there was a small fox who lived near the water and ate berries every day. ")


CHAT_TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")


def tiny_hf_folder(folder, context: int = 256, eos_scale: float = 1.0) -> str:
    """A tiny random Llama saved by transformers, with a byte-level BPE trained
    here on TEXT (a BOS token that is not added, as SmolLM2's), loadable by
    AutoTokenizer as lm-eval's hf model loads it; eos_scale > 1 makes the end
    token the likeliest one after many texts."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|bos|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|bos|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=bpe.get_vocab_size(), hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=context, bos_token_id=1, eos_token_id=0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[0] *= eos_scale
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_hf_folder(tmp_path_factory.mktemp("tiny"))


def hf_model(folder, max_length: int):
    """lm-eval's own hf model on the folder's weights, fp32, its context cut to max_length."""
    from lm_eval.models.huggingface import HFLM
    return HFLM(pretrained=folder, max_length=max_length, dtype="float32", device="cpu", batch_size=1)


def instances(kind: str, args: list[tuple]):
    from lm_eval.api.instance import Instance
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_rolling_loglikelihood_of_documents_past_the_cache_equals_lm_evals_hf(tiny):
    """Documents 3x the KV cache (and ones about its length, one short) score
    window by window as lm-eval's hf model scores them."""
    lm = BriskLM(brisklm.load(tiny, device="cpu", dtype="float32", max_seq_length=32, quiet=True))
    words = (TEXT * 3).split()
    docs = [" ".join(words[:n]) for n in range(1, len(words))]
    docs = [next(d for d in docs if len(lm.encode(d)) >= 3 * 32), next(d for d in docs if len(lm.encode(d)) >= 32),
            [d for d in docs if len(lm.encode(d)) < 32][-1], "Paris"]
    requests = instances("loglikelihood_rolling", [(d,) for d in docs])
    want = hf_model(tiny, 32).loglikelihood_rolling(requests, disable_tqdm=True)
    got = lm.loglikelihood_rolling(requests)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-4, (got, want)


def test_truncated_multiple_choice_requests_keep_the_context_lm_evals_hf_keeps(tiny):
    """Requests longer than the cache lose their oldest context tokens, as
    many as lm-eval's hf model drops (it feeds max_length tokens and scores
    the one they predict)."""
    lm = BriskLM(brisklm.load(tiny, device="cpu", dtype="float32", max_seq_length=16, quiet=True))
    context = "Once upon a time there was a small fox. Question: What is the capital of France? Answer:"
    requests = instances("loglikelihood", [(context, c) for c in (" Paris", " Eight", " the water and")])
    assert all(sum(map(len, lm.pair(*r.args))) > 17 for r in requests)
    want = hf_model(tiny, 16).loglikelihood(requests, disable_tqdm=True)
    got = lm.loglikelihood(requests)
    assert [g for _, g in got] == [g for _, g in want]
    assert max(abs(a - b) for (a, _), (b, _) in zip(got, want)) <= 1e-4, (got, want)
    with pytest.raises(BriskError, match=r"continuation of \d+ tokens is longer than the KV cache \(16\)"):
        lm.loglikelihood(instances("loglikelihood", [("Hi", " ".join(["fox"] * 17))]))


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    """A second fp32 model: the perplexity path sets its own caches."""
    return brisklm.load(smollm2_gguf, device="cpu", dtype="float32", quantize="none", quiet=True).model


def reference_logprob(reference, ids, start):
    """log p(ids[start:] | ids[:start]) from plain forwards over ids and over its prefix."""
    whole, _ = negative_log_likelihood(reference, torch.tensor(ids), window=len(ids))
    head, _ = negative_log_likelihood(reference, torch.tensor(ids[:start]), window=len(ids)) if start > 1 else (0, 0)
    return -(whole - head)


@pytest.mark.slow
def test_loglikelihoods_equal_the_perplexity_path_and_reuse_the_shared_context(smol_llm, reference):
    lm = BriskLM(smol_llm)
    for question, choices, _ in QUESTIONS:
        context = f"Question: {question}\nAnswer:"
        got = lm.loglikelihood([Request(context, c) for c in choices])
        for choice, (logprob, greedy) in zip(choices, got):
            ctx, cont = lm.pair(context, choice)
            assert ctx + cont == lm.encode(context + choice)  # (no BOS for SmolLM2)
            assert abs(logprob - reference_logprob(reference, ctx + cont, len(ctx))) <= 1e-4
        # the cache holds the last request, whose context the next choice reuses
        # (all but its last token, which is only predicted)
        assert smol_llm.generator.cached == lm.encode(context + choices[-1])[:-1]
    # an answer the model would give itself is greedy
    context = "The capital of France is"
    best = smol_llm.generate(context, max_new_tokens=1, temperature=0)
    assert lm.loglikelihood([Request(context, best)])[0][1]
    assert not lm.loglikelihood([Request(context, " the moon and a bicycle")])[0][1]


@pytest.mark.slow
def test_rolling_loglikelihood_covers_every_token_once_in_windows_of_the_cache(smol_llm, reference):
    text = "The river rises in the hills north of the town and runs south through fields of wheat. " * 6
    lm = BriskLM(smol_llm)
    ids = [lm.prefix_id] + lm.encode(text)
    (whole,) = [lm.loglikelihood_rolling([Request(text)])[0]]
    assert abs(whole + negative_log_likelihood(reference, torch.tensor(ids), window=len(ids))[0]) <= 1e-4
    lm.max_length = 32  # windows: the first predicts 32 tokens from the prefix on, the last has a full context
    windowed = lm.loglikelihood_rolling([Request(text)])[0]
    step = negative_log_likelihood(reference, torch.tensor(ids[:len(ids) - (len(ids) - 1) % 32]), window=32)[0]
    tail = (len(ids) - 1) % 32
    last = reference_logprob(reference, ids[-33:], 33 - tail) if tail else 0.0
    assert abs(windowed - (-step + last)) <= 1e-4
    assert abs(windowed - whole) > 1e-3  # (shorter contexts score differently)


def test_generate_until_is_the_engine_generation_cut_before_a_stop(smol_llm):
    lm = BriskLM(smol_llm)
    context = "List three fruits: apple,"
    got = lm.generate_until([Request(context, {"until": [","], "max_gen_toks": 10, "do_sample": False})])
    assert got == [smol_llm.generate(context, max_new_tokens=10, stop=[","], temperature=0)]
    assert "," not in got[0]


MC_TASK = """task: brisk_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """task: brisk_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "List three fruits: {{{{first}}}},"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: [","]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
"""


@pytest.mark.slow
def test_brisk_eval_runs_local_multiple_choice_and_generation_tasks(tmp_path, smollm2_gguf):
    with open(tmp_path / "mc.jsonl", "w") as f:
        for question, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    (tmp_path / "gen.jsonl").write_text(json.dumps({"first": "apple", "answer": " banana"}) + "\n")
    (tmp_path / "mc.yaml").write_text(MC_TASK.format(data=tmp_path / "mc.jsonl"))
    (tmp_path / "gen.yaml").write_text(GEN_TASK.format(data=tmp_path / "gen.jsonl"))
    out = tmp_path / "results.json"
    done = brisk_eval("--checkpoint_path", smollm2_gguf, "--dtype", "float32", "--quantize", "none",
                      "--tasks", f"{tmp_path / 'mc.yaml'},{tmp_path / 'gen.yaml'}", "--output", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert 0 <= results["brisk_tiny_mc"]["acc,none"] <= 1
    assert results["brisk_tiny_gen"]["exact_match,none"] in (0.0, 1.0)
    assert "brisk_tiny_mc" in done.stdout and "Traceback" not in done.stderr
    # (the model's own answers, scored in process, give the same accuracy)
    llm = brisklm.load(smollm2_gguf, device="cpu", dtype="float32", quantize="none", quiet=True)
    lm = BriskLM(llm)
    right = 0
    for question, choices, answer in QUESTIONS:
        scores = [s for s, _ in lm.loglikelihood([Request(f"Question: {question}\nAnswer:", c) for c in choices])]
        right += max(range(len(choices)), key=scores.__getitem__) == answer
    assert results["brisk_tiny_mc"]["acc,none"] == pytest.approx(right / len(QUESTIONS))


def test_without_lm_eval_the_command_says_so_in_one_line(tmp_path):
    code = ("import sys; sys.modules['lm_eval'] = None\n"
            "from brisklm.cli import main; sys.exit(main(['eval', '--tasks', 'hellaswag']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "pip install 'brisklm[eval]'" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_task_file_without_a_name_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("dataset_path: json\n")
    done = brisk_eval("--tasks", str(bad))
    assert done.returncode == 2 and "bad.yaml" in done.stderr and "Traceback" not in done.stderr


def test_chat_templated_requests_are_rendered_as_lm_evals_hf_renders_them(tiny):
    """--apply_chat_template: the model's template, a reply opened by the task
    (no generation prompt) continued where its text ends, as hf does."""
    lm = BriskLM(brisklm.load(tiny, device="cpu", dtype="float32", max_seq_length=64, quiet=True))
    hf = hf_model(tiny, 64)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}]
    assert lm.apply_chat_template(history) == hf.apply_chat_template(history)
    opened = history + [{"role": "assistant", "content": "The answer is"}]
    assert lm.apply_chat_template(opened, False) == hf.apply_chat_template(opened, False)
    assert lm.chat_template(True) == CHAT_TEMPLATE and lm.chat_template(False) is None
    requests = instances("loglikelihood", [(lm.apply_chat_template(history), " Paris")])
    got, want = lm.loglikelihood(requests), hf.loglikelihood(requests, disable_tqdm=True)
    assert abs(got[0][0] - want[0][0]) <= 1e-4 and lm.pair(*requests[0].args)[0][0] == lm.tok.bos_id


def brisk_eval(*args, cwd=None, env=None):
    return forked_brisk.run(["eval", *args], timeout=300, cwd=cwd, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_brisk_eval_logs_samples_and_names_the_model_in_its_config(tiny, tmp_path):
    """--log_samples and --output_path write lm-eval's files (each example
    scored); the config names checkpoint, dtype and quantization; a fractional
    --limit; --seed, --batch_size and --gen_kwargs accepted; data_files
    relative to the task YAML's folder, whatever the working directory."""
    (tmp_path / "tasks" / "data").mkdir(parents=True)
    with open(tmp_path / "tasks" / "data" / "mc.jsonl", "w") as f:
        for i in range(10):
            f.write(json.dumps({"question": f"Is {i} even?", "choices": [" yes", " no"], "answer": i % 2}) + "\n")
    (tmp_path / "tasks" / "mc.yaml").write_text(MC_TASK.format(data="data/mc.jsonl").replace("brisk_tiny_mc",
                                                                                            "brisk_relative_mc"))
    (tmp_path / "elsewhere").mkdir()
    done = brisk_eval("--checkpoint_path", tiny, "--dtype", "float32", "--quantize", "none",
                      "--tasks", str(tmp_path / "tasks" / "mc.yaml"), "--limit", "0.3", "--log_samples",
                      "--output_path", str(tmp_path / "out"), "--seed", "5", "--batch_size", "8",
                      "--gen_kwargs", "temperature=0,max_gen_toks=4", cwd=tmp_path / "elsewhere")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "brisk runs batch 1" in done.stderr
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    (samples_file,) = (tmp_path / "out").rglob("samples_brisk_relative_mc_*.jsonl")
    config = json.loads(results_file.read_text())["config"]
    assert config["model"] == "brisk" and config["model_args"]["model"] == tiny
    assert (config["model_args"]["dtype"], config["model_args"]["quantize"]) == ("float32", "none")
    assert config["model_dtype"] == "float32" and config["weight_formats"] and config["batch_size"] == 1
    assert config["limit"] == 0.3 and config["random_seed"] == 5 and config["gen_kwargs"]["max_gen_toks"] == 4
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == 3 and all(len(s["resps"]) == 2 for s in samples)
    # each example's scores are the model's own
    lm = BriskLM(brisklm.load(tiny, device="cpu", dtype="float32", quiet=True))
    first = samples[0]
    want = lm.loglikelihood([Request(*args.values()) for args in first["arguments"].values()])
    assert max(abs(float(r[0][0]) - w) for r, (w, _) in zip(first["resps"], want)) <= 1e-4


@pytest.mark.slow
def test_a_registered_task_whose_data_cannot_be_fetched_is_one_error_line(tiny, tmp_path):
    done = brisk_eval("--checkpoint_path", tiny, "--tasks", "arc_easy", "--limit", "1", cwd=tmp_path,
                      env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: task arc_easy: cannot load its data") and "Hub" in last


@pytest.mark.parametrize("flags, says", [
    (["--limit", "0"], "--limit: must be a whole number >= 1 or a fraction in (0, 1), got 0"),
    (["--limit", "1.5"], "--limit: must be a whole number >= 1 or a fraction in (0, 1), got 1.5"),
    (["--seed", "1,2"], "--seed: give one seed or four"),
    (["--batch_size", "0"], "--batch-size: must be a whole number >= 1 or auto"),
    (["--gen_kwargs", "temperature"], "'temperature' is not key=value"),
    (["--gen_kwargs", "temprature=0"], "unknown key 'temprature'"), (["--gen_kwargs", "{bad"], "not a JSON object"),
    (["--log_samples"], "--log_samples needs --output or --output_path")])
def test_bad_eval_options_are_one_line_naming_them(flags, says, capsys):
    from brisklm.cli import main
    try:
        code = main(["eval", "--tasks", "hellaswag", *flags])
    except SystemExit as e:  # (argparse's own)
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and says in err[-1] and "Traceback" not in "\n".join(err), err
