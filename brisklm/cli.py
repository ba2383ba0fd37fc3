"""`brisk`: generate, chat, convert, quantize, eval, bench and download from the command line.

User errors (bad paths, corrupt files, bad values) print one line
`error: ...` and exit with status 2; they never show a traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

from .errors import BriskError, as_user_error
from .modes import FILE_MODES, GROUP_SIZES, LOAD_MODES, RTN_MODES

DEFAULT_PROMPT = "Hello, my name is"
CHECKPOINT_HELP = "HF folder, GGUF file, native folder or hub repo id (default: bundled SmolLM2-135M-Instruct)"


def _model_flags(p: argparse.ArgumentParser):
    p.add_argument("--checkpoint_path", "--model", dest="checkpoint_path", default=None,
                   help=CHECKPOINT_HELP)
    p.add_argument("--preset", default=None,
                   help="a named shape with random weights instead of a checkpoint (see presets.py)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if present)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bfloat16)")
    p.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the decode step (the default on CUDA, and on CPUs for chat and serve; "
                   "brisk generate: where it decodes 1024 tokens or more; asked for, generate waits for it)")
    p.add_argument("--no_compile", dest="compile", action="store_false",
                   help="run the steps uncompiled (on CUDA the decode step is still replayed from a CUDA graph)")
    p.add_argument("--compile_prefill", action="store_true", default=None,
                   help="torch.compile prefill too, dynamic shapes (off by default: a new prompt length may compile again)")
    p.add_argument("--max_seq_length", type=_positive_int, default=None,
                   help="KV cache length (default: the model's context, capped by free memory)")
    p.add_argument("--allow_long_context", action="store_true",
                   help="allow --max_seq_length past the model's context (output quality degrades there)")
    p.add_argument("--quantize", choices=LOAD_MODES,
                   default="auto",
                   help="weight-only quantization at load: int8 (a scale per row), q8_0 (a scale per 32 "
                        "inputs, as GGUF's Q8_0: closer to bf16, fast on GPUs), int4 (RTN); gguf keeps a GGUF "
                        "file's Q4_0/Q4_1 blocks as int4; auto (default) = gguf where possible, else none")
    p.add_argument("--groupsize", type=int, default=128, help=f"int4 group size ({', '.join(map(str, GROUP_SIZES))})")
    p.add_argument("--kv_int8", action="store_true",
                   help="KV cache in int8 with a scale per position and head: half the memory, some speed")
    p.add_argument("--no_fused_kernels", dest="fused_kernels", action="store_false",
                   help="on NVIDIA GPUs, leave out our Triton kernels (fusion.py): PyTorch ops only, to compare")
    p.add_argument("--compile_options", type=_json_dict, default=None,
                   help='inductor options as JSON, e.g. \'{"coordinate_descent_tuning": true}\'')


def _tp_flag(p: argparse.ArgumentParser):
    p.add_argument("--tp", type=_positive_int, default=None,
                   help="tensor parallelism over N processes (runs torchrun for you: one per GPU, or gloo "
                        "processes with --device cpu); under torchrun the world size is used by itself")


def _speculate_flags(p: argparse.ArgumentParser):
    p.add_argument("--speculate", choices=["ngram", "self", "draft"], default=None,
                   help="speculative decoding: ngram (prompt lookup), self (the model's first layers draft) or "
                        "draft (--draft_checkpoint_path, or this model with --draft_quantize); the same output, "
                        "fewer target steps where drafts are accepted")
    p.add_argument("--draft_checkpoint_path", default=None,
                   help="--speculate draft: the draft model (sharing the tokenizer; default: this one)")
    p.add_argument("--draft_quantize", choices=LOAD_MODES, default=None,
                   help="--speculate draft: the draft's quantization, e.g. int4 (default: --quantize's)")
    p.add_argument("--draft_preset", default=None,
                   help="--speculate draft: a named shape with random weights as the draft (benchmarks; "
                        "with --preset and no draft flag the draft is the target's own shape and weights)")
    p.add_argument("--draft_tokens", type=_positive_int, default=None,
                   help="drafts checked per target step, at most (default: 8 for ngram, 4 for a drafting model)")
    p.add_argument("--draft_layers", type=_positive_int, default=None,
                   help="--speculate self: layers of the draft (default: a quarter of the model's)")


def _sampling_flags(p: argparse.ArgumentParser, max_new_tokens=200):
    p.add_argument("--max_new_tokens", type=_positive_int, default=max_new_tokens,
                   help="tokens to generate at most (a reply ends sooner at the model's end token)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top_p", type=float, default=None, help="sample within the top tokens of this total probability")
    p.add_argument("--min_p", type=float, default=0.05,
                   help="drop tokens under min_p x the top one's probability (0 = off; llama.cpp's default)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the sampling, for reproducible output (sample i of --num_samples: seed + i)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


class _HelpFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default, where it has one its text does not already name."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.default not in (None, False, True, argparse.SUPPRESS)
                and "default" not in text):
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """Usage mistakes print one line, as other user errors do, not the whole
    usage block; every --flag_name is also --flag-name, the other common
    spelling (the help shows the first)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *names, **kwargs):
        dashed = [n.replace("_", "-") for n in names if n.startswith("--") and "_" in n]
        return super().add_argument(*names, *[d for d in dashed if d not in names], **kwargs)

    def error(self, message):
        print(f"error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="brisk", description="Fast, hackable LLM inference.")
    from . import __version__
    parser.add_argument("--version", action="version", version=f"brisk-lm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="continue a prompt")
    _model_flags(g)
    _tp_flag(g)
    _speculate_flags(g)
    _sampling_flags(g)
    g.add_argument("--prompt", default=None,
                   help=f"the text to continue; - reads it from stdin, as does a pipe or file on stdin "
                        f"(default: {DEFAULT_PROMPT!r})")
    g.add_argument("--prompt_file", default=None, help="read the prompt from this UTF-8 file")
    g.add_argument("--num_samples", type=_positive_int, default=1, help="samples of the same prompt, one after another")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object (each sample's text and figures) instead of the text as it comes")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--profile", default=None, help="write a torch.profiler trace of the last sample here")
    g.add_argument("--quiet", action="store_true", help="print only the generated text")
    g.add_argument("--json_schema", default=None, metavar="FILE",
                   help="the output is JSON valid against the schema in this file (needs llguidance)")
    g.add_argument("--json_object", action="store_true", help="the output is a JSON object (needs llguidance)")
    g.add_argument("--grammar", default=None, metavar="FILE",
                   help="the output matches the grammar in this file: Lark (llguidance's) or llama.cpp GBNF")
    g.add_argument("--regex", default=None, help="the output matches this regular expression (needs llguidance)")

    c = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    _model_flags(c)
    _tp_flag(c)
    _speculate_flags(c)
    _sampling_flags(c, max_new_tokens=512)
    c.add_argument("--system", default=None, help="system message")

    v = sub.add_parser("convert", help="write a checkpoint as a native brisk-lm folder")
    v.add_argument("--checkpoint_path", "--model", dest="checkpoint_path", default=None,
                   help=CHECKPOINT_HELP)
    v.add_argument("--output", required=True, help="the folder to write (refused if it exists, unless --force)")
    v.add_argument("--dtype", default="bfloat16", help="dtype of the dense tensors (default: bfloat16)")
    v.add_argument("--dequantize", action="store_true",
                   help="write every matrix dense in --dtype (by default a GGUF file's quantized blocks are kept)")
    v.add_argument("--force", action="store_true", help="overwrite an existing --output")

    b = sub.add_parser("bench", help="decode speed against the device's measured ceilings")
    _model_flags(b)
    _tp_flag(b)
    b.add_argument("--prompt_tokens", type=_positive_int, default=5, help="prompt length of the decode figure")
    b.add_argument("--new_tokens", "--max_new_tokens", dest="new_tokens", type=_positive_int, default=200,
                   help="tokens decoded a sample")
    b.add_argument("--samples", type=_positive_int, default=5, help="decode runs; the figure is their median")
    b.add_argument("--prefill", type=_int_list, default=None,
                   help="prompt lengths for prefill figures, comma-separated "
                        "(default 1024,8192 on GPUs, 128 on CPUs)")
    b.add_argument("--context", type=_int_list, default=None,
                   help="cached lengths for long-context decode figures, comma-separated "
                        "(default 8192,32768 on GPUs, 1024 on CPUs; capped at the model's context)")
    b.add_argument("--startup", action="store_true", help="also time cold and warm compile")
    _speculate_flags(b)  # (bench: also greedy tokens/s with and without it, and the acceptance)
    b.add_argument("--peer", choices=["hf"], default=None,
                   help="also time Hugging Face transformers on the same weights (static cache, compiled)")
    b.add_argument("--json", default=None, help="write every figure to this file as JSON")
    b.add_argument("--markdown", default=None, help="write the table to this file as Markdown")
    b.add_argument("--plot", default=None,
                   help="draw decode tokens/s against the read ceiling (and a peer's) to this .png or .svg "
                        "(needs the plot extra)")
    b.add_argument("--from", dest="from_json", nargs="+", default=None, metavar="JSON",
                   help="with --plot: draw these --json results (one bar each: weight formats side by side) "
                        "instead of running the benchmark")

    q = sub.add_parser("quantize", help="write a weight-only quantized native checkpoint")
    q.add_argument("--checkpoint_path", "--model", dest="checkpoint_path", default=None,
                   help=CHECKPOINT_HELP)
    q.add_argument("--mode", choices=FILE_MODES, required=True,
                   help="int8, q8_0, int4, fp8 (round to nearest), int4-gptq (calibrated), gguf (a GGUF "
                        "file's blocks kept as they are)")
    q.add_argument("--groupsize", type=int, default=128, help="int4 group size")
    q.add_argument("--output", default=None, help="default: <checkpoint>-<mode> beside it "
                                                  "(refused if it exists, unless --force)")
    q.add_argument("--force", action="store_true", help="overwrite an existing --output")
    q.add_argument("--dtype", default="bfloat16", help="dtype of the tensors left dense")

    e = sub.add_parser("eval", help="lm-evaluation-harness tasks, or perplexity (and KL against the "
                                    "unquantized model)")
    _model_flags(e)
    e.add_argument("--tasks", default=None,
                   help="comma-separated lm-eval task names or task .yaml files (needs the eval extra); "
                        "without it, perplexity")
    e.add_argument("--num_fewshot", type=int, default=None, help="examples before each question (default: the task's)")
    e.add_argument("--limit", type=_limit, default=None,
                   help="at most this many examples a task, or a fraction of each (0.1)")
    e.add_argument("--include_path", default=None, help="a folder of task .yaml files of your own")
    e.add_argument("--output", default=None, help="write the harness's results here as JSON")
    e.add_argument("--output_path", default=None,
                   help="as lm_eval's: a folder (or .json file) for the results and, with --log_samples, "
                        "each task's samples as JSONL")
    e.add_argument("--log_samples", action="store_true",
                   help="keep each example's requests, answers and scores (in --output or --output_path)")
    e.add_argument("--apply_chat_template", action="store_true", help="prompts through the model's chat template")
    e.add_argument("--system_instruction", default=None, help="a system message before each prompt")
    e.add_argument("--gen_kwargs", default=None,
                   help="generation settings over the tasks' own: k=v,... or JSON (until, max_gen_toks, "
                        "do_sample, temperature, top_p, top_k)")
    e.add_argument("--seed", type=_seeds, default=None,
                   help="python, numpy, torch and few-shot seeds: one for all, or four comma-separated")
    e.add_argument("--batch_size", type=_batch_size, default="1",
                   help="accepted for lm_eval's command lines; brisk runs batch 1 (its design point)")
    e.add_argument("--perplexity", action="store_true", help="(the default without --tasks)")
    e.add_argument("--text", default=None, help="a UTF-8 text file (default: pydoc_data.topics)")
    e.add_argument("--max_tokens", type=_positive_int, default=8192, help="perplexity: tokens of the text scored")
    e.add_argument("--window", type=_positive_int, default=512,
                   help="perplexity: tokens a window (each scored with the window before it as context)")
    e.add_argument("--reference", action="store_true",
                   help="also run the unquantized model and report mean KL divergence against it")

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the server extra)")
    _model_flags(s)
    _speculate_flags(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port")
    s.add_argument("--api_key", "--api-key", dest="api_key", default=None,
                   help="require Authorization: Bearer KEY on every endpoint but /health (or BRISK_API_KEY)")
    s.add_argument("--queue", type=int, default=16, help="requests that may wait while one generates; then 429")
    s.add_argument("--model_name", default=None, help="the model id clients name (default: the checkpoint's name)")

    ls = sub.add_parser("list", help="the models the caches hold (brisk's and the Hugging Face hub's)")
    ls.add_argument("--json", action="store_true", help="print them as a JSON list")

    d = sub.add_parser("download", help="fetch a Hugging Face repo (or, with no id, the default model)")
    d.add_argument("repo_id", nargs="?", default=None)
    d.add_argument("--revision", default=None, help="a branch, tag or commit (default: main)")
    return parser


def _json_dict(text: str) -> dict:
    import json
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _load(args, quiet=False):
    from .loading import LoadOptions, load
    if args.checkpoint_path and args.preset:
        raise BriskError("give either --checkpoint_path or --preset, not both")
    # (each command warms up once its input is checked)
    return load(args.checkpoint_path, preset=args.preset,
                options=LoadOptions.from_args(args, quiet=quiet, warm_up=False))


def _sampling(args) -> dict:
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p)


def _check_sampling(args):
    """Bad sampling values fail here, before the model loads."""
    from .sampling import SamplingParams
    with as_user_error():
        SamplingParams(**_sampling(args))


def _peak_memory_gb(device) -> float:
    import torch
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB -> GB


def read_prompt(args) -> str:
    """--prompt, else --prompt_file, else a pipe or file on stdin (--prompt -
    waits for stdin), else the default prompt."""
    if args.prompt_file is not None:
        if args.prompt is not None:
            raise BriskError("give either --prompt or --prompt_file, not both")
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise BriskError(f"--prompt_file {args.prompt_file}: cannot read it as UTF-8 text "
                             f"({getattr(e, 'strerror', None) or e})") from None
    if args.prompt == "-" or (args.prompt is None and stdin_has_input()):
        text = sys.stdin.read()
        text = text[:-1] if text.endswith("\n") else text  # (echo's newline ends the input, not the prompt)
        if text or args.prompt == "-":
            return text
    return DEFAULT_PROMPT if args.prompt is None else args.prompt


STDIN_WAIT_S = 2.0  # how long a pipe on stdin may take to bring its first bytes (or close)


def stdin_has_input() -> bool:
    """Whether stdin is a pipe or file with something to read (not a
    terminal, not /dev/null, not a pipe that nothing writes to within
    STDIN_WAIT_S: a slow writer's prompt is still the prompt)."""
    import select
    import stat
    try:
        info = os.fstat(sys.stdin.fileno())
        if stat.S_ISREG(info.st_mode):
            return info.st_size > 0
        return stat.S_ISFIFO(info.st_mode) and bool(select.select([sys.stdin], [], [], STDIN_WAIT_S)[0])
    except (OSError, ValueError, AttributeError):
        return False


# `brisk generate` compiles by default only where it decodes at least this many tokens: a shorter
# run ends before the compile on another thread would (seconds, from the compiler's caches).
ONE_SHOT_COMPILE_TOKENS = 1024


def cmd_generate(args):
    import json

    import torch
    from .console import log
    _check_sampling(args)
    prompt_text = None if args.preset else read_prompt(args)  # (before loading: a bad file fails fast)
    from .constrain import from_files
    constraint = from_files(args.json_schema, args.grammar, args.regex, args.json_object)
    quiet = args.quiet or args.json
    # (asked for, the compile is waited for: a sample decodes on the step it starts with, and
    # beside the compile, which holds Python's lock, the uncompiled step decodes slower still)
    asked = args.compile is True
    one_shot = args.compile is None and args.num_samples * args.max_new_tokens < ONE_SHOT_COMPILE_TOKENS
    if one_shot:
        args.compile = False  # (the compile, on another thread, would end after the run it competes with)
    llm = _load(args, quiet=quiet)
    if one_shot and llm.generator.device.type == "cuda":
        log(f"(fewer than {ONE_SHOT_COMPILE_TOKENS} tokens to decode: the steps run uncompiled, as a compile would "
            f"end after them; --compile compiles)", quiet)
    seed = lambda i: None if args.seed is None else args.seed + i  # noqa: E731  (each sample its own)
    if args.preset:  # random weights and no tokenizer: token ids in, token ids out
        prompt_ids = [1 + i for i in range(5)]
        run = lambda i: llm.stream_ids(prompt_ids, args.max_new_tokens, stop_ids=(), seed=seed(i),  # noqa: E731
                                       **_sampling(args), **constraint)
        show = lambda piece: print(piece, end=" ", flush=True)  # noqa: E731
    else:
        tok = llm.require_tokenizer()
        prompt = llm.apply_chat_template([{"role": "user", "content": prompt_text}]) if args.chat else prompt_text
        prompt_ids = tok.encode(prompt, add_bos=False if args.chat else None)
        run = lambda i: llm.stream_ids_as_text(prompt_ids, args.max_new_tokens, args.stop,  # noqa: E731
                                                seed=seed(i), **_sampling(args), **constraint)
        show = lambda piece: print(piece, end="", flush=True)  # noqa: E731
    if args.json:
        show = lambda piece: None  # noqa: E731
    llm.check(prompt_ids, args.max_new_tokens)  # before any compile
    # (this prompt's graphs only: a one-shot run needs no others)
    llm.warm_up(prompt_ids, quiet=quiet, prompts=[len(prompt_ids)], constrained=bool(constraint),
                sampled=args.temperature > 0, wait=asked or None)
    device = llm.generator.device
    rates, samples = [], []
    for i in range(args.num_samples):
        llm.generator.reset()
        profiling = args.profile and i == args.num_samples - 1
        prof = (torch.profiler.profile(record_shapes=False) if profiling
                else contextlib.nullcontext())
        with prof:
            pieces = run(i)  # checks the request before the prompt is echoed
            if not args.preset and not quiet:
                print(prompt_text if not args.chat else "", end="", flush=True)
            text = []
            for piece in pieces:
                text.append(piece)
                show(piece)
        if (args.preset or not args.quiet) and not args.json:
            print()
        s = llm.stats
        rates.append(s.decode_tokens_per_s)
        samples.append({"text": " ".join(map(str, text)) if args.preset else "".join(text),
                        "prompt_tokens": s.prompt_tokens, "new_tokens": s.new_tokens,
                        "time_to_first_token_s": s.prefill_s,
                        "decode_tokens_per_s": s.decode_tokens_per_s if s.new_tokens > 2 else None,
                        "tokens_per_target_step": s.tokens_per_step if s.target_steps else None,
                        "target_steps": s.target_steps or None, "drafted_steps": s.drafted_steps or None,
                        "seed": seed(i)})
        decode = (f"decode {s.decode_tokens_per_s:.2f} tokens/s, bandwidth achieved {s.bandwidth_gb_s:.2f} GB/s"
                  if s.new_tokens > 2 else "too few tokens to time the decode")
        log(f"Sample {i + 1}: {s.new_tokens} tokens, time to first token {s.prefill_s * 1e3:.1f} ms "
            f"({s.prompt_tokens} prompt tokens), {decode}"
            + (f", {s.tokens_per_step:.2f} tokens a target step (--speculate {args.speculate}: drafts checked in "
               f"{s.drafted_steps} of {s.target_steps} steps"
               + (", plain decoding where they did not pay)" if s.drafted_steps < s.target_steps else ")")
               if s.target_steps else ""), quiet)
        llm.say_switched_midway()
        if profiling and int(os.environ.get("RANK", "0")) == 0:  # (tensor-parallel: the first rank's)
            prof.export_chrome_trace(args.profile)
            log(f"Profile written to {args.profile}", quiet)
    timed = [r for r, sample in zip(rates, samples) if sample["decode_tokens_per_s"] is not None]
    mean = sum(timed) / len(timed) if timed else 0.0
    weights_gb = llm.stats.weight_bytes / 1e9
    if args.json:
        print(json.dumps({"model": llm.name, "device": str(device), "samples": samples,
                          "mean_decode_tokens_per_s": mean or None, "weights_gb_read_per_token": weights_gb,
                          "peak_memory_gb": _peak_memory_gb(device)}, ensure_ascii=False))
        return
    log(f"Average decode: {mean:.2f} tokens/s over {len(timed)} sample(s); model weights "
        f"{weights_gb:.3f} GB read per token; bandwidth achieved "
        f"{weights_gb * mean:.2f} GB/s; peak memory "
        f"{_peak_memory_gb(device):.2f} GB" if timed else
        f"Peak memory {_peak_memory_gb(device):.2f} GB", quiet)


def _compiled_beside_requests(args):
    """chat and serve compile by default on CPUs too: a long-lived process gains
    from the block that compiles in seconds on another thread while requests
    run uncompiled (Steps.compile_later). Not under torchrun, whose ranks wait
    for their compile together."""
    import torch.distributed as dist
    if args.compile is None and not dist.is_initialized():
        args.compile = True


def cmd_chat(args):
    from .checkpoints.hub import cache_dir
    from .repl import chat
    _check_sampling(args)
    _compiled_beside_requests(args)
    llm = _load(args)
    llm.remember_requests()  # (prompt lookup drafts from the earlier turns' text too, after a /reset as well)
    llm.require_tokenizer()  # no tokenizer (a preset): say so now, not after the first message
    start = [{"role": "system", "content": args.system}] if args.system else []
    # (the prefill graphs of longer prompts are captured while the user types: repl.chat)
    import torch.distributed as dist
    llm.warm_up(llm.chat_ids(start + [{"role": "user", "content": "Hi"}]), quiet=False,
                prompts=None if dist.is_initialized() else [], wait=False)
    chat(llm, args.system, args.max_new_tokens, args.stop, args.seed, _sampling(args),
         history_file=os.path.join(cache_dir(), "chat_history"))


def repo_id(checkpoint: str | None) -> str | None:
    """The hub repo (org/name) a --checkpoint_path names, where it is not a path on disk."""
    from .checkpoints.hub import parse_repo_id
    if not checkpoint or os.path.exists(os.path.expanduser(checkpoint)):
        return None
    ref = parse_repo_id(checkpoint)
    return ref.repo if ref else None


def fresh_output(path: str, force: bool):
    """Refuse to write over an existing file or non-empty folder, unless force."""
    if os.path.exists(path) and not force and not (os.path.isdir(path) and not os.listdir(path)):
        raise BriskError(f"{path}: already exists; --force writes over it")


def dense_transform(model_args, name, t):
    """Every tensor as read, dense (a quantized folder's entries are widened before a transform)."""
    return {name: t}


def cmd_convert(args):
    from .loading import parse_dtype
    from .console import step
    from .checkpoints import load
    from .checkpoints.native import save_native
    source = args.checkpoint_path or "the bundled default model"
    fresh_output(args.output, args.force)
    with step(f"Reading {source}" + (", dequantizing its blocks" if args.dequantize else ""), "Read"):
        # By default a GGUF file's int4 and int8 blocks stay as they are: no dequantized copy, twice the size.
        ckpt = load(args.checkpoint_path, device="cpu", dtype=parse_dtype(args.dtype),
                    keep_gguf_blocks=False if args.dequantize else "all",
                    transform=dense_transform if args.dequantize else None)
    kept = sum(k.endswith(("_int4", "_int8")) for k in ckpt.state_dict)
    with step(f"Writing {args.output}" + (f" ({kept} matrices kept quantized)" if kept else ""), "Written"):
        save_native(args.output, ckpt.args, ckpt.state_dict, ckpt.tokenizer,
                    quantization={"mode": "gguf", "groupsize": 32} if kept else None)
    print(args.output)


def cmd_download(args):
    from .checkpoints.hub import default_model_path, download
    path = download(args.repo_id, args.revision) if args.repo_id else default_model_path()
    print(path)


def cmd_list(args):
    import json
    from .checkpoints.hub import cache_dir, cached_models, hub_caches
    rows = cached_models()
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    if not rows:
        print(f"No models cached (looked in {', '.join([cache_dir(), *hub_caches()])}). `brisk download` "
              f"fetches the default model, `brisk download org/name` a Hugging Face repo.")
        return
    table = [("NAME", "FORMAT", "SIZE", "PATH")] + [
        (r["name"], r["format"], _human_bytes(r["bytes"]), r["path"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])


def _human_bytes(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _size(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    return os.path.getsize(path)


def cmd_quantize(args):
    from .loading import LoadOptions, check_kept_blocks, gptq_errors, parse_dtype, reader_transform
    from .console import log, progress_bar, step
    from .checkpoints import load, resolve
    from .checkpoints.native import NativeWriter, save_native
    from .quantize import untied
    kind, source = resolve(args.checkpoint_path)
    repo = repo_id(args.checkpoint_path)  # (a hub snapshot: the output goes here, not into the hub's cache)
    output = args.output or (repo.split("/")[-1] if repo else os.path.splitext(source.rstrip("/"))[0]) + f"-{args.mode}"
    fresh_output(output, args.force)
    scheme = {"mode": args.mode, "groupsize": 32 if args.mode == "gguf" else
              (args.groupsize if args.mode.startswith("int4") else None)}
    sink = None
    if args.mode in RTN_MODES or args.mode == "int4-gptq":  # quantized and written as it is read
        # (as load() quantizes as it reads; GPTQ layer by layer: one layer dense at a time)
        quantize = reader_transform(source, None, LoadOptions(quantize=args.mode, groupsize=args.groupsize,
                                                              quiet=False), rank=0, world=1)
        writer, written = NativeWriter(output), {}

        def sink(model_args, name, t):  # (the reader keeps what this returns: nothing)
            for key, entry in quantize(model_args, name, t).items():
                writer.add(key, entry)
                written[key] = None
            return {}
    how = "layer by layer" if args.mode == "int4-gptq" else "tensor by tensor"
    doing = f", quantizing to {args.mode} {how} and writing {output} as it goes" if sink else ""
    with step(f"Reading {args.checkpoint_path or 'the bundled default model'}{doing}",
              "Read, quantized and written" if sink else "Read"), gptq_errors(source, args.mode):
        ckpt = load(source, device="cpu", dtype=parse_dtype(args.dtype), progress=progress_bar,
                    keep_gguf_blocks="all" if args.mode == "gguf" else False, transform=sink)
    if sink:
        for key, t in ckpt.state_dict.items():  # what the reader kept as it was (a file's quantized entries)
            writer.add(key, t)
            written[key] = None
        writer.finish(untied(ckpt.args, written), ckpt.tokenizer, quantization=scheme)
    else:
        check_kept_blocks(ckpt.state_dict, args.mode, ckpt.path, quiet=False)
        with step(f"Writing {output}", "Written"):
            save_native(output, ckpt.args, ckpt.state_dict, ckpt.tokenizer, quantization=scheme)
    source_bytes, written_bytes = _size(ckpt.path), _size(output)
    if written_bytes > source_bytes:
        log(f"Note: {output} ({written_bytes / 1e6:.0f} MB) is larger than its source ({source_bytes / 1e6:.0f} MB): "
            + "; ".join(growth_reasons(kind, source, output, args.mode, ckpt.args.tie_word_embeddings)))
    print(output)


def growth_reasons(kind: str, source: str, output: str, mode: str, tied: bool) -> list[str]:
    """Why a quantized folder came out larger than its source, from what it holds."""
    from .checkpoints.native import read_metadata, tensor_shapes
    written = tensor_shapes(output)
    def held(prefix):  # "28 MB as int8"
        keys = [k for k in written if k.startswith(prefix)]
        codes = next((k.rsplit("_", 1)[1] for k in keys if k.endswith(("_int4", "_int8", "_fp8"))), "dense")
        return f"{sum(written[k][1] for k in keys) / 1e6:.0f} MB" + ("" if codes == "dense" else f" as {codes}")
    reasons = []
    if tied and any(k.startswith("output.weight") for k in written):
        reasons.append(f"the embedding, which the source ties to the output layer, is written twice: for the "
                       f"lookup ({held('tok_embeddings.')}) and for the output layer ({held('output.weight')})")
    if kind == "gguf" or (kind == "native" and read_metadata(source).get("quantization")):
        reasons.append(f"the source's matrices are quantized already (re-quantizing them to {mode} adds no "
                       f"accuracy to their codes"
                       + ("; --mode gguf keeps a GGUF file's blocks as they are)" if kind == "gguf" else ")"))
    return reasons or ["its dense tensors are stored wider than the source's"]


def cmd_eval(args):
    import torch
    from .console import log
    from .evaluate import default_text, perplexity, perplexity_and_kl
    if args.tasks:
        return eval_tasks(args)
    if args.text:  # read before the model loads: a bad path fails at once
        try:
            with open(args.text, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise BriskError(f"{args.text}: cannot read text ({e})") from None
    else:
        text = default_text()
    llm = _load(args)
    ids = torch.tensor(llm.require_tokenizer().encode(text)[:args.max_tokens])
    if ids.numel() < 2:
        raise BriskError("the text has fewer than 2 tokens")
    log(f"Scoring {ids.numel()} tokens in windows of {args.window}...")
    if args.reference:
        from .loading import load
        ref = load(args.checkpoint_path, preset=args.preset, device=args.device, dtype=args.dtype,
                   quantize="none", warm_up=False)  # (its forward only)
        ppl, ppl_ref, kl = perplexity_and_kl(llm.model, ref.model, ids, args.window)
        print(f"perplexity {ppl:.4f} (reference {ppl_ref:.4f}, {100 * (ppl / ppl_ref - 1):+.2f}%), "
              f"mean KL divergence {kl:.5f}")
    else:
        print(f"perplexity {perplexity(llm.model, ids, args.window):.4f}")


def _limit(text: str) -> int | float:
    value = float(text)
    if not (0 < value < 1 or (value >= 1 and value.is_integer())):
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 or a fraction in (0, 1), got {text}")
    return value if value < 1 else int(value)


def _batch_size(text: str) -> str:
    if not (text.startswith("auto") or (text.isdigit() and int(text) >= 1)):
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 or auto, got {text}")
    return text


def _seeds(text: str) -> tuple:
    values = [None if v.strip().lower() == "none" else int(v) for v in text.split(",")]
    if len(values) not in (1, 4):
        raise argparse.ArgumentTypeError(f"give one seed or four (python,numpy,torch,fewshot), got {text}")
    return tuple(values * 4 if len(values) == 1 else values)


def eval_tasks(args):
    try:
        from . import harness
    except ImportError as e:
        raise BriskError(f"brisk eval --tasks needs lm-evaluation-harness ({e.name} is missing): "
                         f"pip install 'brisklm[eval]'") from None
    import json
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.utils import make_table
    from .console import log, progress_bar
    if args.log_samples and not (args.output or args.output_path):
        raise BriskError("--log_samples needs --output or --output_path (where the samples go)")
    gen_kwargs = harness.parse_gen_kwargs(args.gen_kwargs)
    tasks = [t for t in args.tasks.split(",") if t]
    harness.task_names_and_paths(tasks, args.include_path)  # (a bad task file fails before loading)
    llm = _load(args)
    model_args = {"model": str(llm.name), "dtype": args.dtype, "quantize": args.quantize,
                  "groupsize": args.groupsize, "device": args.device, "max_seq_length": args.max_seq_length,
                  "kv_int8": args.kv_int8, "preset": args.preset}
    batch = "" if args.batch_size == "1" else f"; --batch_size {args.batch_size} asked, brisk runs batch 1"
    log(f"Evaluating {', '.join(tasks)} (lm-evaluation-harness, batch 1{batch})...")
    tracker = EvaluationTracker(output_path=args.output_path) if args.output_path else None
    results = harness.evaluate(llm, tasks, args.num_fewshot, args.limit, args.include_path, progress=progress_bar,
                               log_samples=args.log_samples, apply_chat_template=args.apply_chat_template,
                               system_instruction=args.system_instruction, gen_kwargs=gen_kwargs,
                               seeds=args.seed, model_args=model_args, tracker=tracker)
    samples = results.pop("samples", None)
    print(make_table(results))
    if args.output:
        kept = {k: results[k] for k in ("results", "versions", "n-shot", "config", "configs") if k in results}
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump({**kept, **({"samples": samples} if args.log_samples else {})}, f, indent=2, default=str)
    if tracker is not None:
        tracker.save_results_aggregated(results=results, samples=samples if args.log_samples else None)
        for task in results["configs"] if args.log_samples else ():
            tracker.save_results_samples(task_name=task, samples=samples[task])


def cmd_bench(args):
    from .bench import PLOT_FORMATS, main, plot
    if args.checkpoint_path and args.preset:
        raise BriskError("give either --checkpoint_path or --preset, not both")
    if args.from_json and not args.plot:
        raise BriskError("--from draws saved results: give --plot FILE too")
    if args.plot:  # (checked before minutes of benchmark, not after)
        if not args.plot.lower().endswith(PLOT_FORMATS):
            raise BriskError(f"--plot {args.plot}: name a .png or .svg file")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise BriskError('--plot needs matplotlib: pip install -e ".[plot]"') from None
    if args.from_json:
        plot([_bench_result(path) for path in args.from_json], args.plot)
        print(args.plot)
        return
    main(args)


def _bench_result(path: str) -> dict:
    import json
    try:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        raise BriskError(f"--from {path}: cannot read it as JSON ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(result, dict) or not isinstance(result.get("decode"), dict):
        raise BriskError(f"--from {path}: not a `brisk bench --json` result (no decode figures)")
    return result


def cmd_serve(args):
    import os
    try:
        from .server import model_thread, serve
    except ImportError as e:
        raise BriskError(f"brisk serve needs the server extra ({e.name} is missing): "
                         "pip install -e '.[server]'") from None
    if args.queue < 0:
        raise BriskError(f"--queue must be >= 0, got {args.queue}")
    if args.api_key is not None and not args.api_key.strip():
        raise BriskError("--api_key is empty: give a key, or leave the flag out to serve without one")
    from .server import check_address
    check_address(args.host, args.port)  # (before the model loads)
    _compiled_beside_requests(args)
    worker = model_thread()  # (the model's every op on one thread: the load and warm-up too)
    llm = worker.submit(_load, args).result()
    if llm.tokenizer is None:
        raise BriskError(f"{llm.name}: no tokenizer, nothing to serve (give a checkpoint with tokenizer files)")
    name = args.model_name or repo_id(args.checkpoint_path) or os.path.basename(str(llm.name).rstrip("/")) or "model"
    worker.submit(llm.warm_up, llm.require_tokenizer().encode("Hello"), quiet=False, wait=False).result()
    serve(llm, args.host, args.port, name, args.api_key, args.queue, worker)


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "convert": cmd_convert,
            "download": cmd_download, "list": cmd_list, "bench": cmd_bench, "quantize": cmd_quantize,
            "eval": cmd_eval, "serve": cmd_serve}


def launch_tensor_parallel(args, argv) -> int | None:
    """`--tp N` outside torchrun: run this command under torchrun, N processes."""
    if not getattr(args, "tp", None) or args.tp == 1 or "WORLD_SIZE" in os.environ:
        return None
    import subprocess
    from .tp import local_args
    if args.preset:
        from .presets import preset
        try:
            shapes = preset(args.preset)
        except KeyError as e:
            raise BriskError(str(e.args[0])) from None
    else:
        from .checkpoints import read_args
        shapes = read_args(args.checkpoint_path)
    try:  # (a model that does not split fails here, in one line, not in N processes)
        local_args(shapes, args.tp)
    except ValueError as e:
        raise BriskError(f"{args.checkpoint_path or args.preset or 'the default model'}: {e}") from None
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # (NVLink multicast stays off on shared machines)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.tp)))  # (a core each, no banner)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.tp}",
               "-m", "brisklm", *argv]
    return subprocess.run(command, env=env).returncode


@contextlib.contextmanager
def tensor_parallel(args):
    """Under torchrun (WORLD_SIZE > 1): the process group (NCCL on CUDA, gloo on
    CPUs), this rank's GPU, and quiet ranks but the first."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        yield
        return
    if args.command not in ("generate", "chat", "bench"):
        raise BriskError(f"brisk {args.command} does not run tensor-parallel yet (generate, chat and bench do)")
    if getattr(args, "tp", None) not in (None, world):
        raise BriskError(f"--tp {args.tp} but torchrun started {world} processes")
    import torch
    import torch.distributed as dist
    from .loading import default_device
    device = args.device or default_device()
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        args.device = f"cuda:{local}"
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if dist.get_rank() != 0:
        sys.stdout = sys.stderr = open(os.devnull, "w")
    try:
        yield
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        launched = launch_tensor_parallel(args, argv)
        if launched is not None:
            return launched
        with tensor_parallel(args):
            COMMANDS[args.command](args)
    except BriskError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # (the output's reader left, e.g. `| head`: as a shell's tools end)
        return 141
    except Exception as e:  # (torch is imported lazily: matched by name)
        if type(e).__name__ != "OutOfMemoryError":
            raise
        print(f"error: out of memory during `brisk {args.command}`: {str(e).splitlines()[0][:200]} "
              f"(a smaller --max_seq_length, --kv_int8 or --quantize int8/int4 needs less)", file=sys.stderr)
        return 2
    return 0


def entry():
    """The `brisk` command: main(), then an exit that skips the interpreter's
    teardown (the compiler's worker processes, the CUDA context: seconds
    after the last token), once the output is flushed."""
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # (a reader that left, e.g. `| head`)
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
