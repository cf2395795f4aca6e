"""megatok models in EleutherAI's lm-evaluation-harness (``lm_eval``), registered as model "megatok".

    megatok-lm-eval --model runs/my-run --tasks hellaswag,lambada_openai
    lm_eval.simple_evaluate(model=MegatokLM("exports/my-model"), tasks=[...])   # after importing this module

Both model kinds, through megatok.api (so every figure is the one ``megatok.load(...)`` gives):

- ``loglikelihood`` (multiple choice, ...): log p(continuation | context), and whether every byte (token)
  of the continuation is the model's argmax. The byte model reads context + continuation as one document
  (boundaries decided over both, as the model would read them); the BPE model tokenizes the two apart
  after moving the context's trailing spaces to the continuation, as the harness's own ``hf`` model does.
  When the two are longer than the model's window, the continuation is read in windows that end at it,
  filled on the left with as much of the context as fits (the oldest dropped first, as ``hf`` does).
- ``loglikelihood_rolling`` (perplexity tasks): ``Model.score(text).logprob``: the text read as a
  document after the model's separator, window by window as megatok-evaluate reads it, every byte
  (token) predicted once. The harness's ``bits_per_byte`` over a task's documents is then the evaluator's
  bits per byte over them (tests/eval/test_harness.py).
- ``generate_until``: megatok.generate until a stop string (``until``), the model's separator, or
  ``max_gen_toks`` x ``bytes_per_gen_tok`` bytes (default 1 for the byte model, the tokenizer's bytes per
  token for the BPE model); greedy unless ``do_sample``. Requests with the same arguments are decoded
  together, ``batch_size`` at a time, longest context first (each gets what it would alone).

``loglikelihood`` requests are scored longest first (megatok.eval.bpb batches windows of about one length).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import lm_eval
import lm_eval.models  # noqa: F401 - the harness's own models first: it loads them only into an empty registry
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from megatok.api import Model, load


@register_model("megatok")
class MegatokLM(LM):
    """``pretrained``: a run directory or an export (or ``model``: a loaded megatok.api.Model). The other
    arguments are megatok.load's; from the command line, ``--model_args pretrained=runs/x,boundary=sample``."""

    def __init__(self, pretrained: str | None = None, checkpoint: str | None = None, device: str | None = None,
                 dtype: str | None = None, boundary: str = "threshold", seed: int = 0, batch_size: int | str = 8,
                 bytes_per_gen_tok: float | None = None, model: Model | None = None, **_ignored):
        super().__init__()
        if model is None:
            if pretrained is None:
                raise ValueError("megatok: give pretrained=<run directory or export>")
            batch = int(batch_size) if str(batch_size).isdigit() else 8  # "auto": the default
            model = load(pretrained, checkpoint=checkpoint, device=device, dtype=dtype, boundary=boundary,
                         seed=int(seed), batch_size=batch)
        self.model = model
        self._device = model.device
        if bytes_per_gen_tok is None:
            bytes_per_gen_tok = 1 if model.byte_model else (model.config.model.bytes_per_token or 4)
        self.bytes_per_gen_tok = float(bytes_per_gen_tok)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for req in requests:
            context, continuation = req.args
            if not self.model.byte_model:  # the spaces before a word belong to its token
                n = len(context) - len(context.rstrip(" "))
                if n:
                    context, continuation = context[:-n], context[-n:] + continuation
            pairs.append((context, continuation))
        order = _longest_first([c + x for c, x in pairs])
        out: list = [None] * len(pairs)
        for start in tqdm(range(0, len(pairs), 256), disable=disable_tqdm or None, desc="loglikelihood"):
            part = order[start:start + 256]
            for i, res in zip(part, self.model.loglikelihoods([pairs[i] for i in part])):
                out[i] = res
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [req.args[0] for req in requests]
        scored = [t for t in texts if t]  # an empty text: log p of no byte, 0
        logprobs = []
        for start in tqdm(range(0, len(scored), 64), disable=disable_tqdm or None, desc="loglikelihood_rolling"):
            logprobs.extend(s.logprob for s in self.model.score_many(scored[start:start + 64]))
        it = iter(logprobs)
        out = [next(it) if t else 0.0 for t in texts]
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, res)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests with the same generation arguments are decoded together, longest context first,
        ``batch_size`` at a time; request i is sampled with seed model.seed + i."""
        groups: dict[str, list[int]] = {}
        settings = []
        for i, req in enumerate(requests):
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            if isinstance(until, str):
                until = [until]
            max_toks = int(kwargs.pop("max_gen_toks", 256))
            sample = bool(kwargs.pop("do_sample", False))
            setting = {"max_bytes": max(1, math.ceil(max_toks * self.bytes_per_gen_tok)),
                       "temperature": float(kwargs.pop("temperature", 1.0)) if sample else 0.0,  # greedy unless do_sample
                       "top_k": kwargs.pop("top_k", None), "top_p": kwargs.pop("top_p", None), "stop": until}
            settings.append(setting)
            groups.setdefault(repr(sorted(setting.items())), []).append(i)
        out: list = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm or None, desc="generate_until")
        size = self.model.batch_size
        for members in groups.values():
            members = [members[j] for j in _longest_first([requests[i].args[0] for i in members])]
            for lo in range(0, len(members), size):
                part = members[lo:lo + size]
                done = self.model.generate([requests[i].args[0] for i in part], **settings[part[0]],
                                           seed=[self.model.seed + i for i in part])
                for i, c in zip(part, done):
                    out[i] = c.text
                    self.cache_hook.add_partial("generate_until", requests[i].args, c.text)
                bar.update(len(part))
        bar.close()
        return out


def _longest_first(texts: list[str]) -> list[int]:
    """Indices of ``texts``, the longest (in UTF-8 bytes) first, as the harness's own models order their
    requests: a batch then holds texts of about one length, and the first batch shows the most memory."""
    return sorted(range(len(texts)), key=lambda i: -len(texts[i].encode()))


def run_tasks(model: str, tasks: list[str], *, include_path: str | None = None, checkpoint: str | None = None,
              device: str | None = None, dtype: str | None = None, boundary: str = "threshold", seed: int = 0,
              batch_size: int = 8, num_fewshot: int | None = None, limit: float | None = None,
              output: str | None = None) -> int:
    """What megatok-lm-eval does: ``tasks`` (the harness's, or YAML files under ``include_path``) on the
    run or export ``model``, the results table printed and, with ``output``, written as JSON; 0, or 2 with
    one error line for an unknown task, a missing ``include_path``, a model that cannot be loaded or a task
    whose data cannot be read (a missing file, the hub out of reach)."""
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    from megatok.config import ConfigError
    from megatok.run.export import model_source

    if include_path and not Path(include_path).is_dir():
        print(f"error: --include-path {include_path}: not a directory", file=sys.stderr)
        return 2
    try:
        model_source(model)  # before the harness indexes its tasks (seconds): a mistyped path is told at once
    except FileNotFoundError as e:
        print(f"error: --model {e}", file=sys.stderr)
        return 2
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        print(f"error: --tasks: unknown task {', '.join(unknown)} (lm-eval ls tasks lists them; your own YAML "
              f"files go under --include-path)", file=sys.stderr)
        return 2
    try:
        lm = MegatokLM(model, checkpoint=checkpoint, device=device, dtype=dtype, boundary=boundary, seed=seed,
                       batch_size=batch_size)
    except (FileNotFoundError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        results = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                          task_manager=manager, log_samples=False, random_seed=seed,
                                          numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
    except (FileNotFoundError, ConnectionError) as e:  # a task's data file, or the hub, out of reach
        print(f"error: --tasks {','.join(tasks)}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"# {model} ({lm.model.kind}{', checkpoint ' + lm.model.checkpoint if lm.model.checkpoint else ''}"
          f"{', boundaries ' + lm.model.boundary_rule if lm.model.byte_model else ''})")
    print(make_table(results))
    if output:
        out = {"model": str(model), "checkpoint": lm.model.checkpoint, "kind": lm.model.kind,
               "boundary_rule": lm.model.boundary_rule, "results": results["results"],
               "versions": results.get("versions"), "n-shot": results.get("n-shot"), "config": results.get("config")}
        Path(output).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0
