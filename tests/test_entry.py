"""The `brisk` command's process: it ends once its output is flushed, and a
reader that leaves early (`| head`) ends it without a traceback."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_a_reader_that_leaves_ends_the_command_quietly(smollm2_gguf):
    proc = subprocess.Popen([sys.executable, "-m", "brisklm", "generate", "--checkpoint_path", smollm2_gguf,
                             "--prompt", "Once upon a time", "--max_new_tokens", "64", "--temperature", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout.read(4) == b"Once"
    proc.stdout.close()  # (as `| head -c 4` does)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, err
    assert "Traceback" not in err and "Sample 1" not in err


@pytest.mark.slow
def test_the_output_is_whole_when_the_process_ends(smollm2_gguf, tmp_path):
    """entry() skips the interpreter's teardown: what was printed reaches a file all the same."""
    out = tmp_path / "out.json"
    with open(out, "w") as f:
        code = subprocess.run([sys.executable, "-m", "brisklm", "generate", "--checkpoint_path", smollm2_gguf,
                               "--prompt", "Hi", "--max_new_tokens", "3", "--json"], stdout=f,
                              stderr=subprocess.PIPE, cwd=ROOT).returncode
    import json
    assert code == 0 and json.loads(out.read_text())["samples"][0]["new_tokens"] == 3
