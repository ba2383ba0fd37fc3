"""Which prefill graphs a warm-up captures, and that capturing the rest
between turns (warm_pending) leaves a conversation's cache as it was.

CUDA graphs need a GPU; here the graphed prefill is the plain forward that
records the shape each call would replay (the key `steps.replayed` keys its
graphs by), so the shapes and the cache writes are the real ones."""
import os
import subprocess
import sys
import threading

import pytest
import torch

from brisklm.generate import Generator
from brisklm.model import ModelArgs, build_model, random_state_dict
from brisklm.sampling import SamplingParams
from brisklm.steps import forward, planless_attention, prefill_shapes

ARGS = ModelArgs(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=2048)
GREEDY = SamplingParams()


def tiny_model():
    return build_model(ARGS, random_state_dict(ARGS, torch.float32, seed=0, std=0.3))


def recording(steps) -> list:
    """Make steps' graphed prefill the plain forward, noting each call's (shape, first position)."""
    seen = []

    def run(model, ids, pos, kv_len=None, last=None):
        seen.append(((ids.shape[1], kv_len), int(pos[0])))
        return forward(model, ids, pos, kv_len=kv_len, last=last)

    steps.graphed_prefill = run
    return seen


def test_shapes_of_a_prompt_are_those_its_prefill_replays():
    for kernel_tokens in (0, 16):
        gen = Generator(tiny_model(), 1024)
        gen.steps.kernel_tokens = kernel_tokens
        seen = recording(gen.steps)
        for n in (1, 5, 16, 17, 64, 200, 256, 257, 600, 1000):
            seen.clear()
            gen.reset()
            gen.steps.prefill([i % 60 + 1 for i in range(n)], 0, None)
            assert list(dict.fromkeys(shape for shape, _ in seen)) == gen.steps.shapes_of([n]), (kernel_tokens, n)


def test_prompts_the_attention_kernel_takes_whole_replay_the_block_compiled_graphs():
    """Where decoding replays graphs of its own (a GPU with the attention
    kernel, here its flags), a prompt of 1 or 16 rows (no mask: the kernel
    reads the length) replays the block-compiled steps' graphs, for which the
    block compiles too; a longer one, and every row's logits, the uncompiled
    forward's."""
    gen = Generator(tiny_model(), 1024)
    steps, seen = gen.steps, []
    steps.graphed, steps.kernel_tokens = True, 16

    def recorder(name):
        def run(model, ids, pos, kv_len=None, last=None, **more):
            seen.append((name, ids.shape[1], last is not None))
            return forward(model, ids, pos, kv_len=kv_len, last=last, **more)
        return run
    steps.graphed_prefill = steps.graphed_forward = recorder("uncompiled")
    steps.graphed_rows = recorder("block")
    assert steps.maskless_buckets() == [1, 16]
    for n, name in ((1, "block"), (5, "block"), (16, "block"), (17, "uncompiled"), (200, "uncompiled")):
        seen.clear()
        gen.reset()
        steps.prefill([i % 60 + 1 for i in range(n)], 0, None)
        assert {s[0] for s in seen} == {name}, (n, seen)
    seen.clear()
    steps.logits([3] * 10, 0, last=9)
    steps.logits([3] * 10, 20)
    assert seen == [("block", 16, True), ("uncompiled", 16, False)]


def test_warm_up_for_a_prompt_leaves_the_rest_pending():
    gen = Generator(tiny_model(), 512)
    seen = recording(gen.steps)
    gen.steps.warm_up([None], prompts=[300])
    every = prefill_shapes(512)
    assert [shape for shape, _ in seen] == gen.steps.shapes_of([300]) == [(256, 256), (64, 512)]
    assert sorted(gen.steps.pending) == sorted(set(every) - {(256, 256), (64, 512)})
    assert all(first == 512 - bucket for (bucket, _), first in seen)  # the cache's last positions

    seen.clear()
    assert not gen.steps.warm_pending(stop=lambda: len(seen) == 3)
    assert len(seen) == 3 and [s for s, _ in seen] == sorted([s for s, _ in seen], key=lambda s: s[1] or s[0])
    assert not gen.steps.warm_pending(room=20)  # (a bucket of 32 would write where the conversation is)
    assert all(bucket <= 20 for (bucket, _), _ in seen[3:]) and len(gen.steps.pending) > 0
    assert gen.steps.warm_pending() and not gen.steps.pending
    assert sorted({s for s, _ in seen} | {(256, 256), (64, 512)}) == sorted(every)


