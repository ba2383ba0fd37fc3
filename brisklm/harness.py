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
local JSON/JSONL files (`dataset_path: json`, `dataset_kwargs: {data_files: ...}`).
lm-eval is an optional dependency: pip install "brisklm[eval]".
"""
from __future__ import annotations

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

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of context and continuation, split where the whole text's
        tokens split (spaces that end the context belong to the continuation)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:  # (the prefix token stands for it)
            return [self.prefix_id], self.encode(continuation)
        whole, head = self.encode(context + continuation), self.encode(context)
        bos = [self.prefix_id] if self.tok.add_bos else []
        return bos + whole[:len(head)], whole[len(head):]

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
            ids = self.encode(context)
            ids = ([self.prefix_id] if self.tok.add_bos else []) + ids
            ids = ids[-(self.max_length - new):]
            results.append("".join(self.llm.stream_ids_as_text(ids, new, until, temperature=temperature,
                                                                **sampling)))
            self.progress(i + 1, len(requests))
        return results


def task_names_and_paths(tasks: list[str], include_path: str | None) -> tuple[list[str], list[str]]:
    """Task names to ask for, and the folders of YAML files to search: a task
    given as a .yaml path is named by its `task:` field, its folder searched."""
    import yaml
    names, paths = [], [include_path] if include_path else []
    for task in tasks:
        if not task.endswith((".yaml", ".yml")):
            names.append(task)
            continue
        try:
            with open(task, encoding="utf-8") as f:
                config = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as e:
            raise BriskError(f"{task}: cannot read task file ({str(e).splitlines()[0]})") from None
        if not isinstance(config, dict) or not isinstance(config.get("task"), str):
            raise BriskError(f"{task}: not a task file (no 'task:' name)")
        names.append(config["task"])
        folder = os.path.dirname(os.path.abspath(task))
        paths += [folder] if folder not in paths else []
    return names, paths


def evaluate(llm, tasks: list[str], num_fewshot: int | None = None, limit: int | None = None,
             include_path: str | None = None, progress=None) -> dict:
    """The harness's results dict for these tasks on llm."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    names, paths = task_names_and_paths(tasks, include_path)
    manager = TaskManager(include_path=paths or None)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise BriskError(f"unknown task {unknown[0]!r} (give a registered lm-eval task, or a .yaml file)")
    return lm_eval.simple_evaluate(model=BriskLM(llm, progress), tasks=names, num_fewshot=num_fewshot,
                                   limit=limit, task_manager=manager)
