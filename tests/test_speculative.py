"""Speculative decoding (speculative.py): greedy output token for token the
plain output, for every drafter and draft length; sampled output distributed
as plain sampling's."""
import dataclasses
import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from brisklm.generate import Generator
from brisklm.steps import forward
from brisklm.model import ModelArgs, build_model, random_state_dict
from brisklm.sampling import SamplingParams, logits_to_probs
from brisklm.speculative import (CANDIDATES, CONTEXTS, DraftPolicy, ModelDrafter, NgramDrafter, agreement,
                                 StepCosts, likeliest)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ModelArgs(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                 num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
GREEDY = SamplingParams()
# Repetitive prompts give prompt lookup something to find; the model, fed its own output, repeats too.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3, 4, 5, 9, 9, 1, 2, 3], [3]]
# The compile tests' model and cache length are test_generate's (2 layers, 64 positions): the
# graphs and kernels they share come from inductor's cache instead of compiling again.
COMPILED, COMPILED_LENGTH = dataclasses.replace(TINY, num_hidden_layers=2), 64


def tiny_model(seed=0, args=TINY):
    return build_model(args, random_state_dict(args, torch.float32, seed=seed, std=0.3))


def drafters(target, kind, args=TINY, length=128):
    if kind == "ngram":
        return NgramDrafter()
    if kind == "self":
        return ModelDrafter(target, depth=1)
    draft = tiny_model(seed=7, args=args)  # a different model sharing the vocabulary
    draft.setup_caches(1, length)
    return ModelDrafter(draft)


@pytest.mark.parametrize("kind", ["ngram", "self", "model"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculative_output_is_the_plain_greedy_output(kind, k):
    target = tiny_model()
    plain, spec = Generator(target, 128), Generator(tiny_model(), 128)
    drafter = drafters(spec.model, kind)
    steps = 0
    for prompt in PROMPTS:
        want = list(plain.tokens(prompt, 40, GREEDY))
        got = list(spec.tokens(prompt, 40, GREEDY, drafter=drafter, draft_tokens=k, adapt_drafts=False))
        assert got == want, (kind, k, prompt)
        steps += spec.stats.target_steps
        assert spec.stats.new_tokens == 40 and spec.stats.target_steps <= 39
    if kind != "model":  # drafts that the target accepts: fewer target forwards than tokens
        assert steps < 3 * 39, steps


@pytest.mark.parametrize("kind", ["ngram", "self", "model"])
def test_padded_verify_and_draft_steps_give_the_plain_greedy_output(kind):
    """The padding a CUDA graph's verify and draft steps use (Generator.logits),
    run here without a graph: each step's padding writes keys past its tokens,
    which later steps overwrite before reading; a draft model's cache too."""
    plain, spec = Generator(tiny_model(), 128), Generator(tiny_model(), 128)
    rows = []  # (on CUDA both are replayed)
    spec.steps.graphed_forward = lambda model, idx, *a, **k: rows.append(idx.shape[1]) or forward(model, idx, *a, **k)
    spec.steps.graphed_prefill = spec.steps._prefill
    drafter = drafters(spec.model, kind)
    for prompt in PROMPTS:
        want = list(plain.tokens(prompt, 40, GREEDY))
        got = list(spec.tokens(prompt, 40, GREEDY, drafter=drafter, draft_tokens=5, adapt_drafts=False))
        assert got == want, (kind, prompt)
    assert 16 in rows and set(rows) <= {1, 16}, set(rows)  # verify steps padded to 16 rows, drafts 1


def test_a_stop_token_inside_an_accepted_run_ends_the_output_there():
    target = tiny_model()
    free = list(Generator(target, 128).tokens(PROMPTS[0], 40, GREEDY))
    stop = free[20]
    spec = Generator(target, 128)
    got = list(spec.tokens(PROMPTS[0], 40, GREEDY, stop_ids=[stop], drafter=NgramDrafter(), draft_tokens=8))
    assert got == free[:free.index(stop) + 1]
    follow = PROMPTS[0] + got + [1, 2]  # the next turn reuses what the cache holds, no more
    want = list(Generator(target, 128).tokens(follow, 10, GREEDY))
    assert list(spec.tokens(follow, 10, GREEDY, drafter=NgramDrafter())) == want
    assert spec.stats.reused_tokens == len(follow) - 3


def test_speculation_with_an_int8_kv_cache_equals_plain_decoding_with_it():
    plain = Generator(tiny_model(), 128, kv_int8=True)
    spec = Generator(tiny_model(), 128, kv_int8=True)
    for kind in ("ngram", "self"):
        want = list(plain.tokens(PROMPTS[0], 30, GREEDY))
        assert list(spec.tokens(PROMPTS[0], 30, GREEDY, drafter=drafters(spec.model, kind))) == want


def test_prompt_lookup_drafts_from_the_longest_context_seen_before():
    # "2 3 4 5" (a context of 4) was followed by 9; "3 4 5", seen later, by 7
    assert NgramDrafter().propose([1, 2, 3, 4, 5, 9, 3, 4, 5, 7, 1, 2, 3, 4, 5], 4, GREEDY) == ([9, 3, 4, 5], None)
    assert NgramDrafter().propose([4, 1, 2, 3, 4], 2, GREEDY) == ([1, 2], None)  # only "4" recurs
    assert NgramDrafter().propose([1, 2, 3], 4, GREEDY) == ([], None)


def test_prompt_lookup_drafts_the_continuation_seen_most_often_as_far_as_its_repeats_agreed():
    # "1 2" was followed by 8 twice, then by 7: the latest 8's run, to one past where it left the other 8's
    assert NgramDrafter().propose([1, 2, 8, 5, 1, 2, 8, 6, 1, 2, 7, 0, 1, 2], 3, GREEDY) == ([8, 6], None)
    # "9 8" was followed by "1 2 3 4", then "1 2 5 5": they agreed for two tokens
    assert NgramDrafter().propose([9, 8, 1, 2, 3, 4, 7, 9, 8, 1, 2, 5, 5, 6, 9, 8], 4, GREEDY) == ([1, 2, 5], None)
    assert likeliest([[3, 4, 5]]) == [3, 4, 5]  # a context seen once: all its continuation
    assert likeliest([[3, 4], [6, 4], [7, 4]]) == [3]  # repeats that parted at once: the latest, one token


def scan(history: list[int], end: int, k: int, texts=()) -> list[int]:
    """Prompt lookup by its definition, searching the whole history (and the
    earlier texts, after it) for the latest CANDIDATES occurrences of the
    longest context of CONTEXTS' lengths that ends history[:end]."""
    for n in CONTEXTS:
        if n > end:
            continue
        context = history[end - n:end]
        runs = [history[p:min(p + k, end)] for p in range(end - 1, n - 1, -1) if history[p - n:p] == context]
        for text in reversed(texts):
            runs += [text[p:p + k] for p in range(len(text) - 1, n - 1, -1) if text[p - n:p] == context]
        if runs:
            return likeliest(runs[:CANDIDATES])
    return []


def random_text(rng, length, vocab=6):
    text = [rng.randrange(vocab) for _ in range(rng.randrange(1, 5))]
    while len(text) < length:
        text.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 4)))
    return text


