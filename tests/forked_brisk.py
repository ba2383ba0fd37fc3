"""`python -m brisklm ARGS` for the tests, without paying for the imports each
time. A server process imports brisklm's CLI (torch with it) once, then
forks a child for each command it is sent. The child takes the caller's
stdin, stdout and stderr (sent over a Unix socket as file descriptors),
working folder, environment and arguments, and runs brisklm/__main__.py as
`python -m` does; it exits as that process would (atexit, threads joined),
and the server reports its exit status.

The client side, for the tests: run() as subprocess.run, popen() as
subprocess.Popen (the parts the tests use). A command whose environment
changes a setting read when torch or Python start (OMP_NUM_THREADS, ...)
runs as a fresh process instead.

    python tests/forked_brisk.py SOCKET [--without-triton]

--without-triton: `import triton` fails, as on a CPU wheel (set before the
first import, as tests/test_first_run.py does in a fresh process)."""
import atexit
import fcntl
import json
import locale
import os
import random
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import termios
import threading
import time

# Imported once here: what every command imports and whose import reads no
# setting a test varies (triton is left out: TRITON_INTERPRET is read when
# brisklm's kernels are defined).
PRELOADED = ("brisklm.cli", "gguf", "jinja2", "safetensors", "sentencepiece", "tokenizers")