def test_capturing_between_turns_changes_no_reply():
    """Two turns of a conversation, the second reusing the first's cache,
    give the same tokens with every pending graph captured between them."""
    def conversation(warm_between: bool) -> list[int]:
        gen = Generator(tiny_model(), 512)
        recording(gen.steps)
        gen.steps.warm_up([None], prompts=[])
        first = [3, 1, 4, 1, 5, 9, 2, 6]
        reply = list(gen.tokens(first, 12, GREEDY))
        if warm_between:
            assert gen.steps.warm_pending(room=512 - len(gen.cached))
        second = first + reply + [7, 7, 8, 9, 10]
        more = list(gen.tokens(second, 12, GREEDY))
        assert gen.stats.reused_tokens >= len(first) + len(reply) - 1
        return reply + more

    assert conversation(True) == conversation(False)


def test_chat_captures_while_the_user_types_and_stops_for_the_reply():
    """repl.while_waiting: the pending graphs are captured in another thread
    while read() waits, and the capture stops before read()'s value returns."""
    import threading
    from brisklm.api import LLM
    from brisklm.repl import while_waiting
    llm = LLM(tiny_model(), None, max_seq_length=512)
    seen = recording(llm.generator.steps)
    llm.generator.steps.warm_up([None], prompts=[])
    captured = threading.Event()

    def read():  # (the user types until a graph has been captured)
        assert captured.wait(30) or seen
        return "hello"

    original = llm.generator.steps._capture_prefill
    llm.generator.steps._capture_prefill = lambda *shape: (original(*shape), captured.set())
    assert while_waiting(llm, read) == "hello"
    count = len(seen)
    assert count >= 1 and len(llm.generator.steps.pending) == len(prefill_shapes(512)) - count
    threading.Event().wait(0.2)
    assert len(seen) == count  # (nothing captures after the message is back)


@pytest.mark.compile
def test_requests_run_uncompiled_while_the_step_compiles_on_another_thread(capsys):
    """compile=True on a CPU, as on CUDA: warm_up returns before the compile;
    requests meanwhile run the eager step and give its tokens; a request that
    could reach the cache's last positions (where the compile runs its step)
    waits for it; that one switches, says so on one line, gives the same
    greedy tokens, and no sampling setting or prompt length compiles again.
    The compile draws no random numbers (a seeded request's, beside it)."""
    from torch._dynamo.utils import counters

    from brisklm.api import LLM
    llm = LLM(tiny_model(), None, max_seq_length=64, compile=True)
    steps, held, drawn = llm.generator.steps, threading.Event(), []
    compile_steps = steps._compile

    def compile_held(*given):  # (the requests below surely run uncompiled)
        held.wait()
        drawn.append(torch.get_rng_state())
        compile_steps(*given)
        drawn.append(torch.get_rng_state())

    steps._compile = compile_held
    want = list(Generator(tiny_model(), 64).tokens([1, 2, 3], 8, GREEDY))
    try:
        llm.warm_up(quiet=False, wait=False)
        assert steps.compiling and "compiles on another thread meanwhile" in capsys.readouterr().err
        assert steps.to_compile == "block"  # (on CPUs beside requests: one block, seconds)
        before = counters["stats"]["unique_graphs"]
        assert list(llm.stream_ids([1, 2, 3], 8, stop_ids=())) == want
        assert len(list(llm.stream_ids([5] * 20, 8, stop_ids=(), temperature=0.8, top_p=0.9, seed=1))) == 8
        assert steps.whole is None and counters["stats"]["unique_graphs"] == before
    finally:
        held.set()
    longest = list(llm.stream_ids([1, 2, 3], 61, stop_ids=()))  # (reaches position 63: waits, then switches)
    assert steps.whole is not None and not steps.compiling and longest[:8] == want
    assert torch.equal(*drawn)  # (a request's seed sets these random numbers: the compile draws none of them)
    assert "[the compiled step is ready" in capsys.readouterr().err
    traced = counters["stats"]["unique_graphs"]
    for sampling in (dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=0.8, min_p=0.05)):
        assert len(list(llm.stream_ids(list(range(1, 30)), 6, stop_ids=(), seed=5, **sampling))) == 6
    assert list(llm.stream_ids([1, 2, 3], 8, stop_ids=())) == want
    assert counters["stats"]["unique_graphs"] == traced