def test_prompt_lookup_indexed_as_the_history_grows_finds_what_a_scan_finds():
    rng = random.Random(0)
    drafter = NgramDrafter()
    for run in range(20):
        history = random_text(rng, rng.randrange(1, 5), vocab=rng.choice([3, 6, 20]))
        while len(history) < 80:
            assert drafter.propose(history, 4, GREEDY)[0] == scan(history, len(history), 4), (run, history)
            history.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))


def judged_by_scan(history: list[int], first: int, k: int, texts=(), end=None) -> tuple[int, int]:
    """NgramDrafter.judge by its definition: scan's drafts before each of history[first:end]."""
    judged = kept = 0
    for at in range(first, len(history) if end is None else end):
        drafts = scan(history, at, k, texts)
        right = agreement(drafts, history[at:])
        kept += right
        judged += right + (right < len(drafts) and at + right < len(history))
    return judged, kept


def test_remembering_prompt_lookup_drafts_and_judges_from_earlier_runs_as_a_scan_of_them_does():
    """Each run's history is a new text, or (a chat's next turn) the last one
    continued; it grows by drafting steps and by runs of plain steps that
    are judged. The earlier texts are looked up after the current one (a
    run's last tokens, after its last lookup, too)."""
    rng = random.Random(1)
    drafter, texts = NgramDrafter(remember=True), []
    for run in range(40):
        if texts and rng.random() < 0.3:  # the last text and more, kept as one text
            history = texts.pop() + random_text(rng, 3)
        else:
            history = random_text(rng, rng.randrange(1, 8), vocab=8)
        for step in range(rng.randrange(1, 8)):
            if rng.random() < 0.5:
                assert drafter.propose(history, 4, GREEDY)[0] == scan(history, len(history), 4, texts), (run, history)
                history.append(rng.randrange(8))
            else:
                first = len(history)
                history += random_text(rng, rng.randrange(1, 6), vocab=8)
                assert drafter.judge(history, first, 4) == judged_by_scan(history, first, 4, texts), (run, history)
        texts.append(history)
    assert not NgramDrafter().propose([7, 1], 2, GREEDY)[0]
    assert drafter.propose([7, 1, *texts[-1][:3]], 2, GREEDY)[0]


def test_judging_as_tokens_come_judges_each_position_once_k_tokens_follow_it():
    """A plain run's judging (Generator._judged_run): the positions up to k
    tokens before the newest, as each token comes, sum to a judging of the
    whole run at its end but for its last k positions."""
    rng = random.Random(2)
    history = random_text(rng, 30, vocab=5)
    first, drafter, judged_to, total = len(history), NgramDrafter(), len(history), [0, 0]
    for _ in range(40):
        history.append(rng.randrange(5))
        if len(history) - 4 > judged_to:
            for i, n in enumerate(drafter.judge(history, judged_to, 4, end=len(history) - 4)):
                total[i] += n
            judged_to = len(history) - 4
    assert tuple(total) == judged_by_scan(history, first, 4, end=len(history) - 4)


def test_a_chat_turn_that_continues_the_last_text_is_indexed_once():
    drafter = NgramDrafter(remember=True)
    turn = [1, 2, 3, 4, 5, 6]
    for _ in range(5):
        drafter.propose(turn, 4, GREEDY)
        turn = turn + [7, 8, 9]
    drafter.propose(turn, 4, GREEDY)
    assert drafter.index.tokens == turn


