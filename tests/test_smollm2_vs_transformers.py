"""The real SmolLM2-135M-Instruct GGUF, fp32: our greedy tokens equal transformers'.

transformers loads the same GGUF (`from_pretrained(..., gguf_file=...)`,
dequantized to fp32); both models are fed the same prompt ids (ours: the
tokenizer is tested against llama.cpp separately) and must agree token for
token for 32 greedy tokens (transformers' choice after each of ours, from one
forward over all of them), and on the prompt's logits within 1e-3.
"""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


LONG = ("The history of computing is a story of abstraction. Early machines were programmed "
        "by rewiring panels; stored-program computers made software a thing one could write, "
        "copy and share. Assemblers gave names to instructions, compilers gave names to whole "
        "patterns of computation, and operating systems gave every program the illusion of a "
        "machine of its own. Each layer hid the details below it, and each layer was built by "
        "people who trusted the layers underneath. Networking did the same for communication: "
        "packets, routes, and retransmissions disappeared behind sockets and, later, behind "
        "remote procedure calls and web requests. Today a single line of a high-level language "
        "can start thousands of processors in a data centre far away. Yet the old concerns never "
        "left: memory is still slower than arithmetic, data must still move, and the fastest "
        "program is usually the one that reads the fewest bytes. ")
LONG = LONG + "\n\nA second reader put it differently. " + LONG + "Summarise both passages in one sentence:"

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "1, 1, 2, 3, 5, 8, 13,",
    "Les montagnes de la Suisse sont",
    "東京は日本の首都で、",
    "Q: What is the boiling point of water in Celsius?\nA:",
    LONG,
]
CHATS = [
    [{"role": "user", "content": "Write a haiku about the ocean."}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "What colour is the sky on a clear day?"}],
]


@pytest.fixture(scope="module")
def models(smollm2_gguf, smol_llm):
    import functools
    import gguf
    folder, name = os.path.split(smollm2_gguf)
    # (transformers builds gguf's tensor-name table once a submodule, 397 times here, 5 s of its load;
    # the table is a function of its arguments only, so it is built once)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                                dtype=torch.float32).eval()
    return ref, smol_llm


def _prompt_ids(llm, case):
    if isinstance(case, str):
        return llm.tokenizer.encode(case)
    return llm.tokenizer.encode(llm.apply_chat_template(case), add_bos=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", PROMPTS + CHATS, ids=[f"p{i}" for i in range(len(PROMPTS))]
                         + [f"chat{i}" for i in range(len(CHATS))])
def test_greedy_tokens_match_transformers(models, case):
    ref, llm = models
    ids = _prompt_ids(llm, case)
    if case is LONG:
        assert len(ids) >= 280
    llm.generator.reset()
    got = list(llm.stream_ids(ids, max_new_tokens=32, temperature=0.0, stop_ids=()))
    # transformers' greedy choice after the prompt and each of our tokens, in one forward: equal to
    # ours at every position, it is the sequence transformers' own greedy decoding makes
    with torch.no_grad():
        expected = ref(torch.tensor([ids + got])).logits[0, len(ids) - 1:-1].argmax(-1).tolist()
    assert got == expected


def test_prompt_logits_match_transformers(models):
    ref, llm = models
    ids = torch.tensor([llm.tokenizer.encode(LONG)])
    with torch.no_grad():
        expected = ref(ids).logits
        llm.generator.reset()
        got = llm.model(ids, torch.arange(ids.shape[1]), kv_len=ids.shape[1])
    assert (got - expected).abs().max().item() <= 1e-3
