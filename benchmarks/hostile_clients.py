"""`brisk serve` under attack, on loopback, bounded in time: a storm of
ordinary clients that drop streams, then slowloris headers, idle sockets
past the open-file limit, chunked bodies over the limit and mass
disconnects, while a probe sends one short request every 0.25 s.

    PYTHONPATH=. python3 benchmarks/hostile_clients.py [--checkpoint_path GGUF] [--nofile 1024] [--json out.json]

Prints, per phase: answers >= 500, requests lost (no complete answer where
one was owed), the probe's requests served and their p99 time to the first
streamed byte against the idle figure, the server's RSS and descriptors.
Goal: 0 5xx, 0 lost, probes within 2x their idle time during the attacks
(during a storm they queue behind its requests: one generation at a time),
RSS within 10%.
--nofile sets the server's open-file limit (soft and hard), so that the
idle sockets pass it.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, checkpoint: str | None, nofile: int | None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "brisklm", "serve", "--port", str(self.port), "--queue", "64"]
        cmd += ["--checkpoint_path", checkpoint] if checkpoint else []

        def limit():
            if nofile:
                import resource
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=limit)
        self.output: list[str] = []
        threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True).start()
        for _ in range(600):
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("".join(self.output))
                time.sleep(0.5)
        raise RuntimeError("the server did not start")

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    def descriptors(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


def request(url: str, body: dict, drop_after: int | None = None, timeout=120) -> tuple[int | str, float]:
    """(status or "dropped" / "lost", seconds to the first byte of the answer)."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            first = r.readline()
            ttfb = time.perf_counter() - t0
            if drop_after is not None:
                for _ in range(drop_after):
                    r.readline()
                return "dropped", ttfb
            rest = r.read().decode()
            if body.get("stream") and not rest.rstrip().endswith("[DONE]"):
                return "lost", ttfb
            if not body.get("stream"):
                json.loads(first + rest.encode())
            return r.status, ttfb
    except urllib.error.HTTPError as e:
        return e.code, time.perf_counter() - t0
    except (OSError, ValueError):
        return "lost", time.perf_counter() - t0


class Probe:
    """One short streamed request every `every` seconds, in a thread."""

    def __init__(self, url: str, every=0.25):
        self.url, self.every, self.results, self.stop = url, every, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        body = {"prompt": "Hi", "max_tokens": 2, "stream": True, "temperature": 0}
        while not self.stop.is_set():
            self.results.append(request(self.url, body, timeout=30))
            time.sleep(self.every)

    def take(self) -> list:
        out, self.results = self.results, []
        return out


def storm(url: str, clients: int, per_client: int) -> list:
    def one(i):
        out = []
        for j in range(per_client):
            stream = (i + j) % 2 == 0
            body = {"prompt": f"Story {i}-{j}:", "max_tokens": 16, "stream": stream, "temperature": 0.7, "seed": i}
            drop = 1 if stream and (i + j) % 4 == 0 else None
            out.append(request(url, body, drop_after=drop))
        return out

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return [r for rs in pool.map(one, range(clients)) for r in rs]


def hold_sockets(url: str, count: int, seconds: float, send: bytes = b"", every: float | None = None) -> int:
    """Open up to `count` sockets; each sends `send` a byte at a time every `every` s (slowloris) or
    nothing; hold them `seconds`. Returns how many were opened."""
    host, port = url.split("//")[1].split(":")
    sockets = []
    for _ in range(count):
        try:
            sockets.append(socket.create_connection((host, int(port)), timeout=2))
        except OSError:
            break
    end, at = time.time() + seconds, 0
    while time.time() < end:
        if send and every:
            for s in sockets:
                try:
                    s.send(send[at % len(send):at % len(send) + 1])
                except OSError:
                    pass
            at += 1
            time.sleep(every)
        else:
            time.sleep(0.2)
    for s in sockets:
        s.close()
    return len(sockets)


def oversize(url: str, clients: int, mib: int = 64) -> list:
    host, port = url.split("//")[1].split(":")

    def one(_):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n")
            piece = b"a" * (1 << 20)
            try:
                for _ in range(mib):
                    s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            except OSError:
                pass
            try:
                return int(s.recv(64).split()[1])
            except (OSError, IndexError, ValueError):
                return "closed"

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, range(clients)))


