"""`brisk chat`: the conversation loop in a terminal.

Behaves as ollama's `run` prompt does: readline's line editing and history,
Ctrl-C stops a reply and returns to the prompt (the partial reply is dropped
from the conversation, the question stays), slash commands answer instead of
reaching the model, and triple quotes open a message of several lines.

Terminal input goes through GNU readline, which reads keys one by one, so a
paste is not cut at the terminal's 4,095-character line limit, and a
bracketed paste (readline's default) arrives whole, newlines included. Piped
input is read line by line. Under tensor parallelism rank 0 reads and every
rank takes the same turns.
"""
from __future__ import annotations

import json
import os
import signal
import sys

from .chat import drop_oldest_turns
from .errors import BriskError

PROMPT, MORE = "> ", "... "
BLOCK = '"""'
HELP = f"""Commands:
  /help           this list
  /reset          start the conversation over (the system message stays)
  /system TEXT    set the system message
  /save FILE      write the conversation to FILE as JSON messages
  /exit           leave (also /quit, /bye, Ctrl-D)
Begin a message with {BLOCK} to write several lines (or to start it with /); end it with {BLOCK}.
Ctrl-C stops a reply (left out of the conversation); Ctrl-C at an empty prompt twice leaves.
Lines edit as in a shell; the up arrow and Ctrl-R recall earlier ones (kept in the cache folder's chat_history)."""
COMMANDS = "/help, /reset, /system TEXT, /save FILE, /exit"
HISTORY_LINES = 1000


def log(message: str):
    print(message, file=sys.stderr, flush=True)


def first_rank() -> bool:
    import torch.distributed as dist
    return not dist.is_initialized() or dist.get_rank() == 0


def shared(read):
    """read()'s value on rank 0, the same on every tensor-parallel rank (whose
    steps must follow the same turns)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return read()
    box = [read() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Reader:
    """The user's messages: from a terminal through readline (editing, history
    in memory and in history_file), else line by line as they come."""

    def __init__(self, history_file: str | None = None):
        self.readline, self.history_file = None, None
        if sys.stdin.isatty() and sys.stdout.isatty():  # (input() uses readline only then)
            try:
                import readline
            except ImportError:  # (no readline: the terminal's own line editing)
                return
            self.readline = readline
            readline.set_auto_history(False)  # (a multi-line block goes in as one entry)
            readline.parse_and_bind("tab: tab-insert")  # (a tab is text here, not file-name completion)
            self.history_file = history_file
            self._load_history()

    def message(self) -> tuple[str, bool] | None:
        """(text, whether it came as a block), or None: the user leaves
        (Ctrl-D, or Ctrl-C twice at an empty prompt)."""
        warned = False
        while True:
            try:
                got = self._message()
            except KeyboardInterrupt:
                typed = self.readline.get_line_buffer() if self.readline else ""
                print(flush=True)
                if typed:  # Ctrl-C drops what was typed, as in a shell
                    warned = False
                    continue
                if warned:
                    return None
                log("(Ctrl-C again or Ctrl-D leaves; /help lists the commands)")
                warned = True
                continue
            if got is not None:
                self._remember(got[0] if not got[1] else f"{BLOCK}{got[0]}{BLOCK}")
            return got

    def _message(self) -> tuple[str, bool] | None:
        line = self._line(PROMPT)
        if line is None or not line.startswith(BLOCK):
            return None if line is None else (line, False)
        parts = [line[len(BLOCK):]]
        while not parts[-1].endswith(BLOCK):
            more = self._line(MORE)
            if more is None:
                return None
            parts.append(more)
        parts[-1] = parts[-1][:-len(BLOCK)]
        text = "\n".join(parts)
        return text.strip("\n"), True

    def _line(self, prompt: str) -> str | None:
        try:
            return input(prompt)
        except EOFError:
            return None

    def _load_history(self):
        if not self.history_file or not os.path.exists(self.history_file):
            return
        try:
            with open(self.history_file, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()[-HISTORY_LINES:]
        except OSError:
            return
        for line in lines:
            self.readline.add_history(line)

    def _remember(self, text: str):
        if self.readline is None or not text.strip():
            return
        self.readline.add_history(text)
        if self.history_file and "\n" not in text:  # (the file holds one entry a line)
            try:
                os.makedirs(os.path.dirname(self.history_file), exist_ok=True)
                fd = os.open(self.history_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                with os.fdopen(fd, "a", encoding="utf-8") as f:
                    f.write(text + "\n")
            except OSError:  # (history is a convenience: a read-only cache folder costs nothing else)
                self.history_file = None


class Stop:
    """SIGINT while a reply streams: the first asks the loop to stop after the
    token in hand (a clean stop: the KV cache holds what was kept); a second,
    e.g. during a long prefill, stops at once."""

    def __init__(self, enabled: bool = True):
        self.enabled, self.asked, self.previous = enabled, False, None

    def __enter__(self):
        if self.enabled:
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self.enabled:  # (None: a handler not set from Python, i.e. the default)
            signal.signal(signal.SIGINT, self.previous if self.previous is not None else signal.SIG_DFL)

    def _handle(self, signum, frame):
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True


class Session:
    """One conversation with an LLM: its messages and the settings of each reply."""

    def __init__(self, llm, system: str | None, max_new_tokens: int, stop=None, seed=None, sampling=None,
                 stoppable: bool = True):
        self.llm, self.system = llm, system
        self.max_new_tokens, self.stop, self.seed, self.sampling = max_new_tokens, stop, seed, sampling or {}
        self.stoppable = stoppable  # (whether Ctrl-C stops a reply rather than the program)
        self.messages = self.start()
        self.told_of_dropping = False

    def start(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def command(self, line: str) -> bool:
        """Run a slash command; False: leave."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name in ("/help", "/?"):
            log(HELP)
        elif name == "/reset":
            self.messages = self.start()
            log("Started over: the conversation is cleared" + (" (the system message stays)." if self.system else "."))
        elif name == "/system":
            if not arg:
                log(f"The system message: {self.system!r}. /system TEXT sets it." if self.system
                    else "No system message. /system TEXT sets one.")
                return True
            self.system = arg
            turns = self.messages[1:] if self.messages and self.messages[0]["role"] == "system" else self.messages
            self.messages = self.start() + turns
            log("Set the system message.")
        elif name == "/save":
            self.save(arg)
        else:
            log(f"Unknown command {name}. Commands: {COMMANDS} (/help says more).")
        return True

    def save(self, path: str):
        if not path:
            log("/save FILE writes the conversation to FILE as JSON messages.")
            return
        if not first_rank():
            return
        try:
            with open(os.path.expanduser(path), "w", encoding="utf-8") as f:
                json.dump(self.messages, f, ensure_ascii=False, indent=2)
                f.write("\n")
        except OSError as e:
            log(f"error: cannot write {path}: {e.strerror or e}")
            return
        log(f"Saved {len(self.messages)} messages to {path}.")

    def turn(self, text: str):
        """Ask, stream the reply to stdout, and keep both in the conversation."""
        llm, capacity = self.llm, self.llm.generator.max_seq_length
        try:  # the oldest turns make room for this one, and a whole reply, in the KV cache
            asked, dropped = drop_oldest_turns(self.messages + [{"role": "user", "content": text}],
                                               lambda m: llm.fits(llm.chat_ids(m), self.max_new_tokens))
            ids = llm.chat_ids(asked)
        except BriskError as e:  # (a chat template that refuses this conversation)
            log(f"error: {e}")
            return
        if len(ids) >= capacity:
            log(f"error: this message makes a prompt of {len(ids)} tokens, more than the KV cache of "
                f"{capacity} holds ({llm.cache_advice()}); it was not sent")
            return
        if dropped and not self.told_of_dropping:
            log(f"(The conversation outgrew the KV cache of {capacity} tokens: its oldest turns are left "
                f"out from now on" + (", the system message kept" if self.system else "") + ".)")
            self.told_of_dropping = True
        reply, interrupt = [], Stop(enabled=self.stoppable)
        with interrupt:
            try:
                pieces = llm.stream_ids_as_text(ids, min(self.max_new_tokens, capacity - len(ids)), self.stop,
                                                seed=self.seed, **self.sampling)
                for piece in pieces:
                    if interrupt.asked:
                        break
                    reply.append(piece)
                    print(piece, end="", flush=True)
                pieces.close()
            except BriskError as e:  # this turn fails; the conversation goes on without it
                print(flush=True)
                log(f"error: {e}")
                return
            except KeyboardInterrupt:
                if not interrupt.enabled:
                    raise
                interrupt.asked = True
        print(flush=True)
        s = llm.stats
        if interrupt.asked:
            # As ollama does: the question stays, the unfinished reply is dropped.
            self.messages = asked
            log(f"[stopped after {s.new_tokens} tokens; the reply is left out of the conversation]")
            return
        self.messages = asked + [{"role": "assistant", "content": "".join(reply)}]
        log(f"[{s.new_tokens} tokens, {s.decode_tokens_per_s:.1f} tokens/s, "
            f"{s.reused_tokens}/{s.prompt_tokens} prompt tokens from the cache]")