def serve(path: str) -> dict | None:
    """Answer requests until the client goes away; in a forked child, return its request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    parent, running = os.getppid(), {}  # child pid -> the connection that asked for it
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.02)
        if ready:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            while chunk := conn.recv(1 << 16):  # (the client shuts its side once all is sent)
                message += chunk
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in [conn, *running.values()]:
                    other.close()
                return {**json.loads(message), "fds": fds}
            for fd in fds:
                os.close(fd)
            running[pid] = conn
            tell(conn, {"pid": pid})
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = running.pop(pid)
            tell(conn, {"returncode": os.waitstatus_to_exitcode(status)})
            conn.close()
    return None


def tell(conn, message: dict) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:  # (the client stopped waiting)
        pass


def become(request: dict) -> None:
    """This forked child becomes the process the request describes."""
    for fd, target in zip(request["fds"], (0, 1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    if request["terminal"]:  # (its own session, the terminal on fd 0 its controlling one: Ctrl-C reaches it)
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (as a shell's foreground job has it)
    standard_streams()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = os.getcwd()  # (as `python -m` puts it first)
    for entry in reversed(request["env"].get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(1, entry)
    random.seed()  # (a fresh process's own seed, not the parent's)
    sys.argv = ["-m", *request["args"]]


def standard_streams() -> None:
    """sys.stdin, stdout and stderr made anew for fds 0-2, as Python's start-up
    makes them: line-buffered where a terminal is, stderr always."""
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        old = getattr(sys, name)
        new = open(fd, "w" if fd else "r", encoding=old.encoding, errors=old.errors, newline="\n", closefd=False)
        if fd:
            new.reconfigure(line_buffering=fd == 2 or os.isatty(fd))
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)


def main(argv: list[str]) -> None:
    if "--without-triton" in argv:
        sys.modules["triton"] = None
    for name in PRELOADED:
        __import__(name)
    request = serve(argv[0])
    if request is None:
        return
    become(request)
    runpy.run_module("brisklm", run_name="__main__", alter_sys=True)


# --- the client -------------------------------------------------------------------

# Settings read when Python, torch or its libraries start: a command given
# other values than the server started with runs as a fresh process.
READ_AT_START = ("OMP_", "KMP_", "MKL_", "OPENBLAS_", "GOMP_", "TORCH", "PYTORCH_", "TRITON_", "CUDA_", "LD_",
                 "MALLOC_", "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED",
                 "PYTHONIOENCODING", "PYTHONUTF8", "LANG", "LC_")
_servers: dict[bool, "Server"] = {}


class Server:
    def __init__(self, without_triton: bool):
        self.folder = tempfile.mkdtemp(prefix="forked-brisk-")
        self.path = os.path.join(self.folder, "socket")
        self.env = dict(os.environ)
        flags = ["--without-triton"] if without_triton else []
        log = os.path.join(self.folder, "log")
        with open(log, "wb") as f:  # (the server's own output: none, unless it fails to start)
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.path, *flags],
                                         stdin=subprocess.DEVNULL, stdout=f, stderr=f)
        deadline = time.monotonic() + 300
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                with open(log, errors="replace") as f:
                    raise RuntimeError(f"forked_brisk did not start: {f.read()[-3000:]}")
            time.sleep(0.05)

    def close(self):
        self.proc.kill()
        self.proc.wait()
        for name in os.listdir(self.folder):
            os.unlink(os.path.join(self.folder, name))
        os.rmdir(self.folder)

    def takes(self, env: dict) -> bool:
        def start_settings(e):
            return {k: v for k, v in e.items() if k.startswith(READ_AT_START)}
        return start_settings(env) == start_settings(self.env)


def _server(without_triton: bool) -> Server:
    if without_triton not in _servers:
        if not _servers:
            atexit.register(lambda: [server.close() for server in _servers.values()])
        _servers[without_triton] = Server(without_triton)
    return _servers[without_triton]


def popen(args, *, env=None, cwd=None, stdin=None, without_triton=False, terminal=None, output=None):
    """subprocess.Popen([sys.executable, "-m", "brisklm", *args], stdout=PIPE,
    stderr=PIPE, text=True, ...): a forked child, or a fresh process where the
    environment asks for one. terminal: the fd of a pseudo-terminal's slave end,
    which becomes the child's stdin, stdout, stderr and controlling terminal
    (in a session of its own). output: an fd that takes both stdout and stderr
    (Popen's stdout=fd, stderr=STDOUT)."""
    env = dict(os.environ if env is None else env)
    server = _server(without_triton)
    if not server.takes(env):
        code = ["-c", "import sys; sys.modules['triton'] = None; import runpy; "
                      "runpy.run_module('brisklm', run_name='__main__', alter_sys=True)"] if without_triton else []
        streams = dict(stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if output is not None:
            streams.update(stdout=output, stderr=subprocess.STDOUT)
        if terminal is not None:
            streams = dict(stdin=terminal, stdout=terminal, stderr=terminal, start_new_session=True,
                           preexec_fn=foreground)
        return subprocess.Popen([sys.executable, *(code or ["-m", "brisklm"]), *args], env=env, cwd=cwd, **streams)
    return Forked(server, list(args), env, os.path.abspath(cwd or os.getcwd()), stdin, terminal, output)


def foreground():
    """In a child about to run on a pseudo-terminal: the terminal its controlling
    one, and SIGINT's default action, as a shell's foreground job has them (a
    test run in the background, e.g. `pytest &` in a script, ignores SIGINT,
    and a child would inherit that)."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run(args, *, env=None, cwd=None, input=None, stdin=None, timeout=None, without_triton=False):
    """subprocess.run([sys.executable, "-m", "brisklm", *args], capture_output=True, text=True, ...)."""
    proc = popen(args, env=env, cwd=cwd, stdin=subprocess.PIPE if input is not None else stdin,
                 without_triton=without_triton)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess([sys.executable, "-m", "brisklm", *args], proc.returncode, out, err)


class Forked:
    """The part of subprocess.Popen the tests use, for a child of the server."""

    def __init__(self, server, args, env, cwd, stdin, terminal=None, output=None):
        self.args, self.returncode, self.stdin = args, None, None
        self.stdout = self.stderr = None
        fds = [terminal] * 3 if terminal is not None else self._pipes(stdin, output)
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.connect(server.path)
        request = json.dumps({"args": args, "env": env, "cwd": cwd, "terminal": terminal is not None}).encode()
        socket.send_fds(self.conn, [request], fds)
        self.conn.shutdown(socket.SHUT_WR)
        if terminal is None:
            for fd in fds:
                os.close(fd)
        self.replies = b""
        self.pid = self._reply(None)["pid"]

    def _pipes(self, stdin, output=None) -> list[int]:
        """The child's ends of its stdin, stdout and stderr; ours kept as self.stdin, ... (as Popen's);
        with output, the child's stdout and stderr are that fd."""
        if stdin == subprocess.PIPE:
            child_in, ours = os.pipe()
            self.stdin = open(ours, "w")
        elif stdin == subprocess.DEVNULL:
            child_in = os.open(os.devnull, os.O_RDONLY)
        else:  # (inherited, as subprocess does when given none)
            child_in = os.dup(0 if stdin is None else stdin.fileno() if hasattr(stdin, "fileno") else stdin)
        if output is not None:
            return [child_in, os.dup(output), os.dup(output)]
        out, child_out = os.pipe()
        err, child_err = os.pipe()
        self.stdout, self.stderr = open(out, "rb"), open(err, "rb")
        return [child_in, child_out, child_err]

    def _reply(self, timeout):
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.replies:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.conn], [], [], left)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            chunk = self.conn.recv(4096)
            if not chunk:
                raise RuntimeError("forked_brisk's server went away")
            self.replies += chunk
        line, self.replies = self.replies.split(b"\n", 1)
        return json.loads(line)

    def poll(self):
        if self.returncode is None:
            try:
                self.returncode = self._reply(0)["returncode"]
            except subprocess.TimeoutExpired:
                pass
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            self.returncode = self._reply(timeout)["returncode"]
            self.conn.close()
        return self.returncode

    def send_signal(self, sig):
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def communicate(self, input=None, timeout=None):
        """(stdout, stderr) as text, as subprocess's text mode decodes them."""
        read = {}
        readers = [threading.Thread(target=lambda f=f: read.__setitem__(f, f.read()), daemon=True)
                   for f in (self.stdout, self.stderr)]
        for t in readers:
            t.start()
        if self.stdin is not None:
            try:
                if input:
                    self.stdin.write(input)
                self.stdin.close()
            except BrokenPipeError:
                pass
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.stdout.close()
        self.stderr.close()
        return tuple(_text(read[f]) for f in (self.stdout, self.stderr))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in (self.stdin, self.stdout, self.stderr):
            if f is not None and not f.closed:
                f.close()
        self.wait()


def _text(data: bytes) -> str:
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
