"""`brisk bench`: decode speed against the device's own measured ceilings.

In one process on one device: the read-bandwidth and matmul ceilings first,
then a model (a preset's real shape with random weights, or a checkpoint):
decode tokens/s (prefill excluded; median and min-max over samples), the bytes
each token reads (weights actually read, one embedding row, plus the live KV
cache) and the fraction of the read ceiling that makes; time to first token;
prefill tokens/s and TFLOP/s; decode with a long context already cached; cold
and warm compile (separate processes, empty then filled compiler cache); peak
memory; and, with --peer hf, Hugging Face transformers on the same weights
(static cache, compiled as its docs describe) with our/peer ratios.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from .errors import BriskError
from .model import kv_bytes_per_position


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device, fn, reps, warmup=2):
    """Median seconds of fn() over reps runs (CUDA events on GPUs)."""
    times = []
    for i in range(warmup + reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
        if i >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def read_ceiling_gb_s(device, gb=None, reps=20):
    """Read bandwidth: a sum over a buffer much larger than the caches; two
    buffers alternate so the second read of one never hits in L2."""
    gb = gb or (4.0 if device.type == "cuda" else 0.5)
    n = int(gb * 1e9 / 4)
    bufs = [torch.ones(n, device=device) for _ in range(2)]  # (what is read, not its values; rand took seconds on CPUs)
    turn = iter(range(10**9))
    seconds = _timed(device, lambda: bufs[next(turn) % 2].sum(), reps)
    return n * 4 / seconds / 1e9


def matmul_tflops(device, n=None, reps=10):
    n = n or (8192 if device.type == "cuda" else 1024)
    dtype = torch.bfloat16
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / _timed(device, lambda: a @ b, reps) / 1e12


def prefill_flops(args, tokens: int) -> float:
    """Matmul FLOPs of a prefill that computes logits for the last token only."""
    a = args
    per_token = 2 * a.num_hidden_layers * (
        a.hidden_size * (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim
        + a.num_attention_heads * a.head_dim * a.hidden_size + 3 * a.hidden_size * a.intermediate_size)
    attention = 2 * 2 * a.num_hidden_layers * a.num_attention_heads * a.head_dim * tokens * tokens / 2
    return per_token * tokens + attention + 2 * a.hidden_size * a.vocab_size


def _prompt(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _run(llm, ids, new_tokens):
    llm.generator.reset()
    for _ in llm.stream_ids(ids, new_tokens, stop_ids=()):
        pass
    return llm.stats


SPREAD_WARNING = 1.5  # fastest / slowest decode sample above which the figure is flagged


def decode_figures(llm, prompt_len, new_tokens, samples, ceiling, dtype):
    ids = _prompt(prompt_len, llm.model.args.vocab_size)
    _run(llm, ids, new_tokens)  # warm-up (and compile)
    rates = [_run(llm, ids, new_tokens).decode_tokens_per_s for _ in range(samples)]
    live = prompt_len + new_tokens / 2  # mean cache length read during decode
    per_token = llm.stats.weight_bytes + live * kv_bytes_per_position(llm.model.args, dtype, llm.model.kv_int8)
    rate = statistics.median(rates)
    if max(rates) > SPREAD_WARNING * min(rates):
        from .console import log
        log(f"Warning: the decode samples vary {max(rates) / max(min(rates), 1e-9):.1f}x ({min(rates):.1f} to "
            f"{max(rates):.1f} tokens/s): the device is busy or throttling; the median is reported, "
            f"more --samples steady it")
    return {"prompt_tokens": prompt_len, "new_tokens": new_tokens, "tokens_per_s": rate,
            "min": min(rates), "max": max(rates), "bytes_per_token": per_token,
            "fraction_of_ceiling": per_token * rate / (ceiling * 1e9)}


def prefill_figures(llm, tokens, reps=3):
    ids = _prompt(tokens, llm.model.args.vocab_size, seed=tokens)
    _run(llm, ids, 1)
    seconds = statistics.median(_run(llm, ids, 1).prefill_s for _ in range(reps))
    return {"tokens": tokens, "ttft_ms": seconds * 1e3, "tokens_per_s": tokens / seconds,
            "tflops": prefill_flops(llm.model.args, tokens) / seconds / 1e12}


def speculative_prompt(llm) -> tuple[list[int], str]:
    """(ids, what they are) for speculative figures: a model with a tokenizer
    is asked to repeat a fixed text (input-grounded: prompt lookup finds its
    drafts there); random weights get random ids, where prompt lookup and a
    self-draft mostly miss (what speculation costs then) and a draft of the
    target's own weights mostly hits (the upper bound)."""
    if llm.tokenizer is None:
        return _prompt(64, llm.model.args.vocab_size, seed=1), "random ids"
    from .evaluate import default_text
    request = "Repeat the following text exactly:\n\n" + default_text(1200)
    if llm.tokenizer.chat_template:
        return llm.chat_ids([{"role": "user", "content": request}]), "repeat a 1200-character text (chat)"
    return llm.tokenizer.encode(request + "\n\nThe text again:\n\n"), "repeat a 1200-character text"