def test_the_memory_of_earlier_runs_is_bounded():
    drafter, rng = NgramDrafter(remember=True), random.Random(2)
    drafter.MEMORY_TOKENS = 400
    for run in range(60):
        history = random_text(rng, 50, vocab=100)
        drafter.propose(history, 4, GREEDY)
        held = len(drafter.index.tokens) + len(drafter.earlier.tokens if drafter.earlier else [])
        assert held <= drafter.MEMORY_TOKENS + 2 * len(history), (run, held)
    assert drafter.propose(history[:-1] + [history[5]], 4, GREEDY)[0]  # (the current run's text is held)


def test_remembering_prompt_lookup_gives_the_plain_greedy_output_run_after_run():
    """A prompt asked again (a retried or repeated request): its second
    output is drafted from the first, and stays the plain output."""
    plain, spec = Generator(tiny_model(), 128), Generator(tiny_model(), 128)
    drafter, steps = NgramDrafter(remember=True), []
    for prompt in PROMPTS + PROMPTS:
        want = list(plain.tokens(prompt, 40, GREEDY))
        assert list(spec.tokens(prompt, 40, GREEDY, drafter=drafter, draft_tokens=4, adapt_drafts=False)) == want
        steps.append(spec.stats.target_steps)
    assert all(again <= 12 < first for first, again in zip(steps, steps[3:])), steps  # (39 tokens, 4 drafts a step)