def while_waiting(llm, read):
    """read(), while another thread switches to the compiled step once it is
    ready and captures the prefill graphs that LLM.warm_up left
    (LLM.warm_pending; none under torchrun, whose ranks capture together):
    the wait for the user pays for them, and the capture in progress ends
    before read()'s value goes back to be generated from."""
    import threading

    import torch.distributed as dist
    steps = llm.generator.steps
    if dist.is_initialized() or not (steps.pending or steps.compiling):
        return read()
    done = threading.Event()

    def warm():
        try:
            llm.warm_pending(done.is_set)
        except Exception:  # (a graph not captured now is captured at its first use)
            pass

    warmer = threading.Thread(target=warm, daemon=True)
    warmer.start()
    try:
        return read()
    finally:
        done.set()
        warmer.join()


def chat(llm, system: str | None = None, max_new_tokens: int = 512, stop=None, seed=None, sampling=None,
         history_file: str | None = None):
    """Talk with llm until the user leaves."""
    import torch.distributed as dist
    # Under torchrun a terminal's Ctrl-C reaches every rank and the launcher, which ends them all.
    session = Session(llm, system, max_new_tokens, stop, seed, sampling, stoppable=not dist.is_initialized())
    reader = Reader(history_file) if first_rank() else None
    log(f"Chat with the model. /help lists the commands; Ctrl-C stops a reply, Ctrl-D or /exit leaves; "
        f"{BLOCK} begins a message of several lines.")
    while True:
        got = shared(lambda: while_waiting(llm, reader.message) if reader else None)
        if got is None:
            print(file=sys.stderr)
            return
        text, block = got
        if not block and text.strip().startswith("/"):
            if not session.command(text):
                return
        elif text.strip():
            session.turn(text)
