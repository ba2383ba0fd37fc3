"""What the CLI, the server and load() tell the user on stderr: plain lines,
a counter on terminals, and the compiler's own output kept out of the way."""
from __future__ import annotations

import contextlib
import os
import sys
import time


def progress_bar(done: int, total: int):
    """A one-line counter on a terminal; silent when stderr is a file."""
    if sys.stderr.isatty():
        end = "\n" if done == total else ""
        print(f"\r  {done}/{total}", end=end, file=sys.stderr, flush=True)


def log(message: str, quiet: bool = False):
    if not quiet:
        print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def step(start: str, done: str, quiet: bool = False):
    """A long step as two plain lines, `start...` and `done in N s`, that logs
    and pipes show too (the counter of progress_bar shows on terminals only)."""
    t0 = time.perf_counter()
    log(f"{start}...", quiet)
    yield
    log(f"{done} in {time.perf_counter() - t0:.1f} s", quiet)


@contextlib.contextmanager
def quiet_compiler(warnings_too: bool = True):
    """The compiler's warnings and log lines kept from the user inside this
    block, unless BRISKLM_VERBOSE=1 asks for them. (In a thread beside the
    main one, the compiler's Python warnings are ignored for good: the
    filters are the process's, and restoring them at the block's end would
    undo another thread's changes.)"""
    if os.environ.get("BRISKLM_VERBOSE") == "1":
        yield
        return
    import logging
    import warnings
    loggers = [logging.getLogger(name) for name in ("torch._dynamo", "torch._inductor", "torch.fx")]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        if not warnings_too:
            warnings.filterwarnings("ignore", module=r"torch\.(_dynamo|_inductor|fx)\b")
        with warnings.catch_warnings() if warnings_too else contextlib.nullcontext():
            if warnings_too:
                warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