def wilson_hilferty(df: int, z: float = 3.09) -> float:
    """The chi-square quantile for p = 0.001 (z = 3.09), by the Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


CHI_ARGS = ModelArgs(vocab_size=12, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
CHI_PROMPT = [*range(12), *range(12)]  # (every token once followed: every first token has a lookup draft)
CHI_PARAMS = SamplingParams(temperature=1.0)


def speculated_pairs(kind: str, n: int, seed: int) -> list[list[int]]:
    """Counts (12 x 12) of the 2nd and 3rd tokens of n sampled generations of
    CHI_PROMPT by the tiny target (seed 3), drafting at every step."""
    target = tiny_model(seed=3, args=CHI_ARGS)
    gen = Generator(target, 64)
    if kind == "ngram":
        drafter = NgramDrafter()
    else:
        draft = tiny_model(seed=9, args=CHI_ARGS)
        draft.setup_caches(1, 64)
        drafter = ModelDrafter(draft)
    counts = torch.zeros(12, 12)
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (steps this small run fastest on one thread)
    try:
        for _ in range(n):
            gen.reset()
            _, t2, t3 = gen.tokens(CHI_PROMPT, 3, CHI_PARAMS, drafter=drafter, draft_tokens=2, adapt_drafts=False)
            counts[t2, t3] += 1
    finally:
        torch.set_num_threads(threads)
    return counts.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ngram", "model"])
def test_sampled_speculative_tokens_follow_the_target_distribution(kind):
    """The 2nd and 3rd sampled tokens (after the prefill's) of a 12-token
    vocabulary, jointly (144 cells), drawn 6000 times with speculation,
    against their exact distribution from the target's own probabilities:
    chi-square at p = 0.001 over the cells expected 5 or more times. Power: a
    shift of 0.02 of probability between two cells of 0.05 is a noncentrality
    of 6000 x 0.016 = 96; with ~140 degrees of freedom the statistic's mean
    moves from 140 to 236 (sd 26) against a bound near 198, so such a bias
    fails about 93% of the time. Prompt lookup (one-hot proposals, accepted
    only where the target agrees) and a draft model (q proper, the residual
    rule) both, drafting at every step (adapt_drafts=False: the policy would
    not draft for the lookup here). Half the draws run in a second process
    (one core each: the steps are single-threaded)."""
    n = 6000
    code = (f"import json, test_speculative as t; "
            f"print(json.dumps(t.speculated_pairs({kind!r}, {n // 2}, seed=1)))")
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
                                  "OMP_NUM_THREADS": "1"})
    counts = torch.tensor(speculated_pairs(kind, n - n // 2, seed=0))
    out, _ = other.communicate(timeout=600)
    assert other.returncode == 0
    counts += torch.tensor(json.loads(out))
    target = tiny_model(seed=3, args=CHI_ARGS)
    prompt, params = CHI_PROMPT, CHI_PARAMS
    with torch.no_grad():  # the exact joint distribution of tokens 2 and 3, given token 1
        target.setup_caches(1, 64)
        first = logits_to_probs(target(torch.tensor([prompt]), torch.arange(len(prompt)))[0, -1], params)
        joint = torch.zeros(12, 12)
        for t1 in range(12):
            for t2 in range(12):
                ids = torch.tensor([prompt + [t1, t2]])
                logits = target(ids, torch.arange(len(prompt) + 2))[0]
                p2, p3 = (logits_to_probs(logits[i], params) for i in (len(prompt), len(prompt) + 1))
                joint[t2] += first[t1] * p2[t2] * p3
    expected = joint * n
    cells = expected >= 5
    chi2 = float(((counts - expected)[cells] ** 2 / expected[cells]).sum())
    df = int(cells.sum()) - 1
    assert chi2 < wilson_hilferty(df), (chi2, df, wilson_hilferty(df))


@pytest.mark.slow
@pytest.mark.parametrize("kind,k", [("ngram", 4), ("self", 2)])
def test_the_real_model_in_fp32_gives_its_plain_greedy_text(smol_llm, kind, k):
    """The bundled SmolLM2 (fp32, dense: the exact path) on a prompt that
    invites copying. In bf16 the two can part after a few dozen tokens: a
    forward over several positions rounds differently from one over one."""
    tok = smol_llm.require_tokenizer()
    ids = tok.encode("Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape. "
                     "Here it is again: apple, banana,")
    gen = smol_llm.generator
    gen.reset()
    want = list(gen.tokens(ids, 40, GREEDY, stop_ids=tok.eos_ids))
    gen.reset()
    drafter = NgramDrafter() if kind == "ngram" else ModelDrafter(gen.model, depth=8)
    got = list(gen.tokens(ids, 40, GREEDY, stop_ids=tok.eos_ids, drafter=drafter, draft_tokens=k,
                          adapt_drafts=False))
    assert got == want
    assert kind != "ngram" or gen.stats.tokens_per_step > 1.5  # the list is copied from the prompt


def test_bad_speculation_settings_are_one_line_errors():
    from brisklm.api import drafter
    from brisklm.errors import BriskError
    model = tiny_model()
    assert drafter(model, None, 4, None) is None
    assert isinstance(drafter(model, "self", 4, None), ModelDrafter)
    for bad, words in (((model, "eagle", 4, None), "unknown speculate 'eagle'"),
                       ((model, "self", 4, 3), "draft_layers must be 1..2 (the model has 3), got 3"),
                       ((model, "ngram", 0, None), "draft_tokens must be 1..16, got 0")):
        with pytest.raises(BriskError) as e:
            drafter(*bad)
        assert words in str(e.value) and "\n" not in str(e.value)


def test_a_draft_model_with_another_vocabulary_is_refused_at_load(tmp_path):
    import brisklm
    from brisklm.checkpoints.native import save_native
    from brisklm.errors import BriskError
    paths = []
    for vocab in (61, 64):
        args = ModelArgs(**{**TINY.to_dict(), "vocab_size": vocab})
        save_native(str(tmp_path / str(vocab)), args, random_state_dict(args, torch.float32), None)
        paths.append(str(tmp_path / str(vocab)))
    llm = brisklm.load(paths[0], device="cpu", speculate="draft", draft_checkpoint_path=paths[0])
    assert isinstance(llm.drafter, ModelDrafter) and llm.drafter.model is llm.draft.model
    with pytest.raises(BriskError) as e:
        brisklm.load(paths[0], device="cpu", speculate="draft", draft_checkpoint_path=paths[1])
    assert "vocabulary (64 tokens) is not the target's (61)" in str(e.value)
    with pytest.raises(BriskError):
        brisklm.load(paths[0], device="cpu", draft_quantize="int8")  # without speculate="draft"


@pytest.mark.slow
def test_the_model_itself_in_int8_drafts_for_it_and_changes_nothing(smollm2_gguf):
    """The gpt-fast recipe: the target's own weights, quantized, as its draft.
    fp32 dense target: greedy output equal to plain decoding's."""
    import brisklm
    llm = brisklm.load(smollm2_gguf, device="cpu", dtype="float32", quantize="none", max_seq_length=512,
                       speculate="draft", draft_quantize="int8", draft_tokens=4)
    prompt = "The three primary colors are"
    spec = llm.generate(prompt, max_new_tokens=24, temperature=0)  # (as many drafts as pay: few, on a CPU)
    ids = llm.tokenizer.encode(prompt)
    always = list(llm.generator.tokens(ids, 24, SamplingParams(), drafter=llm.drafter, draft_tokens=4,
                                       adapt_drafts=False))
    assert llm.stats.tokens_per_step > 2  # int8 agrees with the dense model most of the time
    llm.drafter = None
    assert llm.generate(prompt, max_new_tokens=24, temperature=0) == spec == llm.tokenizer.decode(always)


def run_policy(policy, keep, cost, steps):
    """Drive a policy with drafts each kept with probability `keep` (up to the
    first rejection, seeded) and steps that cost cost(k) seconds. Returns the
    drafts proposed at each step and the tokens per second it came to (plain
    decoding: 1 token a second)."""
    rng = random.Random(0)
    chosen, tokens, seconds = [], 0, 0.0
    while len(chosen) < steps:
        k = policy.choose(room=100)
        if k == 0:  # a run of plain steps, as Generator takes them
            run = min(policy.plain_steps(), steps - len(chosen))
            policy.update(0, 0, run * cost(0), steps=run)
            chosen += [0] * run
            tokens, seconds = tokens + run, seconds + run * cost(0)
            continue
        kept = 0
        while kept < k and rng.random() < keep:
            kept += 1
        policy.update(k, kept, cost(k))
        chosen.append(k)
        tokens, seconds = tokens + kept + 1, seconds + cost(k)
    return chosen, tokens / seconds


def test_the_draft_policy_stops_drafting_where_drafts_are_rejected_and_probes_rarely():
    # A self-draft's cost: each draft a shallow forward (0.3 of a step), the verify a bit more per row.
    chosen, rate = run_policy(DraftPolicy(4), 0.0, lambda k: 1.0 + 0.35 * k, 400)
    first = DraftPolicy.FIRST_LOOK
    assert chosen[:first + 1] == [0] * first + [1]  # (a first look once the run has paid for it)
    probes = sum(k > 0 for k in chosen)
    assert probes <= 6, probes  # 18, 32, 64, 128 steps apart
    assert rate > 0.99, rate  # (plain decoding: 1.0)
    # A probe that costs 2.5 plain steps (a self-draft on SmolLM2, launch-bound
    # on an H200): the next one waits 76 steps, which keep its cost under PROBE_SHARE.
    chosen, rate = run_policy(DraftPolicy(4), 0.0, lambda k: 1.0 + 1.5 * k, 128)
    assert sum(k > 0 for k in chosen) == 1 and rate > 0.98, (chosen, rate)


def test_the_probes_schedule_runs_across_runs():
    """Replies with a drafter whose drafts are never kept (a self-draft whose
    probe costs 2.5 plain steps): a reply of 16 tokens never probes (one that
    started with a probe lost 9% here); longer ones probe only after enough
    plain steps of their own, and as the schedule across replies allows, so
    the probes' cost stays near PROBE_SHARE in each reply."""
    costs = StepCosts()
    for _ in range(20):
        chosen, rate = run_policy(DraftPolicy(4, costs=costs), 0.0, lambda k: 1.0 + 1.5 * k, 16)
        assert chosen == [0] * 16 and rate == 1.0, chosen
    rates, probes = [], 0
    for _ in range(10):
        chosen, rate = run_policy(DraftPolicy(4, costs=costs), 0.0, lambda k: 1.0 + 1.5 * k, 100)
        rates.append(rate)
        probes += sum(k > 0 for k in chosen)
        assert not any(chosen[:DraftPolicy.FIRST_LOOK]), chosen  # (no probe before the run can pay for it)
    assert min(rates) > 0.98 and probes <= 6, (rates, probes)


def test_a_drafter_that_judges_for_free_never_probes_where_drafts_fail_and_drafts_where_they_pass():
    """Prompt lookup's drafts are judged against plain decoding's own tokens
    (NgramDrafter.judge): on text it cannot predict no verify step is spent at
    all; on text it can, drafting starts after the first plain run."""
    costs = {0: 1.0, 1: 1.3, 4: 1.5}  # (measured in an earlier run: a verify step waits for the host)
    policy, chosen = DraftPolicy(4, costs=dict(costs), free_judging=True), []
    while len(chosen) < 400:
        k = policy.choose(room=100)
        assert k == 0
        run = policy.plain_steps()
        policy.update(0, 0, run * 1.0, steps=run)
        policy.observe(judged=run, kept=0)  # every draft wrong
        chosen += [0] * run
    policy = DraftPolicy(4, costs=dict(costs), free_judging=True)
    assert policy.choose(room=100) == 0
    policy.update(0, 0, 8.0, steps=8)
    policy.observe(judged=32, kept=32)  # every draft right
    assert policy.choose(room=100) == 4


def test_prompt_lookup_drafts_on_evidence_not_on_one_lucky_draft():
    """A failed verify costs more than a short reply can lose (a verify is
    2-4 plain steps on a GPU), and judging is free: one kept draft is not
    enough to draft on; a run of them is."""
    policy = DraftPolicy(4, costs={0: 1.0, 1: 2.3, 4: 2.5}, free_judging=True)
    policy.observe(judged=1, kept=1)
    assert not policy.pays(room=100)
    policy.observe(judged=8, kept=8)
    assert policy.pays(room=100)


def test_a_plain_run_left_for_drafting_keeps_the_step_it_had_queued(monkeypatch):
    """Generator._judged_run leaves its plain steps once drafting pays, after
    the step it had queued: that step's token is kept, so every plain step
    run gives a token, and the output is plain decoding's."""
    monkeypatch.setattr(DraftPolicy, "SHORTEST_CONTEXT", 1)  # (the random model repeats no 3 tokens)
    plain, spec = Generator(tiny_model(), 128), Generator(tiny_model(), 128)
    decode, calls = spec.steps.decode, []
    spec.steps.decode = lambda *a, **k: calls.append(1) or decode(*a, **k)
    drafter, drafted = NgramDrafter(), 0
    for prompt in PROMPTS:
        calls.clear()
        want = list(plain.tokens(prompt, 60, GREEDY))
        assert list(spec.tokens(prompt, 60, GREEDY, drafter=drafter)) == want
        stats = spec.stats
        assert len(calls) == stats.target_steps - stats.drafted_steps, (prompt, stats)
        drafted += stats.drafted_steps
    assert drafted


def test_prompt_lookup_judges_its_drafts_as_proposing_them_would():
    history = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 9]
    # from position 4: no proposal, then 4, 4, 4 kept, 3 and a rejection, 2 and one, 1 and one, one
    assert NgramDrafter().judge(history, 4, 4) == (22, 18)
    # from contexts of 3 tokens or more: positions 5 and 6 (after 1 and 1 2) propose nothing
    assert NgramDrafter().judge(history, 4, 4, shortest=3) == (14, 10)