def speculative_figures(llm, kind: str, draft_tokens: int, draft_layers, new_tokens: int, samples: int,
                        draft_model=None) -> dict:
    """Greedy tokens/s with and without speculative decoding (`kind`; "draft":
    the drafter of the draft model load() made), in this process, the
    acceptance (tokens per target step), and whether both outputs are the
    same tokens (they must be)."""
    from .api import default_draft_tokens, drafter
    from .console import log
    from .sampling import SamplingParams
    ids, what = speculative_prompt(llm)
    draft_tokens = draft_tokens or default_draft_tokens(kind)
    if not llm.fits(ids, new_tokens):
        log(f"  skipped: the {len(ids)}-token prompt and {new_tokens} new tokens exceed the KV cache")
        return None
    gen = llm.generator
    spec = draft_model if kind == "draft" else drafter(llm.model, kind, draft_tokens, draft_layers)
    out = {"kind": kind, "draft_tokens": draft_tokens, "prompt": what, "prompt_tokens": len(ids)}
    llm.warm_speculative(ids, spec, draft_tokens)  # (no timed run compiles or records a step)
    for name, d in (("plain", None), ("speculative", spec)):
        rates, steps, tokens = [], [], None
        for run in range(samples + 1):  # (the first run warms up)
            gen.reset()
            tokens = list(gen.tokens(ids, new_tokens, SamplingParams(), (), None, d, draft_tokens))
            if run:
                rates.append(gen.stats.decode_tokens_per_s)
                steps.append(gen.stats.tokens_per_step)
        out[name] = {"tokens_per_s": statistics.median(rates), "tokens_per_step": statistics.median(steps),
                     "tokens": tokens}
    out["same_tokens"] = out["plain"].pop("tokens") == out["speculative"].pop("tokens")
    out["speedup"] = out["speculative"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    return out


def startup_figures(argv: list[str]):
    """Cold (empty compiler cache) and warm start of `brisk generate --compile`,
    each in a fresh process: the load, the warm-up (on CUDA the captures; the
    compile itself goes on on another thread), the whole process."""
    cmd = [sys.executable, "-m", "brisklm", "generate", *argv, "--compile", "--max_new_tokens", "8"]
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for name in ("cold", "warm"):
            t0 = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            wall = time.perf_counter() - t0
            if done.returncode:
                return {"error": done.stderr.strip().splitlines()[-1:]}
            loaded = float(re.search(r"Loaded in ([\d.]+) s", done.stderr).group(1))
            ready = re.search(r"Ready in ([\d.]+) s", done.stderr)
            out[name] = {"load_s": loaded, "warm_up_s": ready and float(ready.group(1)), "process_s": wall}
    return out


def _to_hf_state_dict(args, state):
    """Our canonical weights under Hugging Face names (fused matrices split again)."""
    from .checkpoints import hf_parts
    a = args
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    sizes = {"attention.wqkv": [q, kv, kv], "feed_forward.w13": [a.intermediate_size] * 2}
    out = {"model.embed_tokens.weight": state["tok_embeddings.weight"],
           "model.norm.weight": state["norm.weight"]}
    for name, t in state.items():
        if name.startswith("layers.") or name == "output.weight":
            local = name.split(".", 2)[-1].rsplit(".", 1)[0]
            parts = hf_parts(name)
            out.update(zip(parts, t.split(sizes[local]) if len(parts) > 1 else [t]))
    return out


LLAMA_CONFIG = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
                "max_position_embeddings", "tie_word_embeddings", "attention_bias", "hidden_act")


