"""lm-evaluation-harness on a loaded model: `brisk eval --tasks ...`.

`BriskLM` is the harness's model interface (lm_eval.api.model.LM) over one
`api.LLM`, at batch size 1 on the engine itself:

- loglikelihood(context, continuation): one forward over the tokens of
  context + continuation, through `LLM.score`, which reuses the keys and
  values of a prefix the cache already holds (a question's choices share
  its context, so each choice costs only its own tokens);
- loglikelihood_rolling(text): the whole text, conditioned on the BOS token
  (or the end token where a model has none), in windows as lm-eval's hf model
  lays them out (lm_eval.utils.get_rolling_token_windows: each token predicted
  once, the last window given a full context), so a text of any length scores;
- a request longer than the cache keeps its last max_length inputs and the
  token they predict, as the hf model does;
- generate_until(context, {until, max_gen_toks, temperature, ...}): the
  engine's own generation, stopping before any `until` string.

Tasks come from the harness's registry or, offline, from YAML files of your
own (`--tasks my_task.yaml` or `--include_path DIR`), whose datasets may be
local JSON/JSONL files (`dataset_path: json`, `dataset_kwargs: {data_files: ...}`,
a relative path read from the YAML's folder). Chat templates (the model's own)
and lm-eval's options (samples logged, system instruction, gen_kwargs, seeds)
pass through to lm_eval.simple_evaluate.
lm-eval is an optional dependency: pip install "brisklm[eval]".
"""
from __future__ import annotations

import json
import os

from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from .errors import BriskError


class BriskLM(LM):
    def __init__(self, llm, progress=None):
        super().__init__()
        self.llm, self.tok = llm, llm.require_tokenizer()
        self.progress = progress or (lambda done, total: None)
        self.max_length = llm.generator.max_seq_length
        self.prefix_id = self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_ids[0]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_bos=False)

    def bos(self, ids: list[int]) -> list[int]:
        """The BOS to put before ids, where the tokenizer adds one and the text
        (a chat template's rendering) does not begin with it already."""
        wanted = self.tok.add_bos and self.tok.bos_id is not None and ids[:1] != [self.tok.bos_id]
        return [self.prefix_id] if wanted else []

    @property
    def tokenizer_name(self) -> str:  # (lm-eval keys its request cache by it)
        return str(self.llm.name)

    def chat_template(self, chat_template=False) -> str | None:
        return self.tok.chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        if add_generation_prompt:
            return self.llm.apply_chat_template(chat_history, True)
        # the task opens the reply itself (a gen_prefix): the text stops where that message does
        text = self.llm.apply_chat_template(chat_history, False)
        last = chat_history[-1].get("content") or ""
        at = text.rfind(last) if last else -1
        return text if at < 0 else text[:at + len(last)]

    def get_model_info(self) -> dict:
        return model_info(self.llm)

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of context and continuation, split where the whole text's
        tokens split (spaces that end the context belong to the continuation)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:  # (the prefix token stands for it)
            return [self.prefix_id], self.encode(continuation)
        whole, head = self.encode(context + continuation), self.encode(context)
        return self.bos(whole) + whole[:len(head)], whole[len(head):]

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        results = []
        for i, request in enumerate(requests):
            context, continuation = self.pair(*request.args)
            if len(continuation) > self.max_length:
                raise BriskError(f"a continuation of {len(continuation)} tokens is longer than the KV cache "
                                 f"({self.max_length}): give a larger --max_seq_length")
            # max_length inputs and the last token predicted, as lm-eval's hf model runs them
            # (the context loses its oldest tokens)
            ids = (context + continuation)[-(self.max_length + 1):]
            start = len(ids) - len(continuation)
            chosen, best = self.llm.score(ids, top=1, start=start)
            greedy = all(b[0][0] == t for b, t in zip(best, continuation))
            results.append((sum(chosen), greedy))
            self.progress(i + 1, len(requests))
        return results

    def loglikelihood_rolling(self, requests) -> list[float]:
        results = []
        for i, request in enumerate(requests):
            (text,) = request.args
            total = 0.0
            for context, targets in map(make_disjoint_window, get_rolling_token_windows(
                    self.encode(text), self.prefix_id, self.max_length, 1)):
                ids = context + targets
                total += sum(self.llm.score(ids, start=len(context))[0])
            results.append(total)
            self.progress(i + 1, len(requests))
        return results

    def generate_until(self, requests) -> list[str]:
        results = []
        for i, request in enumerate(requests):
            context, kwargs = request.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(kwargs.pop("max_gen_toks", 256))
            sampled = kwargs.pop("do_sample", False)
            temperature = float(kwargs.pop("temperature", 0.0)) if sampled else 0.0
            sampling = {k: kwargs[k] for k in ("top_p", "top_k") if k in kwargs and sampled}
            if new >= self.max_length:
                raise BriskError(f"max_gen_toks={new} leaves no room for the context in the KV cache "
                                 f"({self.max_length}): give a larger --max_seq_length or a smaller max_gen_toks")
            ids = self.encode(context)
            ids = (self.bos(ids) + ids)[-(self.max_length - new):]
            results.append("".join(self.llm.stream_ids_as_text(ids, new, until, temperature=temperature,
                                                                **sampling)))
            self.progress(i + 1, len(requests))
        return results