def test_the_adaptive_policy_drafts_from_no_short_context():
    """A draft after one or two matched tokens is kept too seldom to pay: the
    policy's lookups skip them, and so does its judging."""
    history = [7, 1, 2, 3, 4, 5, 8, 2, 3]
    assert NgramDrafter().propose(history, 4, GREEDY)[0] == [4, 5, 8, 2]  # (the 2-token context 2 3)
    assert NgramDrafter().propose(history, 4, GREEDY, shortest=DraftPolicy.SHORTEST_CONTEXT)[0] == []
    assert NgramDrafter().propose(history + [4], 4, GREEDY, shortest=3)[0] == [5, 8, 2, 3]
    calls, drafter = [], NgramDrafter()  # (the generator's policy passes it on to each lookup)
    drafter.propose = lambda *a, **k: calls.append(("propose", k.get("shortest"))) or ([], None)
    drafter.judge = lambda *a, **k: calls.append(("judge", k.get("shortest"))) or (8, 8)
    list(Generator(tiny_model(), 128).tokens(history, 40, GREEDY, drafter=drafter))
    assert {name for name, _ in calls} == {"propose", "judge"}, calls
    assert all(shortest == DraftPolicy.SHORTEST_CONTEXT for _, shortest in calls), calls


def test_drafting_that_promises_less_than_the_margin_is_not_taken():
    """The chance of a kept draft is an estimate: drafting must promise
    MARGIN more tokens a second than plain steps. A draft step costs 1.3
    plain ones: a chance of 0.38 gives 1.06x (not drafted, though it would
    pay if the estimate were exact), 0.5 gives 1.15x."""
    assert DraftPolicy.MARGIN == 0.1
    for chance, drafts in ((0.38, False), (0.5, True)):
        policy = DraftPolicy(1, costs={0: 1.0, 1: 1.3}, free_judging=True)
        policy.observe(judged=1000 - DraftPolicy.DOUBT, kept=round(1000 * chance))  # (kept / (judged + DOUBT))
        assert policy.pays(room=10) == drafts and policy.choose(room=10) == drafts, chance