def test_the_compile_thread_cannot_rewind_a_requests_random_numbers():
    """The compiler sets the global random state back after each graph it
    compiles; on the compile thread that must be a no-op, else a seeded
    request beside it draws some of its numbers again."""
    from brisklm.steps import COMPILE_THREAD, random_state_left_alone
    random_state_left_alone()
    random_state_left_alone()  # (idempotent: one wrapper)
    torch.manual_seed(7)
    want = torch.rand(4)
    torch.manual_seed(7)
    saved = torch.random.get_rng_state()
    first = torch.rand(2)
    for name, rewinds in ((COMPILE_THREAD, False), ("another", True)):
        thread = threading.Thread(target=torch.random.set_rng_state, args=(saved,), name=name)
        thread.start()
        thread.join()
        if rewinds:
            assert torch.equal(torch.rand(2), want[:2])
        else:
            assert torch.equal(torch.cat([first, torch.rand(2)]), want)


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own niceness is Linux's")
def test_the_compile_thread_yields_the_cores_to_requests():
    """The compile thread (and the C++ compiler it starts) runs at a lower
    priority; the requests' thread keeps its own."""
    from brisklm.steps import COMPILE_NICENESS, yield_the_cores
    seen = {}

    def compile_thread():
        yield_the_cores()
        seen["niceness"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        seen["child"] = int(subprocess.run(["nice"], capture_output=True, text=True).stdout)

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=compile_thread)
    thread.start()
    thread.join()
    assert seen == {"niceness": max(COMPILE_NICENESS, mine), "child": max(COMPILE_NICENESS, mine)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_the_switch_interval_is_short_while_a_compile_runs_beside_graphed_requests():
    """Beside the compile thread (Python tracing that keeps the interpreter's
    lock), a request gets the lock back after each torch call within the
    short interval; outside, the process's own interval is as it was, also
    after a compile that failed."""
    from brisklm.steps import COMPILE_SWITCH_INTERVAL_S, quick_switches
    before = sys.getswitchinterval()
    with quick_switches(False):
        assert sys.getswitchinterval() == before
    with pytest.raises(RuntimeError):
        with quick_switches(True):
            assert sys.getswitchinterval() == pytest.approx(min(before, COMPILE_SWITCH_INTERVAL_S))
            assert sys.getswitchinterval() < before
            raise RuntimeError("the compile failed")
    assert sys.getswitchinterval() == before


@pytest.mark.compile
def test_the_compiled_step_is_switched_to_between_requests():
    """Where the process waits (brisk chat for the user's input, brisk serve
    between requests), the switch to the step compiled on another thread
    happens there, not at the next request's start; a request reaching the
    cache's last positions (which the switch's runs write) reuses no cache there."""
    pytest.importorskip("fastapi")
    from brisklm.api import LLM
    from brisklm.server import make_app
    llm = LLM(tiny_model(), None, max_seq_length=64, compile=True)
    llm.warm_up(prompts=[], wait=False)
    gen = llm.generator
    gen.cached = list(range(1, 64))  # (as if a conversation filled the cache)
    assert gen.steps.compiling and llm.warm_pending() and gen.steps.whole is not None  # (brisk chat's wait)
    assert len(gen.cached) == 64 - gen.steps.reserved

    served = LLM(tiny_model(), None, max_seq_length=64, compile=True)
    served.warm_up(prompts=[], wait=False)
    app = make_app(served, "tiny")
    for _ in range(600):  # (no request: the server's own thread switches once the compile is done)
        if served.generator.steps.whole is not None:
            break
        threading.Event().wait(0.1)
    assert served.generator.steps.whole is not None and not served.generator.steps.compiling
    app.state.engine.closing.set()
    app.state.engine.worker.shutdown()


@pytest.mark.compile
def test_a_request_switches_to_the_compiled_step_between_two_of_its_steps(capsys):
    """A request that started while the block compiled switches to it between
    two of its steps once it is ready (a long one would otherwise decode
    uncompiled to its end), and its greedy tokens are those of a request that
    ran uncompiled throughout; the switch is said at the next request's start."""
    from brisklm.api import LLM
    want = list(LLM(tiny_model(), None, max_seq_length=128).stream_ids([1, 2, 3], 40, stop_ids=()))
    llm = LLM(tiny_model(), None, max_seq_length=128, compile=True)
    llm.warm_up(prompts=[], wait=False)
    steps = llm.generator.steps
    run = llm.stream_ids([1, 2, 3], 40, stop_ids=())
    got = [next(run) for _ in range(5)]
    assert steps.compiling and not steps.adopted
    steps.compiler.join()  # (the request paused between two steps meanwhile)
    got += list(run)
    assert steps.adopted and not steps.compiling
    assert got == want
    llm.quiet = False  # (said at the next request's start, not in the middle of a request's text)
    capsys.readouterr()
    list(llm.stream_ids([1, 2, 3], 2, stop_ids=()))
    list(llm.stream_ids([1, 2, 3], 2, stop_ids=()))
    said = capsys.readouterr().err
    assert said.count("the last request switched to it") == 1, said


@pytest.mark.compile
def test_a_compile_that_failed_beside_a_request_is_said_by_the_next_one(capsys):
    """A compile that failed on its thread is not switched to between a
    request's steps; decoding goes on uncompiled, and the next request's
    start says what failed, once."""
    from brisklm.api import LLM
    from brisklm.steps import CAPTURING
    llm = LLM(tiny_model(), None, max_seq_length=128, compile=True, compile_options={"no_such_option": 1})
    with CAPTURING:  # (the compile's thread waits for it: the request starts first)
        llm.warm_up(prompts=[], wait=False)
        llm.quiet = False
        steps = llm.generator.steps
        run = llm.stream_ids([1, 2, 3], 20, stop_ids=())
        got = [next(run)]
    steps.compiler.join()
    got += list(run)
    assert len(got) == 20 and not steps.adopted and steps.compile_error is not None
    capsys.readouterr()
    assert len(list(llm.stream_ids([1, 2, 3], 4, stop_ids=()))) == 4
    said = capsys.readouterr().err
    assert said.count("compiling the step failed") == 1 and "no_such_option" in said, said
    list(llm.stream_ids([1, 2, 3], 4, stop_ids=()))
    assert "failed" not in capsys.readouterr().err


def test_running_uncompiled_steps_never_imports_the_compiler():
    """Our custom ops exist for the compiler; called outside a trace, an op
    imports torch._dynamo (a second of a warm start), so the uncompiled
    steps call what the op wraps instead. A fresh process: int8 weights
    (whose few-rows matmul is such an op), a prefill and decode steps."""
    import subprocess
    import sys
    program = (
        "import sys, torch\n"
        "from brisklm.generate import Generator\n"
        "from brisklm.model import ModelArgs, build_model, random_state_dict\n"
        "from brisklm.quantize import FORMATS, quantize_state_dict\n"
        "from brisklm.sampling import SamplingParams\n"
        "args = ModelArgs(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,\n"
        "                 num_attention_heads=4, num_key_value_heads=2)\n"
        "args, state = quantize_state_dict(args, random_state_dict(args, torch.float32, seed=0), 'int8')\n"
        "gen = Generator(build_model(args, state, FORMATS), 64)\n"
        "with torch.no_grad():\n"
        "    out = list(gen.tokens([1, 2, 3, 4, 5], 4, SamplingParams()))\n"
        "assert len(out) == 4, out\n"
        "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False", done.stdout


def test_eager_steps_on_cuda_keep_attention_off_cudnn():
    """cuDNN's attention plans each new (queries, keys) shape: the eager step
    (a CUDA MoE prefill past its graphs) runs with it off, and leaves the
    caller's choice as it was."""
    seen = []

    def step(x):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
                     torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()))
        return x + 1

    before = torch.backends.cuda.cudnn_sdp_enabled()
    assert planless_attention(step)(1) == 2
    assert seen == [(False, True, True, True)]
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