def model_info(llm) -> dict:
    """What the results' config says of the model: the checkpoint, dtype,
    weight formats (the quantization that runs) and cache length."""
    from .model import WeightFormat
    formats = sorted({type(m).__name__ for m in llm.model.modules() if isinstance(m, WeightFormat)})
    return {"checkpoint": str(llm.name), "model_dtype": str(llm.model.dtype).removeprefix("torch."),
            "weight_formats": formats, "model_device": str(llm.model.device),
            "max_seq_length": llm.generator.max_seq_length, "kv_int8": bool(getattr(llm.generator, "kv_int8", False)),
            "model_num_parameters": sum(p.numel() for p in llm.model.parameters()), "batch_size": 1}


def read_task_file(path: str) -> dict:
    """A task YAML's top level (lm-eval's own tags, such as !function, read as plain values)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass
    Loader.add_multi_constructor("!", lambda loader, tag, node: None)
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.load(f, Loader=Loader)  # noqa: S506 (a safe loader)
    except (OSError, yaml.YAMLError) as e:
        raise BriskError(f"{path}: cannot read task file ({str(e).splitlines()[0]})") from None
    if not isinstance(config, dict) or not isinstance(config.get("task"), str):
        raise BriskError(f"{path}: not a task file (no 'task:' name)")
    return config


def resolved_data_files(data_files, folder: str):
    """data_files (a path, a list, or a split -> path(s) dict) with relative paths read from folder."""
    if isinstance(data_files, str):
        is_url = "://" in data_files
        return data_files if is_url or os.path.isabs(data_files) else os.path.join(folder, data_files)
    if isinstance(data_files, list):
        return [resolved_data_files(f, folder) for f in data_files]
    if isinstance(data_files, dict):
        return {k: resolved_data_files(v, folder) for k, v in data_files.items()}
    return data_files


def task_specs(tasks: list[str], include_path: str | None, scratch: str | None = None) -> tuple[list, list[str]]:
    """What to ask lm-eval for, and the folders to search. A task is asked
    by name, except one whose YAML gives data_files relative to its folder
    (lm-eval would read them from the working directory): with a scratch
    folder, by the path of a YAML written there that includes it and gives
    those paths whole."""
    import glob
    paths, files = [include_path] if include_path else [], {}
    if include_path:
        for path in glob.glob(os.path.join(include_path, "**", "*.y*ml"), recursive=True):
            try:
                files.setdefault(read_task_file(path)["task"], path)
            except BriskError:  # (a group file, or one lm-eval reads its own way)
                pass
    names = []
    for task in tasks:
        if task.endswith((".yaml", ".yml")):
            name = read_task_file(task)["task"]
            files[name] = task
            folder = os.path.dirname(os.path.abspath(task))
            paths += [folder] if folder not in paths else []
            task = name
        names.append(task)
    specs = []
    for name in names:
        kwargs = read_task_file(files[name]).get("dataset_kwargs") if name in files else None
        if scratch is None or not isinstance(kwargs, dict) or "data_files" not in kwargs:
            specs.append(name)
            continue
        source = os.path.abspath(files[name])
        kwargs = {**kwargs, "data_files": resolved_data_files(kwargs["data_files"], os.path.dirname(source))}
        wrapper = os.path.join(scratch, f"{len(specs)}.yaml")
        with open(wrapper, "w", encoding="utf-8") as f:  # (JSON is YAML)
            json.dump({"include": source, "task": name, "dataset_kwargs": kwargs}, f)
        specs.append(wrapper)
    return specs, paths


def task_names_and_paths(tasks: list[str], include_path: str | None) -> tuple[list[str], list[str]]:
    """Task names to ask for, and the folders of YAML files to search: a task
    given as a .yaml path is named by its `task:` field, its folder searched."""
    return task_specs(tasks, include_path)


GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k")


def parse_gen_kwargs(text: str | None) -> dict | None:
    """--gen_kwargs as lm-eval takes it: `k=v,k=v` or a JSON object; only the
    keys generate_until reads, so a misspelt one is not silently ignored."""
    if not text:
        return None
    if text.lstrip().startswith("{"):
        try:
            given = json.loads(text)
        except json.JSONDecodeError as e:
            raise BriskError(f"--gen_kwargs {text!r}: not a JSON object ({e.msg})") from None
    else:
        given = {}
        for item in filter(None, text.split(",")):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise BriskError(f"--gen_kwargs: {item!r} is not key=value")
            given[key.strip()] = json_value(value.strip())
    if not isinstance(given, dict):
        raise BriskError(f"--gen_kwargs {text!r}: not a JSON object")
    unknown = [k for k in given if k not in GEN_KWARGS]
    if unknown:
        raise BriskError(f"--gen_kwargs: unknown key {unknown[0]!r} (brisk reads {', '.join(GEN_KWARGS)})")
    return given


def json_value(text: str):
    """A k=v value as lm-eval reads it: a number, true/false, or the text itself."""
    lowered = {"true": True, "false": False, "none": None, "null": None}
    if text.lower() in lowered:
        return lowered[text.lower()]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def task_manager(paths: list[str], names: list[str]):
    """lm-eval's TaskManager for these task names, whose loading (where a
    registered task downloads its data) fails in one line. The registered
    tasks (thousands of YAML files: seconds to index) are indexed only where
    a name is not among paths' own tasks."""
    from lm_eval.tasks import TaskManager

    class Tasks(TaskManager):
        def load(self, tasks, *args, **kwargs):
            try:
                return super().load(tasks, *args, **kwargs)
            except BriskError:
                raise
            except Exception as e:  # noqa: BLE001 (datasets, the hub client and lm-eval raise many kinds)
                names = ", ".join(t["task"] if isinstance(t, dict) else str(t) for t in tasks)
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                raise BriskError(f"task {names}: cannot load its data ({type(e).__name__}: {first}); a registered "
                                 f"task downloads it from the Hugging Face Hub (offline: give a task .yaml "
                                 f"over local files)") from None
    if paths:
        local = Tasks(include_path=paths, include_defaults=False)
        if all(name in local.all_subtasks for name in names):  # (a local group may list registered tasks)
            return local
    return Tasks(include_path=paths or None)