def test_text_that_copies_pays_for_a_dear_verify():
    """Drafts judged for free, every one kept, two a position (the lookup
    cuts a draft where earlier repeats of its context parted): the chance
    the record gives must climb high enough that 8 drafts pay where a verify
    costs 3.2 plain steps (9 rows on 2 CPU cores). Each judged draft
    discounting the record by 0.85 held it near 0.71 (8 drafts: 3.3 tokens
    for 3.2 steps' cost); by JUDGED_DECAY, 0.83 (4.7 tokens)."""
    policy = DraftPolicy(8, costs={0: 1.0, 8: 3.2}, free_judging=True)
    for _ in range(200):
        policy.observe(judged=2, kept=2)
    assert 0.8 < policy.kept < 0.85
    assert policy.choose(room=100) == 8


def test_drafting_costs_measured_in_a_slowdown_expire():
    """Prompt lookup's drafting costs are kept across runs and measured only
    where it drafts: one measured while the machine was slow must not stop
    drafting for good. Plain steps re-measure the plain cost; after
    STALE_AFTER of them the drafting costs are forgotten, and where the
    judged drafts say drafting pays, it drafts and measures again."""
    costs = StepCosts({0: 1.0, 1: 9.0, 8: 12.0})  # (drafting measured 9-12x a plain step, in a slowdown)
    plain_before, chosen = 0, []
    for _ in range(60):  # replies of 64 tokens, every draft of this text right
        policy = DraftPolicy(8, costs=costs, free_judging=True)
        made = 0
        while made < 64:
            k = policy.choose(room=64 - made)
            if k:
                policy.update(k, k, 1.0 + 0.05 * k)  # (what drafting costs now)
                chosen.append(k)
                made += k + 1
                continue
            run = min(policy.plain_steps(), 64 - made)
            policy.update(0, 0, run * 1.0, steps=run)
            policy.observe(judged=run, kept=run)
            plain_before += 0 if any(chosen) else run
            made += run
    assert DraftPolicy.STALE_AFTER <= plain_before < DraftPolicy.STALE_AFTER + 64, plain_before
    assert max(chosen) == 8 and costs[8] == pytest.approx(1.4), (chosen, dict(costs))  # (fewer near a reply's end)


def test_the_draft_policy_keeps_its_step_costs_across_runs():
    costs = StepCosts()
    run_policy(DraftPolicy(4, costs=costs), 1.0, lambda k: 1.0 + 0.05 * k, 100)
    assert set(costs) == {0, 1, 4}
    chosen, _ = run_policy(DraftPolicy(4, costs=costs), 1.0, lambda k: 1.0 + 0.05 * k, 5)
    assert chosen == [1, 4, 4, 4, 4]  # (no plain step spent measuring again)


def test_untried_drafting_costs_come_from_drafting_steps_and_a_lone_plain_step_is_not_a_queued_one():
    """A verify's fixed cost is in every drafting step and in no plain one:
    four drafts are costed from one draft's step, not on the line through
    the plain step; and a lone plain step (it waits for the host) does not
    replace what queued plain steps cost."""
    policy = DraftPolicy(4, costs={0: 1.0, 1: 2.3})
    assert policy.step_cost(4) == 2.3 and policy.step_cost(3) == 2.3
    policy.cost[2] = 2.5
    assert policy.step_cost(4) == pytest.approx(2.5 + 0.2 * 2) and policy.step_cost(1) == 2.3
    policy.update(0, 0, 3.0, steps=1)
    assert policy.cost[0] == 1.0
    policy.kept_count, policy.judged = 9.0, 10.0  # (0.91 of the drafts kept: four drafts pay)
    assert policy.pays(room=10) and not policy.pays(room=0)


def test_greedy_and_sampled_runs_keep_their_step_costs_apart():
    """A sampled verify reads probabilities the greedy one does not: its
    cost must not stop greedy runs from drafting (or the reverse)."""
    gen, drafter = Generator(tiny_model(), 256), NgramDrafter()
    for params in (GREEDY, SamplingParams(temperature=0.8)):
        gen.reset()
        list(gen.tokens(PROMPTS[0], 40, params, seed=0, drafter=drafter, draft_tokens=4))
    assert set(gen.draft_costs[drafter]) == {True, False}