def dense_weights(llm) -> dict:
    """The model's canonical weights, dense, for a peer that reads no
    quantized formats: its own where it holds them so, else the checkpoint
    read again without quantizing (a preset: random weights of its shape)."""
    from .console import log
    from .model import canonical_names, random_state_dict
    args, device, dtype = llm.model.args, llm.generator.device, llm.model.norm.weight.dtype
    state = dict(llm.model.state_dict())
    names = canonical_names(args)
    if all(name in state for name in names):
        return state
    from .checkpoints import resolve
    try:
        resolve(llm.name)
    except BriskError:  # a preset
        return random_state_dict(args, dtype, device)
    from .checkpoints import load
    log(f"Peer: reading {llm.name} again, dense ({dtype}), as transformers runs it...")
    return load(llm.name, device=str(device), dtype=dtype).state_dict


def hf_peer_figures(llm, prompt_len, new_tokens, samples, static=True, ttft_lengths=()):
    """transformers' LlamaForCausalLM on the same weights: static cache,
    auto-compiled (static), or its default dynamic cache, eager. Time to first
    token also for prompts of ttft_lengths tokens."""
    import transformers
    args, device = llm.model.args, llm.generator.device
    if args.qk_norm or args.sandwich_norms or args.no_rope_layers or args.attention_bias or args.num_local_experts:
        raise BriskError("--peer hf runs transformers' LlamaForCausalLM: it compares Llama-architecture "
                         "models only (this one has q/k norms, extra norms, layers without RoPE, biases or experts)")
    config = transformers.LlamaConfig(**{k: v for k, v in args.to_dict().items() if k in LLAMA_CONFIG and v is not None})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    state = _to_hf_state_dict(args, dense_weights(llm))
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    rope = type(model.model.rotary_emb)
    try:
        model.model.rotary_emb = rope(config, device=device)
    except TypeError:  # transformers >= 5.2x: no device argument
        model.model.rotary_emb = rope(config).to(device)
    model.eval()
    if static:
        model.generation_config.cache_implementation = "static"
    ids = torch.tensor([_prompt(prompt_len, args.vocab_size)], device=device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              pad_token_id=0)

    def timed_generate(ids, **kw):
        _sync(device)
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        _sync(device)
        return time.perf_counter() - t0

    def ttft(ids):
        one = dict(kw, max_new_tokens=1, min_new_tokens=1)
        return statistics.median(timed_generate(ids, **one) for _ in range(3))

    with torch.no_grad():
        first = timed_generate(ids, **kw)
        prefill_s = ttft(ids)
        totals = [timed_generate(ids, **kw) for _ in range(samples)]
        by_length = {n: ttft(torch.tensor([_prompt(n, args.vocab_size, seed=n)], device=device)) * 1e3
                     for n in ttft_lengths}
    total = statistics.median(totals)
    return {"first_call_s": first, "tokens_per_s_incl_prefill": new_tokens / total,
            "tokens_per_s": (new_tokens - 1) / max(total - prefill_s, 1e-9),
            "ttft_ms": prefill_s * 1e3, "ttft_ms_by_length": by_length}


