"""`brisk chat` in a terminal: driven through a pseudo-terminal as a user
types (readline, Ctrl-C, pastes), on the bundled SmolLM2. Each chat is a
process of its own, with the terminal as its controlling one (forked from
one that imported brisklm: tests/forked_brisk.py)."""
import fcntl
import json
import os
import pty
import re
import struct
import termios
import threading
import time

import pytest

import forked_brisk
from brisklm.checkpoints import read_tokenizer

ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z~]|\x1b[=>]|\r")
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"  # what a terminal wraps a paste in (bracketed paste)
UP = "\x1b[A"


class Terminal:
    """`brisk chat ...` on a pseudo-terminal of 40x120, its output gathered as it comes."""

    def __init__(self, *flags, cache):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        env = {**os.environ, "TERM": "xterm", "BRISKLM_CACHE": str(cache)}
        # (its controlling terminal: Ctrl-C on it sends SIGINT, as in a shell)
        # (uncompiled: the terminal's handling is tested here, the compile beside it in test_cli and test_first_run)
        self.proc = forked_brisk.popen(["chat", *flags, "--no_compile"], env=env, terminal=slave)
        os.close(slave)
        self.master, self.raw, self.seen = master, bytearray(), 0
        threading.Thread(target=self._gather, daemon=True).start()

    def _gather(self):
        while True:
            try:
                data = os.read(self.master, 1 << 16)
            except OSError:  # (the child closed the terminal)
                return
            if not data:
                return
            self.raw.extend(data)

    def text(self) -> str:
        return ESCAPES.sub("", bytes(self.raw).decode(errors="replace"))

    def expect(self, pattern: str, timeout: float = 180) -> re.Match:
        """The first match of pattern in the output after the previous match."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.compile(pattern).search(self.text(), self.seen)
            if found:
                self.seen = found.end()
                return found
            if self.proc.poll() is not None:
                time.sleep(0.2)  # (the last output may still be on its way)
                found = re.compile(pattern).search(self.text(), self.seen)
                if found:
                    self.seen = found.end()
                    return found
                raise AssertionError(f"exited {self.proc.returncode} before {pattern!r}:\n{self.text()[-3000:]}")
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in {timeout} s:\n{self.text()[-3000:]}")

    def type(self, keys: str):
        data = keys.encode()
        while data:  # (a full terminal buffer takes part of a long paste at a time)
            data = data[os.write(self.master, data):]

    def prompt(self):
        self.expect(r"(?m)^> ")

    def leave(self) -> int:
        self.type("\x04")
        return self.proc.wait(60)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


@pytest.fixture
def chat(smollm2_gguf, tmp_path):
    """Start `brisk chat` on the bundled model; wait for its first prompt."""
    started = []

    def start(*flags):
        term = Terminal("--checkpoint_path", smollm2_gguf, "--max_seq_length", "512", "--temperature", "0",
                        "--max_new_tokens", "24", *flags, cache=tmp_path)
        started.append(term)
        term.expect("Chat with the model")
        term.prompt()
        return term
    yield start
    for term in started:
        term.kill()


def prompt_tokens(term) -> int:
    return int(term.expect(r"makes a prompt of (\d+) tokens").group(1))


def saved(term, path) -> list[dict]:
    term.type(f"/save {path}\r")
    term.expect("Saved")
    term.prompt()
    return json.loads(path.read_text())


@pytest.mark.slow
def test_a_paste_longer_than_the_terminals_line_limit_arrives_whole(chat, smollm2_gguf):
    """The terminal's own line editing keeps 4,095 characters of a line;
    readline reads every key. A 512-token cache refuses each message, saying
    how many tokens it made: all of them, or the cut is seen."""
    tok = read_tokenizer(smollm2_gguf)
    words = " ".join(f"word{i}" for i in range(1400))  # (8,889 characters: more than twice the limit)
    assert len(words) > 8000
    term = chat()
    term.type(words + "\r")
    seen = prompt_tokens(term)
    assert len(tok.encode(words)) <= seen < len(tok.encode(words)) + 32  # (+ the chat template's own tokens)
    term.prompt()
    # a bracketed paste of several lines is one message, newlines and all
    lines = "\n".join(words[i:i + 100] for i in range(0, len(words), 100))
    term.type(PASTE_START + lines + PASTE_END + "\r")
    assert len(tok.encode(lines)) <= prompt_tokens(term) < len(tok.encode(lines)) + 32
    term.prompt()
    # and so is a block between triple quotes, typed (or pasted) line by line
    term.type('"""' + "\r")
    for line in lines.splitlines():
        term.expect(r"\.\.\. ")
        term.type(line + "\r")
    term.type('"""' + "\r")
    assert len(tok.encode(lines)) <= prompt_tokens(term) < len(tok.encode(lines)) + 32
    term.prompt()
    assert term.leave() == 0
    assert term.text().count("makes a prompt of") == 3