def test_a_step_slowed_by_a_compile_does_not_keep_the_policy_from_drafting():
    """The first step with a draft can include compiling the draft step (500
    steps' time here): the next normal step's time is the cost again."""
    policy = DraftPolicy(4)
    while policy.choose(room=100) == 0:
        policy.update(0, 0, 1.0 * policy.plain_steps(), steps=policy.plain_steps())
    policy.update(1, 1, 500.0)
    chosen, rate = run_policy(policy, 1.0, lambda k: 1.0 + 0.05 * k, 40)
    assert chosen == [1] + [4] * 39 and rate > 3.5, chosen


def test_the_draft_policy_drafts_as_much_as_pays():
    costs, first = StepCosts(), DraftPolicy.FIRST_LOOK
    chosen, _ = run_policy(DraftPolicy(4, costs=costs), 1.0, lambda k: 1.0 + 0.05 * k, 100)
    assert chosen == [0] * first + [1] + [4] * (99 - first), chosen  # (the first reply looks late)
    chosen, rate = run_policy(DraftPolicy(4, costs=costs), 1.0, lambda k: 1.0 + 0.05 * k, 100)
    assert chosen == [1] + [4] * 99 and rate > 3.8, (chosen, rate)  # (later ones at once)
    hopeful = StepCosts(paying=True)  # (a separate draft model: its first reply looks at once too)
    chosen, _ = run_policy(DraftPolicy(4, costs=hopeful), 1.0, lambda k: 1.0 + 0.05 * k, 20)
    assert chosen[0] == 1 and chosen[-1] == 4, chosen
    # kept 0.6 of the time at a moderate price: one or two drafts pay (1.23x, 1.23x), eight do not (0.64x)
    chosen, rate = run_policy(DraftPolicy(8), 0.6, lambda k: 1.0 + 0.3 * k, 400)
    assert rate > 1.1, rate
    assert sum(k <= 2 for k in chosen[20:]) > 0.9 * len(chosen[20:])


def test_adaptive_speculation_with_rejected_drafts_gives_the_plain_output_with_few_drafts():
    plain, spec = Generator(tiny_model(), 256), Generator(tiny_model(), 256)
    want = list(plain.tokens(PROMPTS[0], 120, GREEDY))
    never = next(t for t in range(TINY.vocab_size) if t not in want)

    class Wrong:  # drafts the target never keeps (a token it does not choose)
        def propose(self, history, k, params, run=None):
            return [never] * k, None

        def kept(self, length):
            pass
    got = list(spec.tokens(PROMPTS[0], 120, GREEDY, drafter=Wrong(), draft_tokens=8))
    assert got == want and spec.stats.target_steps >= 110  # (almost every step without drafts)


@pytest.mark.compile
def test_compiled_verify_and_draft_steps_give_the_plain_greedy_output():
    """Where decoding is compiled, so are the verify step (its rows padded to
    drafts + 1) and the one-token draft steps (Generator.logits), their
    attention reading only the cache blocks their positions see."""
    plain = Generator(tiny_model(args=COMPILED), COMPILED_LENGTH)
    spec = Generator(tiny_model(args=COMPILED), COMPILED_LENGTH, compile=True)
    (whole, compiled), shapes = spec.steps.compiled_functions(), []  # (what the first request switches to)
    spec.steps.compiled_whole = whole, lambda model, idx, *a, **k: shapes.append(
        (model is spec.model, idx.shape[1])) or compiled(model, idx, *a, **k)
    for kind in ("ngram", "self", "model"):
        drafter = drafters(spec.model, kind, COMPILED, COMPILED_LENGTH)
        for prompt in PROMPTS[:2]:
            want = list(plain.tokens(prompt, 40, GREEDY))
            got = list(spec.tokens(prompt, 40, GREEDY, drafter=drafter, draft_tokens=3, adapt_drafts=False))
            assert got == want, (kind, prompt)
    # verify steps of 4 rows, the target's own one-token drafts (self) and the draft model's
    assert {(True, 4), (True, 1), (False, 1)} <= set(shapes)


@pytest.mark.compile
def test_compiled_verify_steps_see_only_a_sliding_window():
    """A sliding-window model (Mistral's, Gemma's local layers), positions past
    the first block of the verify step's mask: the blocks before the first
    query's window are left out (model.rows_block_mask), the rest masked."""
    args = dataclasses.replace(COMPILED, sliding_window=24)
    plain, spec = Generator(tiny_model(args=args), 256), Generator(tiny_model(args=args), 256, compile=True)
    prompt = [5, 6, 7, 8, 9, 10, 11] * 25  # 175 tokens: the window's start passes block 0
    want = list(plain.tokens(prompt, 40, GREEDY))
    assert list(spec.tokens(prompt, 40, GREEDY, drafter=NgramDrafter(), draft_tokens=4, adapt_drafts=False)) == want
    assert spec.stats.target_steps < 39


@pytest.mark.compile
def test_steps_without_drafts_take_the_compiled_decode_step_and_change_nothing():
    plain = Generator(tiny_model(args=COMPILED), COMPILED_LENGTH)
    spec = Generator(tiny_model(args=COMPILED), COMPILED_LENGTH, compile=True)
    for prompt in PROMPTS:  # (prompt lookup finds nothing in [3]: steps without drafts)
        want = list(plain.tokens(prompt, 30, GREEDY))
        assert list(spec.tokens(prompt, 30, GREEDY, drafter=NgramDrafter(), draft_tokens=4)) == want, prompt


