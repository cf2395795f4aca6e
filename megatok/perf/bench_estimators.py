"""Time per training step of boundary-policy estimators, against the published one
(``megatok-bench --estimators``):

    megatok-bench --estimators policy-published,policy,policy-disarm --config configs/replication/control.json

Each method of megatok.studies.replication.METHODS is the config with that method's --set items. The methods
are built once and timed in turns, as the bench's training variants are (``--reps`` rounds of ``--steps``
steps, one step of each method at a time in a rotating order; one CPU thread: process CPU time, so a shared
machine does not skew them); per method the median seconds per step and its ratio to the first method's
within each round (median and range over the rounds). Plain torch steps (megatok.perf.plain_step: the
model's forward, the estimator's losses, backward, clipping, AdamW), not the DeepSpeed engine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from megatok.perf import timing
from megatok.perf.bench import Trainee, rotated
from megatok.perf.timing import environment, summary


def run(settings, methods: list[str]) -> int:
    """Times ``methods`` on ``settings`` (megatok.perf.bench.Settings: config, overrides, device, threads,
    reps, steps, json_out); prints the table; 0, or 2 with one error line for an unknown method or a config
    that does not load."""
    from megatok.config import ConfigError, load_config
    from megatok.studies.replication import METHODS

    unknown = [m for m in methods if m not in METHODS or m == "bpe"]
    if unknown or not methods:
        print(f"error: --estimators: unknown {','.join(unknown) or '(none given)'}; choose from "
              f"{','.join(m for m in METHODS if m != 'bpe')}", file=sys.stderr)
        return 2
    device = torch.device(settings.device)
    if device.type == "cpu":
        torch.set_num_threads(settings.threads)
    timing.use_clock(device, settings.threads)
    try:
        configs = {m: load_config(settings.config, [*METHODS[m][0], *settings.overrides], world_size=1)
                   for m in methods}
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    trainees = {m: Trainee(m, cfg, device) for m, cfg in configs.items()}
    for tr in trainees.values():  # warm-up
        tr.run(1)
    rounds = []
    for r in range(settings.reps):
        got = dict.fromkeys(trainees, 0.0)
        for i in range(settings.steps):
            for m in rotated(list(trainees), r * settings.steps + i):
                got[m] += trainees[m].run(1) / settings.steps
        rounds.append(got)
        print(f"bench: round {r + 1} of {settings.reps} done", file=sys.stderr, flush=True)
    first = methods[0]
    report = {"environment": environment(device, settings.threads),
              "settings": {"config": settings.config, "overrides": settings.overrides, "reps": settings.reps,
                           "steps": settings.steps},
              "methods": {m: {"seconds_per_step": summary([g[m] for g in rounds]),
                              f"vs_{first}": summary([g[m] / g[first] for g in rounds])} for m in methods}}
    if settings.json_out:
        Path(settings.json_out).write_text(json.dumps(report, indent=2) + "\n")
    env = report["environment"]
    print(f"megatok bench --estimators, {env['date']}: {env.get('gpu') or env.get('cpu')} ({env['device']}, "
          f"{env['threads']} thread(s), {env['clock']}), {settings.config}, {settings.reps} rounds of "
          f"{settings.steps} steps\n")
    print(f"{'method':<20} {'s/step':>9} {'x ' + first:>24} {'(min-max)':>15}")
    for m, f in report["methods"].items():
        s, x = f["seconds_per_step"], f[f"vs_{first}"]
        print(f"{m:<20} {s['median']:>9.4f} {x['median']:>24.3f} {x['min']:>7.3f}-{x['max']:<7.3f}")
    return 0