def _model_args(opts):
    """The model's ModelArgs before loading it, where cheap to know (a preset)."""
    if opts.preset:
        from .presets import preset
        try:
            return preset(opts.preset)
        except KeyError as e:  # before the ceilings are measured, not after
            raise BriskError(e.args[0]) from None
    return None


def run(opts) -> dict:
    """Every figure for one model on one device; opts as parsed by the CLI."""
    from .loading import LoadOptions, load, usable_device
    from .console import log
    device = torch.device(usable_device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu")))
    _model_args(opts)  # a bad preset name fails before the ceilings are measured
    log(f"Measuring the ceilings of {device}...")
    group = f"-g{opts.groupsize}" if opts.quantize == "int4" else ""
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "model": opts.preset or opts.checkpoint_path or "default",
              "quantize": opts.quantize and opts.quantize + group,
              "read_ceiling_gb_s": read_ceiling_gb_s(device),
              "matmul_tflops": matmul_tflops(device)}
    log(f"  read {result['read_ceiling_gb_s']:.0f} GB/s, bf16 matmul "
        f"{result['matmul_tflops']:.1f} TFLOP/s")
    gpu = device.type == "cuda"
    prefill = opts.prefill if opts.prefill is not None else ([1024, 8192] if gpu else [128])
    context = opts.context if opts.context is not None else ([8192, 32768] if gpu else [1024])
    longest = max([opts.prompt_tokens, *prefill, *context]) + opts.new_tokens + 8
    # The cache is the one `brisk generate` makes (the model's context, capped
    # by free memory), so that both share the compiled step; --max_seq_length
    # below the longest request is raised to it. (The cache's size sets the
    # attention kernel's slices, so decode at a short context depends on it.)
    length = opts.max_seq_length and max(opts.max_seq_length, longest)
    if opts.max_seq_length and opts.max_seq_length < longest:
        log(f"  --max_seq_length {opts.max_seq_length} is below the longest request ({longest} "
            f"tokens): using {longest}")
    speculate = "draft" if getattr(opts, "speculate", None) == "draft" else None  # (the drafted figures' draft model)
    llm = load(opts.checkpoint_path, preset=opts.preset, options=LoadOptions.from_args(
        opts, device=str(device), max_seq_length=length, quiet=False, speculate=speculate))
    llm.wait_compiled()  # (the figures are the compiled step's, which load() left compiling on another thread)
    draft_model, llm.drafter = llm.drafter, None  # (the decode figures are plain decoding's)
    result["tensor_parallel"] = llm.model.tensor_parallel and torch.distributed.get_world_size()
    result["fused_kernels"] = bool(llm.model.decode_kernels)
    result["decode_attention_kernel"] = bool(llm.model.decode_kernels.get("attention"))
    if result["fused_kernels"] and not result["decode_attention_kernel"]:
        log("  decode attention takes the PyTorch path: the Triton kernel does not serve this model"
            + f" (head_dim {llm.model.args.head_dim})")
    result["max_seq_length"] = llm.generator.max_seq_length
    limit = llm.generator.max_seq_length - opts.new_tokens - 8
    skipped = [n for n in prefill + context if n > limit]
    if skipped:  # lengths past the model's trained context are not its figures
        log(f"  skipping lengths {skipped}: past the KV cache of {llm.generator.max_seq_length} tokens "
            f"(the model's context is {llm.context})")
    prefill, context = [n for n in prefill if n <= limit], [n for n in context if n <= limit]
    dtype = llm.model.dtype
    ceiling = result["read_ceiling_gb_s"]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    log(f"Decode: {opts.samples} samples of {opts.new_tokens} tokens after a "
        f"{opts.prompt_tokens}-token prompt (the first run compiles)...")
    t0 = time.perf_counter()
    result["decode"] = decode_figures(llm, opts.prompt_tokens, opts.new_tokens, opts.samples,
                                      ceiling, dtype)
    result["first_run_s"] = time.perf_counter() - t0
    result["ttft"] = [prefill_figures(llm, n) for n in sorted({opts.prompt_tokens, *prefill})]
    result["long_context"] = [decode_figures(llm, n, opts.new_tokens, max(1, opts.samples // 2),
                                             ceiling, dtype) for n in context]
    if device.type == "cuda":
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    if getattr(opts, "speculate", None):
        log(f"Speculative decoding ({opts.speculate}) against plain, greedy...")
        result["speculative"] = speculative_figures(llm, opts.speculate, opts.draft_tokens, opts.draft_layers,
                                                    opts.new_tokens, max(1, opts.samples // 2), draft_model)
    if opts.startup:
        log("Start-up: cold and warm compile in fresh processes...")
        src = ["--preset", opts.preset] if opts.preset else (
            ["--checkpoint_path", opts.checkpoint_path] if opts.checkpoint_path else [])
        if opts.dtype:
            src += ["--dtype", opts.dtype]
        if opts.compile_options:
            src += ["--compile_options", json.dumps(opts.compile_options)]
        if opts.quantize:
            src += ["--quantize", opts.quantize, "--groupsize", str(opts.groupsize)]
        result["startup"] = startup_figures(src + ["--device", str(device)])
    if opts.peer == "hf":
        log("Peer: Hugging Face transformers, static cache, compiled...")
        result["peer_hf"] = hf_peer_figures(llm, opts.prompt_tokens, opts.new_tokens, opts.samples)
        result["ratio_vs_hf_decode"] = result["decode"]["tokens_per_s"] / result["peer_hf"]["tokens_per_s"]
    return result


def markdown(r: dict) -> str:
    d = r["decode"]
    quant = f", {r['quantize']}" if r.get("quantize") else ""
    quant += f", tensor parallel over {r['tensor_parallel']} (figures of one rank)" if r.get("tensor_parallel") else ""
    lines = [f"### {r['model']}{quant} on {r['device']} (torch {r['torch']}, {r['date']})", "",
             f"Ceilings measured in the same run: read {r['read_ceiling_gb_s']:.0f} GB/s, "
             f"bf16 matmul {r['matmul_tflops']:.1f} TFLOP/s.", "",
             "| figure | value |", "| --- | --- |",
             f"| decode tokens/s ({d['prompt_tokens']}-token prompt, {d['new_tokens']} new, "
             f"cache of {r['max_seq_length']}) | "
             f"{d['tokens_per_s']:.1f} (min {d['min']:.1f}, max {d['max']:.1f}) |",
             f"| bytes read per token (weights + live KV) | {d['bytes_per_token'] / 1e9:.3f} GB |",
             f"| fraction of the read ceiling | {d['fraction_of_ceiling']:.3f} |"]
    for t in r["ttft"]:
        lines.append(f"| prefill {t['tokens']} tokens: time to first token / tokens/s / TFLOP/s | "
                     f"{t['ttft_ms']:.1f} ms / {t['tokens_per_s']:.0f} / {t['tflops']:.1f} "
                     f"({t['tflops'] / r['matmul_tflops']:.2f} of matmul) |")
    for c in r["long_context"]:
        lines.append(f"| decode with {c['prompt_tokens']} tokens in the cache | "
                     f"{c['tokens_per_s']:.1f} tok/s, {c['fraction_of_ceiling']:.3f} of ceiling "
                     f"({c['bytes_per_token'] / 1e9:.3f} GB/token) |")
    if "peak_memory_gb" in r:
        lines.append(f"| peak GPU memory | {r['peak_memory_gb']:.1f} GB |")
    for name, s in r.get("startup", {}).items():
        if isinstance(s, dict):
            lines.append(f"| {name} start: load / warm-up / whole process | {s['load_s']:.1f} s / "
                         f"{s['warm_up_s'] or 0:.1f} s / {s['process_s']:.1f} s |")
    if r.get("speculative"):
        sp = r["speculative"]
        lines.append(f"| speculative {sp['kind']}, K={sp['draft_tokens']}, {sp['prompt']} ({sp['prompt_tokens']} "
                     f"tokens): tokens/s plain / speculative (tokens per target step) | "
                     f"{sp['plain']['tokens_per_s']:.1f} / {sp['speculative']['tokens_per_s']:.1f} "
                     f"({sp['speculative']['tokens_per_step']:.2f}): {sp['speedup']:.2f}x, "
                     f"same tokens {sp['same_tokens']} |")
    if "peer_hf" in r:
        p = r["peer_hf"]
        lines += [f"| transformers static+compile decode tokens/s | {p['tokens_per_s']:.1f} "
                  f"({p['tokens_per_s_incl_prefill']:.1f} incl. prefill; TTFT {p['ttft_ms']:.1f} ms) |",
                  f"| ratio brisk / transformers (decode) | {r['ratio_vs_hf_decode']:.2f}x |"]
    return "\n".join(lines) + "\n"


PLOT_FORMATS = (".png", ".svg")


def plot(results: list[dict], path: str) -> None:
    """Decode tokens/s of each result (a weight format, say) as a bar inside
    the ceiling its bytes read a token allow at the measured read bandwidth,
    a peer's figure beside it where measured; PNG or SVG by path's extension."""
    from matplotlib.figure import Figure  # (no pyplot: no display and no global figure state)
    fig = Figure(figsize=(2.5 + 1.6 * len(results), 4.5), layout="constrained")
    ax = fig.add_subplot()
    several_models = len({r["model"] for r in results}) > 1
    for i, r in enumerate(results):
        d, peer = r["decode"], r.get("peer_hf")
        x = i - 0.2 if peer else i
        ceiling = r["read_ceiling_gb_s"] * 1e9 / d["bytes_per_token"]
        ax.bar(x, ceiling, 0.4, fill=False, linestyle="--", edgecolor="gray", label="read ceiling" if i == 0 else None)
        ax.annotate(f"{ceiling:.0f}", (x, ceiling), ha="center", va="bottom", fontsize=8, color="gray")
        ax.bar(x, d["tokens_per_s"], 0.4, color="tab:blue", label="brisk-lm" if i == 0 else None)
        ax.annotate(f"{d['tokens_per_s']:.0f} ({d['fraction_of_ceiling']:.0%})", (x, d["tokens_per_s"]),
                    ha="center", va="bottom", fontsize=8)
        if peer:
            ax.bar(i + 0.2, peer["tokens_per_s"], 0.4, color="tab:orange",
                   label="transformers" if not any(p.get("peer_hf") for p in results[:i]) else None)
            ax.annotate(f"{peer['tokens_per_s']:.0f}", (i + 0.2, peer["tokens_per_s"]), ha="center",
                        va="bottom", fontsize=8)
    ax.set_xticks(range(len(results)), [(r.get("quantize") or "none") + (f"\n{r['model']}" if several_models else "")
                                        for r in results])
    ax.set_xlabel("--quantize")
    ax.set_ylabel("decode tokens/s (% of the read ceiling)")
    first = results[0]
    ax.set_title(f"{'' if several_models else first['model'] + ' '}on {first['device']} "
                 f"(torch {first['torch']}, {first['date']})", fontsize=10)
    ax.legend(fontsize=8)
    try:
        fig.savefig(path)
    except OSError as e:
        raise BriskError(f"--plot {path}: cannot write it ({e.strerror or e})") from None


def main(opts):
    result = run(opts)
    text = markdown(result)
    if getattr(opts, "plot", None):
        plot([result], opts.plot)
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    if opts.markdown:
        with open(opts.markdown, "w", encoding="utf-8") as f:
            f.write(text)
    print(text)
