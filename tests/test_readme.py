"""Every `brisk ...` command README.md shows runs, so that the README cannot
drift from the code: each indented command line is read from README.md and
run as a user would, in a fresh folder, on the bundled model (a private
cache holding it), a tiny Hugging Face model where the README names a folder,
and a fake hub cache (tests/test_hub.py's layout) for repo ids; no network.

Only what makes a command slow is changed: fewer new tokens, benchmark
samples and scored tokens, a free port; and each is forked from a process
that imported brisklm once (tests/forked_brisk.py), not started cold. Commands this machine cannot run are
skipped for the reasons in SKIPPED; the first command (`pip install ... &&
brisk generate ...`) is CI's smoke step (.ci/run), run verbatim in a fresh
environment."""
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

import pytest

import forked_brisk
from test_hub import add_snapshot, build_fake_hub

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A command containing the key is not run here, for the reason given.
SKIPPED = {
    "--device cuda": "needs a CUDA GPU (tests/test_gpu.py runs the GPU paths on one)",
    "--tasks hellaswag": "a registered lm-eval task downloads its data from the Hugging Face Hub",
}
OFFLINE = {  # needs the network: run offline, where it must fail in one error line
    "brisk download meta-llama/": "cannot download",
}
WRITES = ("--json", "--plot", "--markdown", "--output", "--output_path")  # flags naming a file the command writes
# Repo ids the README shows, held by the fake hub cache: the tiny model stands in
STAND_INS = ("HuggingFaceTB/SmolLM2-135M-Instruct",)
TASK = ("task: my_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: my_task.jsonl\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: choices\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")
QUESTIONS = ('{"question": "What is the capital of France?", "choices": [" Paris", " Berlin"], "answer": 0}\n'
             '{"question": "How many legs does a spider have?", "choices": [" six", " eight"], "answer": 1}\n')


def readme_commands() -> list[str]:
    """The indented `brisk ...` lines of README.md, continued lines joined."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        lines = f.read().replace("\\\n", " ").splitlines()
    return [line.strip() for line in lines if line.startswith("    brisk ")]


def quicker(argv: list[str]) -> list[str]:
    """argv with what makes it slow on 2 CPU cores capped."""
    def capped(flag, value, *aliases):
        for name in (flag, *aliases):
            if name in argv:
                i = argv.index(name)
                return argv[:i] + [flag, value] + argv[i + 2:]
        return argv + [flag, value]
    command = argv[1]
    if command in ("generate", "chat"):
        argv = capped("--max_new_tokens", "8")
    elif command == "bench":
        argv = capped("--new_tokens", "8", "--max_new_tokens")
        for flag, value in (("--samples", "1"), ("--prefill", "16"), ("--context", "32")):
            argv = capped(flag, value)
    elif command == "eval" and "--tasks" not in argv:
        argv = capped("--max_tokens", "256")
    elif command == "serve":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            argv = capped("--port", str(s.getsockname()[1]))
    return argv


@pytest.fixture(scope="module")
def places(tmp_path_factory, smollm2_gguf):
    """Environment and placeholder paths: a private brisk cache holding the
    bundled model, a fake hub cache, a tiny Hugging Face folder."""
    root = tmp_path_factory.mktemp("readme")
    cache = root / "brisk-cache"
    cache.mkdir()
    os.symlink(os.path.abspath(smollm2_gguf), cache / "SmolLM2-135M-Instruct.Q4_1.gguf")
    build_fake_hub(root / "hub", smollm2_gguf)
    tiny = str(root / "tiny-saved")
    for repo in STAND_INS:
        add_snapshot(root / "hub", repo, {f: os.path.join(tiny, f) for f in os.listdir(tiny)})
    env = {**os.environ, "BRISKLM_CACHE": str(cache), "HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "PIP_NO_INDEX": "1", "PYTHONPATH": REPO}
    env.pop("BRISKLM_DOWNLOAD", None)
    # The README's placeholders -> what stands for them here
    return env, {"path/to/model.gguf": smollm2_gguf, "model.gguf": smollm2_gguf,
                 "path/to/hf-folder": tiny, "hf-folder": tiny}


@pytest.fixture(scope="module")
def saved_bench(places, tmp_path_factory) -> str:
    """A `brisk bench --json` result, for commands that draw saved ones (--from)."""
    path = tmp_path_factory.mktemp("bench") / "result.json"
    done = forked_brisk.run(["bench", "--preset", "smollm2-135m", "--samples", "1", "--new_tokens", "8", "--prefill",
                             "16", "--context", "32", "--json", str(path)], env=places[0], timeout=300)
    assert done.returncode == 0, done.stderr
    return str(path)


def run_readme_command(line, places, cwd, request) -> subprocess.CompletedProcess:
    env, paths = places
    argv = [paths.get(word, word) for word in shlex.split(line, comments=True)]
    args = quicker(argv)[1:]  # (each run as `python -m brisklm ARGS`, forked_brisk's way)
    (cwd / "my_task.yaml").write_text(TASK)
    (cwd / "my_task.jsonl").write_text(QUESTIONS)
    if "--from" in args:
        for name in args[args.index("--from") + 1:]:
            if name.startswith("--"):
                break
            shutil.copyfile(request.getfixturevalue("saved_bench"), cwd / name)
    if args[0] == "serve":
        return serve_until_healthy(args, env, cwd)
    stdin = "Hello\n/exit\n" if args[0] == "chat" else ""
    return forked_brisk.run(args, cwd=cwd, env=env, input=stdin, timeout=600)


def serve_until_healthy(args, env, cwd) -> subprocess.CompletedProcess:
    """`brisk serve`: up until /health answers, then stopped by SIGTERM."""
    port = args[args.index("--port") + 1]
    with forked_brisk.popen(args, cwd=cwd, env=env) as server:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and server.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                time.sleep(0.5)
        else:
            server.kill()
        server.send_signal(signal.SIGTERM)
        out, err = server.communicate(timeout=60)
    return subprocess.CompletedProcess(args, server.returncode, out, err)


def reason_skipped(line: str) -> str | None:
    return next((why for key, why in SKIPPED.items() if key in line), None)


def test_the_readme_shows_commands_and_the_skip_list_names_only_commands_it_shows():
    commands = readme_commands()
    assert len(commands) >= 20 and all(c.startswith("brisk ") for c in commands)
    for key in (*SKIPPED, *OFFLINE, *STAND_INS):
        assert any(key in c for c in commands), f"{key!r}: no README command has it; drop it from the list"


@pytest.mark.slow
@pytest.mark.parametrize("line", readme_commands(), ids=lambda line: line.split("  #")[0].strip())
def test_the_readme_command_runs(line, places, tmp_path, request):
    why = reason_skipped(line)
    if why:
        pytest.skip(why)
    done = run_readme_command(line, places, tmp_path, request)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    offline = next((msg for key, msg in OFFLINE.items() if key in line), None)
    if offline:
        last = done.stderr.strip().splitlines()[-1]
        assert done.returncode == 2 and last.startswith("error: ") and offline in last, done.stderr
        return
    assert done.returncode == 0, done.stderr[-3000:]
    argv = shlex.split(line, comments=True)
    for flag in WRITES:
        if flag in argv:
            assert (tmp_path / argv[argv.index(flag) + 1]).exists(), f"{flag}: nothing written"