@pytest.mark.compile
def test_warm_up_compiles_the_speculative_steps_before_generation():
    """LLM.warm_up compiles the verify step and the draft step too (with the
    grad mode generation runs them in): generating afterwards compiles nothing."""
    from torch._dynamo.utils import counters
    from brisklm.api import LLM
    llm = LLM(tiny_model(args=COMPILED), None, max_seq_length=COMPILED_LENGTH, compile=True, speculate="self",
              draft_tokens=3, draft_layers=1)
    llm.warm_up(PROMPTS[0])
    llm.wait_compiled()  # (compiled on another thread meanwhile)
    assert llm.generator.steps.to_compile == "whole"  # (waited for, on a CPU: the faster step)
    compiled = counters["stats"]["unique_graphs"]
    plain = list(Generator(tiny_model(args=COMPILED), COMPILED_LENGTH).tokens(PROMPTS[0], 30, GREEDY))
    assert list(llm.stream_ids(PROMPTS[0], 30, stop_ids=())) == plain
    assert counters["stats"]["unique_graphs"] == compiled


@pytest.mark.compile
def test_speculation_while_the_step_compiles_on_another_thread_and_after_the_switch():
    """Warmed up without waiting (brisk chat and serve): speculative requests
    run eager while the steps compile on another thread, and compiled after
    the switch, the verify and draft steps included (compiled with the rest,
    nothing compiles at a request); greedy gives plain decoding's tokens."""
    from torch._dynamo.utils import counters
    from brisklm.api import LLM
    llm = LLM(tiny_model(args=COMPILED), None, max_seq_length=COMPILED_LENGTH, compile=True, speculate="self",
              draft_tokens=3, draft_layers=1)
    llm.warm_up(PROMPTS[0], wait=False)
    plain = list(Generator(tiny_model(args=COMPILED), COMPILED_LENGTH).tokens(PROMPTS[0], 30, GREEDY))
    assert list(llm.stream_ids(PROMPTS[0], 30, stop_ids=())) == plain  # (compiling, or switched: the same)
    llm.wait_compiled()
    assert llm.generator.steps.rows is not None and not llm.generator.steps.compiling
    assert llm.generator.steps.to_compile == "block"  # (each layer from the compiled block)
    compiled = counters["stats"]["unique_graphs"]
    assert list(llm.stream_ids(PROMPTS[0], 30, stop_ids=())) == plain
    assert counters["stats"]["unique_graphs"] == compiled


@pytest.mark.compile
def test_the_compiled_verify_and_draft_steps_in_bf16_give_the_eager_logits():
    """bf16 (the default dtype), where inductor's CPU flex attention takes its
    C++ template (which failed to compile a one-token step's mask with no
    full blocks listed): the compiled steps' logits against the eager
    forward's over the same tokens."""
    args = ModelArgs(**{**TINY.to_dict(), "head_dim": 64})
    model = build_model(args, random_state_dict(args, torch.bfloat16, seed=0, std=0.3))
    gen = Generator(model, 1024, compile=True)  # (several blocks of the mask)
    gen.steps.verify_rows = 5
    ids = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    with torch.no_grad():
        gen.logits(ids[:6], 0)  # (prefix keys and values in the cache)
        got = gen.logits(ids[6:9], 6)[0].float()  # a verify step's rows
        want = forward(model, torch.tensor([ids[:9]]), torch.arange(9), kv_len=9)[0, 6:9].float()
        assert ((got - want).norm() / want.norm()).item() < 2e-2
        got = gen.logits(ids[9:10], 9, last=0, depth=2)[0, 0].float()  # a self-draft's one-token step
        want = forward(model, torch.tensor([ids[9:10]]), torch.tensor([9]), kv_len=10, depth=2)[0, 0].float()
        assert ((got - want).norm() / want.norm()).item() < 2e-2


def test_a_drafter_that_cannot_be_a_weak_key_still_speculates():
    """The generator keeps step costs by drafter; one it cannot key (an
    unhashable dataclass) is measured afresh each run, and drafts as any."""
    @dataclasses.dataclass
    class Lookup:
        inner: NgramDrafter = dataclasses.field(default_factory=NgramDrafter)

        def propose(self, *args, **kwargs):
            return self.inner.propose(*args, **kwargs)

        def kept(self, length):
            self.inner.kept(length)

    want = list(Generator(tiny_model(), 256).tokens(PROMPTS[0], 40, GREEDY))
    spec = Generator(tiny_model(), 256)
    assert list(spec.tokens(PROMPTS[0], 40, GREEDY, drafter=Lookup())) == want
    assert not spec.draft_costs


def test_lookup_bound_counts_the_longest_agreeing_continuation():
    """benchmarks/lookup_bound.py's oracle: a reply that copies the prompt
    after its first token is drafted whole (up to the drafts a step), and one
    that never repeats a token keeps nothing."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "lookup_bound.py"
    spec = importlib.util.spec_from_file_location("lookup_bound", path)
    bound = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bound)
    prompt, reply = [7, 1, 2, 3, 4, 5, 9], [1, 2, 3, 4, 5, 9]
    assert bound.tokens_a_step(prompt, reply, drafts=8) == 3.0  # (1 alone, then 2..9 drafted after it)
    assert bound.tokens_a_step(prompt, reply, drafts=2) == 2.0  # (1; 2, 3, 4; 5, 9)
    assert bound.tokens_a_step([1, 2], [3, 4, 5], drafts=8) == 1.0
