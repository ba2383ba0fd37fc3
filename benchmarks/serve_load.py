"""Load and faults against a real `brisk serve`: requests/s, time to first
token, no 5xx, no memory growth, the same greedy text after the storm.

    PYTHONPATH=. python3 benchmarks/serve_load.py [--clients 16] [--requests 8] [--rounds 3] [-- serve flags]

Starts the server (bundled SmolLM2, no flags: what a user gets) on a
free loopback port. Each round: --clients concurrent clients send
--requests requests each through the openai client; of each eight, four are
chat requests, three stream a completion (two of them drop the stream after
its second chunk: a quarter of all requests) and one is malformed (raw
HTTP, expecting a 4xx). Checks that
every kept request has a full body and no answer is a 5xx; reports the
server's resident memory after each round (bound: growth from round 1 to
the last under 10%), requests/s and p50/p99 time to first token of the
streamed requests. Prints a table last.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_server import free_port, start, stop  # noqa: E402,F401  (the tests' own launcher)

import openai  # noqa: E402


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def malformed(url: str, i: int) -> int:
    bodies = [b"{oops", json.dumps({"prompt": 3}).encode(), json.dumps({"prompt": "hi", "max_tokens": -1}).encode(),
              json.dumps({"messages": "nope"}).encode()]
    path = "/v1/chat/completions" if i % 4 == 3 else "/v1/completions"
    req = urllib.request.Request(url + path, data=bodies[i % 4], method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=300)
        return 200
    except urllib.error.HTTPError as e:
        return e.code


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max_tokens", type=int, default=24)
    ap.add_argument("serve", nargs="*", help="after --: brisk serve flags")
    opts = ap.parse_args()
    from brisklm.checkpoints.hub import default_model_path
    proc, url = start(default_model_path(quiet=True), "--queue", str(opts.clients * 2), *opts.serve, base=())
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    greedy = dict(model=model, prompt="The capital of France is", temperature=0, max_tokens=16)
    before = client.completions.create(**greedy).choices[0].text

    def one(job):
        c, r = job
        i = c * opts.requests + r
        if r % 8 == 7:
            status = malformed(url, i)
            assert 400 <= status < 500, status
            return "malformed", None
        if r % 2:
            t0 = time.perf_counter()
            stream = client.completions.create(model=model, prompt=f"Story number {i}:", stream=True,
                                               max_tokens=opts.max_tokens, temperature=0.8, seed=i)
            ttft = None
            for n, chunk in enumerate(stream):
                ttft = ttft or time.perf_counter() - t0
                if r % 4 == 1 and n == 1:
                    stream.close()
                    return "dropped", ttft
            return "streamed", ttft
        out = client.chat.completions.create(model=model, max_tokens=opts.max_tokens,
                                             messages=[{"role": "user", "content": f"Name {i % 7 + 2} fruits."}])
        assert out.choices[0].message.content is not None and out.usage.completion_tokens >= 1
        return "done", None

    rows = []
    try:
        for round_ in range(opts.rounds):
            jobs = [(c, r) for c in range(opts.clients) for r in range(opts.requests)]
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(opts.clients) as pool:
                results = list(pool.map(one, jobs))
            seconds = time.perf_counter() - t0
            ttfts = sorted(t for kind, t in results if kind == "streamed" and t is not None)
            kinds = {k: sum(1 for kind, _ in results if kind == k) for k in ("done", "streamed", "dropped", "malformed")}
            rows.append((round_ + 1, len(jobs) / seconds, statistics.median(ttfts),
                         ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], rss_mb(proc.pid), kinds))
            print(rows[-1], flush=True)
        after = client.completions.create(**greedy).choices[0].text
    finally:
        stop(proc)
    growth = rows[-1][4] / rows[0][4] - 1
    print(f"\n{opts.clients} clients x {opts.requests} requests a round, {opts.max_tokens} tokens each; "
          f"greedy text after == before: {after == before}; RSS growth round 1 -> {opts.rounds}: "
          f"{100 * growth:+.1f}% (bound 10%)")
    print("| round | requests/s | TTFT p50 s | TTFT p99 s | server RSS MB | done / streamed / dropped / malformed |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n, rps, p50, p99, rss, kinds in rows:
        print(f"| {n} | {rps:.2f} | {p50:.2f} | {p99:.2f} | {rss:.0f} | "
              f"{kinds['done']} / {kinds['streamed']} / {kinds['dropped']} / {kinds['malformed']} |")
    if after != before or growth > 0.10:
        raise SystemExit("FAILED")


if __name__ == "__main__":
    main()