def evaluate(llm, tasks: list[str], num_fewshot: int | None = None, limit: int | float | None = None,
             include_path: str | None = None, progress=None, *, log_samples: bool = False,
             apply_chat_template: bool = False, system_instruction: str | None = None,
             gen_kwargs: dict | None = None, seeds: tuple | None = None, model_args: dict | None = None,
             tracker=None) -> dict:
    """The harness's results dict for these tasks on llm (with log_samples,
    its "samples": each example's requests and answers)."""
    import tempfile

    import lm_eval
    names, paths = task_names_and_paths(tasks, include_path)
    manager = task_manager(paths, names)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise BriskError(f"unknown task {unknown[0]!r} (give a registered lm-eval task, or a .yaml file)")
    if apply_chat_template and not llm.require_tokenizer().chat_template:
        raise BriskError(f"--apply_chat_template: {llm.name} has no chat template")
    seeding = dict(zip(("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed"), seeds)) \
        if seeds else {}
    model_args = model_args or {"model": str(llm.name)}
    if tracker is not None:
        tracker.general_config_tracker.log_experiment_args(
            model_source="brisk", model_args=model_args, system_instruction=system_instruction,
            chat_template=llm.require_tokenizer().chat_template if apply_chat_template else None,
            fewshot_as_multiturn=apply_chat_template)
    with tempfile.TemporaryDirectory(prefix="brisk-tasks-") as scratch:
        specs, _ = task_specs(tasks, include_path, scratch)
        results = lm_eval.simple_evaluate(
            model=BriskLM(llm, progress), tasks=specs, num_fewshot=num_fewshot, limit=limit,
            task_manager=manager, batch_size=1, log_samples=log_samples, apply_chat_template=apply_chat_template,
            fewshot_as_multiturn=apply_chat_template, system_instruction=system_instruction,
            gen_kwargs=gen_kwargs, **seeding)
    results["config"]["model"] = "brisk"
    results["config"]["model_args"] = model_args
    return results