@pytest.mark.slow
def test_ctrl_c_stops_the_reply_and_the_conversation_goes_on(chat, tmp_path):
    term = chat("--max_new_tokens", "400", "--dtype", "float32")
    term.type("Write a long story about a dragon who learns to cook.\r")
    term.expect(r"cook\.\n(.|\n){40}")  # (the reply has begun)
    term.type("\x03")
    term.expect(r"\[stopped after \d+ tokens")
    term.prompt()
    term.type("What is the capital of France?\r")
    term.expect(r"prompt tokens from the cache\]")
    term.prompt()
    messages = saved(term, tmp_path / "talk.json")
    # as ollama: the stopped reply is left out, its question stays
    assert [m["role"] for m in messages] == ["user", "user", "assistant"]
    assert "Paris" in messages[2]["content"]
    assert term.leave() == 0


@pytest.mark.slow
def test_ctrl_c_twice_at_an_empty_prompt_leaves(chat):
    term = chat()
    term.type("half a thought")
    term.expect("half a thought")
    term.type("\x03")  # (drops the line, as a shell does)
    term.prompt()
    term.type("\x03")
    term.expect("Ctrl-C again or Ctrl-D leaves")
    term.type("\x03")
    assert term.proc.wait(60) == 0


@pytest.mark.slow
def test_help_and_unknown_commands_answer_without_reaching_the_model(chat):
    term = chat()
    term.type("/help\r")
    for command in ("/reset", "/system TEXT", "/save FILE", "/exit"):
        term.expect(re.escape(command))
    term.prompt()
    term.type("/frobnicate now\r")
    term.expect(r"Unknown command /frobnicate\. Commands: /help, /reset, /system TEXT, /save FILE, /exit")
    term.prompt()
    term.type(UP + UP + "\r")  # readline's history: /help again
    term.expect("/save FILE")
    term.prompt()
    assert term.leave() == 0
    assert "tokens/s" not in term.text()


@pytest.mark.slow
def test_reset_confirms_and_starts_over(chat, tmp_path):
    term = chat("--system", "Answer in one short sentence.")
    term.type("My name is Ada.\r")
    term.expect(r"prompt tokens from the cache\]")
    term.prompt()
    term.type("/reset\r")
    term.expect("Started over: the conversation is cleared")
    term.prompt()
    assert saved(term, tmp_path / "talk.json") == [{"role": "system", "content": "Answer in one short sentence."}]
    assert term.leave() == 0


@pytest.mark.slow
def test_save_writes_the_conversation_as_json_messages(chat, tmp_path):
    term = chat()
    term.type("What is the capital of France?\r")
    term.expect(r"prompt tokens from the cache\]")
    term.prompt()
    messages = saved(term, tmp_path / "talk.json")
    assert messages[0] == {"role": "user", "content": "What is the capital of France?"}
    assert messages[1]["role"] == "assistant" and messages[1]["content"].strip()
    assert "Saved 2 messages" in term.text()
    term.type(f"/save {tmp_path}/no/such/folder/talk.json\r")
    term.expect("error: cannot write")  # one line, and the conversation goes on
    term.prompt()
    assert term.leave() == 0


@pytest.mark.slow
def test_system_sets_the_system_message_and_keeps_the_turns(chat, tmp_path):
    term = chat()
    term.type("Hello!\r")
    term.expect(r"prompt tokens from the cache\]")
    term.prompt()
    term.type("/system Answer in French.\r")
    term.expect("Set the system message.")
    term.prompt()
    messages = saved(term, tmp_path / "talk.json")
    assert messages[0] == {"role": "system", "content": "Answer in French."}
    assert [m["role"] for m in messages[1:]] == ["user", "assistant"]
    assert term.leave() == 0