@pytest.mark.slow
@pytest.mark.compile
def test_graphed_the_decode_step_is_switched_to_before_the_other_shapes_compile(monkeypatch):
    """Where the steps replay graphs of their own (a GPU's flags here; each
    graph a stand-in that runs its step and keeps its setting, as
    steps.replayed keys them), the decode step's shape compiles alone
    first: the next request switches the decode step to it and starts the
    other shapes' compile (here the prompts the attention kernel takes
    whole), whose graphs stay uncompiled until a later request switches
    them too. Each switch captures again the graphs it changes; every
    stage gives the uncompiled steps' tokens, and nothing compiles after
    the last switch."""
    import brisklm.steps as steps_module
    from torch._dynamo.utils import counters

    def replayed(step):  # (CUDA graphs do not run here)
        def run(*args, **kwargs):
            key = tuple((a.shape, a.dtype) if isinstance(a, torch.Tensor) else a for a in (*args, *kwargs.values()))
            run.graphs.setdefault(key, (None, (args, kwargs), None))
            return step(*args, **kwargs)
        run.graphs, run.step = {}, step
        return run

    monkeypatch.setattr(steps_module, "replayed", replayed)
    reference = Generator(tiny_model(), 256)
    want = {n: list(reference.tokens(list(range(1, n + 1)), 8, GREEDY)) for n in (3, 16)}
    gen = Generator(tiny_model(), 256, compile=True)
    steps = gen.steps
    steps.graphed, steps.kernel_tokens, steps.to_compile = True, 16, "block"
    steps.graphed_forward = steps.graphed_prefill = replayed(forward)
    steps._use_block(None)
    steps.warm_up([None])
    block = lambda graphed: graphed.step.keywords["block"]  # noqa: E731
    held, stages, compile_steps = threading.Event(), [], steps._compile

    def compile_held(shapes, buckets, inside):  # (each stage when the test lets it)
        stages.append(([n for _, n, _ in shapes], buckets))
        held.wait()
        compile_steps(shapes, buckets, inside)

    steps._compile = compile_held
    held.set()
    assert steps.compile_later()
    steps.compiler.join()
    held.clear()  # (the second stage waits: the requests below run the compiled block from Python)
    decode_graphs = set(steps._decode.graphs)
    assert list(gen.tokens([1, 2, 3], 8, GREEDY)) == want[3]
    assert block(steps._decode) is steps.compiled_block and block(steps.graphed_rows) is None
    assert set(steps._decode.graphs) >= decode_graphs  # (captured again with the compiled block)
    assert stages == [([1], []), ([], [1, 16])] and steps.compiling and steps.compile_s is not None
    assert list(gen.tokens(list(range(1, 17)), 8, GREEDY)) == want[16]  # (its graph: still uncompiled)
    held.set()
    steps.compiler.join()
    assert list(gen.tokens([1, 2, 3], 8, GREEDY)) == want[3]
    assert block(steps.graphed_rows) is steps.compiled_block and not steps.compiling and not steps.stages
    traced = counters["stats"]["unique_graphs"]
    assert list(gen.tokens(list(range(1, 17)), 8, GREEDY)) == want[16]
    assert len(list(gen.tokens([5] * 9, 6, SamplingParams(temperature=0.8, top_p=0.9), seed=1))) == 6
    assert counters["stats"]["unique_graphs"] == traced