def mass_disconnect(url: str, clients: int) -> list:
    body = {"prompt": "Tell me a story.", "max_tokens": 64, "stream": True, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return list(pool.map(lambda _: request(url, body, drop_after=0), range(clients)))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint_path")
    p.add_argument("--nofile", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--json")
    opts = p.parse_args()
    server = Server(opts.checkpoint_path, opts.nofile)
    probe = Probe(server.url)
    time.sleep(3)
    probe.take()  # (the first requests after the start are slower)
    time.sleep(10)
    idle = [t for status, t in probe.take() if status == 200]
    idle_p99 = statistics.quantiles(idle, n=100)[98] if len(idle) > 2 else max(idle)
    rss0 = server.rss_mb()
    rows = []

    def phase(name, results):
        probes = probe.take()
        served = [t for status, t in probes if status == 200]
        codes = [r[0] if isinstance(r, tuple) else r for r in results]
        row = {"phase": name, "5xx": sum(isinstance(c, int) and c >= 500 for c in codes),
               "lost": codes.count("lost"), "probes_served": f"{len(served)}/{len(probes)}",
               "probe_p99_ms": 1e3 * (statistics.quantiles(served, n=100)[98] if len(served) > 2
                                      else max(served, default=float("nan"))),
               "probe_5xx": sum(isinstance(s, int) and s >= 500 for s, _ in probes),
               "rss_mb": server.rss_mb(), "descriptors": server.descriptors(), "answers": sorted(set(map(str, codes)))}
        rows.append(row)
        print(f"| {name} | {row['5xx']} | {row['lost']} | {row['probes_served']} | {row['probe_p99_ms']:.0f} "
              f"| {row['rss_mb']:.0f} | {row['descriptors']} | {', '.join(row['answers'])} |", flush=True)

    print(f"idle: probe p99 {idle_p99 * 1e3:.0f} ms, RSS {rss0:.0f} MB, {server.descriptors()} descriptors")
    print("| phase | 5xx | lost | probes served | probe p99 ms | RSS MB | descriptors | answers |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in range(opts.rounds):
        phase(f"storm {r + 1} ({opts.clients} x 6, a quarter of the streams dropped)", storm(server.url, opts.clients, 6))
    opened = hold_sockets(server.url, 200, 15, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", 1.0)
    phase(f"slowloris ({opened} sockets, a header byte a second, 15 s)", [])
    opened = hold_sockets(server.url, 1100, 15)
    phase(f"idle sockets ({opened} opened of 1100, 15 s)", [])
    phase("chunked bodies of 64 MiB (8 clients)", [(c,) for c in oversize(server.url, 8)])
    phase("mass disconnect (64 streams dropped at once)", mass_disconnect(server.url, 64))
    time.sleep(3)
    phase("after", [])
    probe.stop.set()
    server.proc.terminate()
    code = server.proc.wait(timeout=60)
    log = "".join(server.output)
    worst_rss = max(r["rss_mb"] for r in rows)
    summary = {"idle_probe_p99_ms": idle_p99 * 1e3, "rss_start_mb": rss0, "rows": rows, "exit_code": code,
               "tracebacks": log.count("Traceback"), "log_lines": len(log.splitlines()),
               "goal_met": (all(r["5xx"] == 0 and r["lost"] == 0 and r["probe_5xx"] == 0 for r in rows)
                            and worst_rss <= 1.1 * rss0
                            # (a storm's probes wait their turn behind its requests: one generation at a time)
                            and all(r["probe_p99_ms"] <= 2 * idle_p99 * 1e3 for r in rows
                                    if not r["phase"].startswith("storm") and r["probe_p99_ms"] == r["probe_p99_ms"]))}
    print(f"exit {code}, {summary['tracebacks']} tracebacks, {summary['log_lines']} log lines; "
          f"RSS {rss0:.0f} -> max {worst_rss:.0f} MB; goal met: {summary['goal_met']}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
