"""A fault campaign: 2-rank training runs (the real trainer and DeepSpeed engine on gloo) with faults drawn
from a seed, each run resumed after every fault until it ends, and every run's losses compared with an
uninterrupted run's, bit for bit.

    python -m tests.train.campaign --faults 200 --seed 1 --out /tmp/campaign   # docs/reliability.md's figures

Faults (KINDS): SIGKILL of one rank or of every rank at a random step; SIGKILL of rank 0 inside a save,
before the checkpoint is renamed into place or after it and before ``latest`` names it (the faults of
tests/train/faults.py); after a clean stop at a random step, a byte flipped in a random file of the newest
checkpoint (when an older one is there to fall back to: damage to the only one leaves nothing to resume),
an emptied ``latest``, or a stop file older than the next start; with root, a full disk (the
run directory on a size-limited tmpfs, filled up to the next save). Each run takes up to ``--per-run``
faults, then trains to its end. What is counted: faults by kind; runs lost (a run that started from step
0 again once it had a checkpoint, or did not end, or whose losses differ from the uninterrupted run's);
published checkpoints lost (one that was published, not damaged by a fault and not rotated out by a later
save, missing afterwards); every final loss equal. The short campaign is tests/train/test_campaign.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from megatok.run import checkpoints

KINDS = ("kill_one_rank", "kill_all_ranks", "kill_before_rename", "kill_before_latest", "flip_bytes",
         "empty_latest", "stale_stop", "full_disk")
STEPS, SAVE_EVERY, KEEP = 16, 4, 2


def args(shards: Path, run: Path) -> list[str]:
    from tests.conftest import TINY

    return ["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run}",
            f"train.max_steps={STEPS}", f"train.save_every={SAVE_EVERY}", f"train.keep_checkpoints={KEEP}",
            "train.micro_batch_size=2", "train.global_batch_size=4", "train.dist_timeout_s=30"]


def losses(run: Path) -> dict[int, str]:
    """{step: the training loss as written} of a run's metrics rows (each step once, or a ValueError)."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("split") == "train":
            if row["step"] in out:
                raise ValueError(f"{run}: step {row['step']} has two training rows")
            out[row["step"]] = repr(row["loss"])
    return out


def launch(shards: Path, run: Path, faults: dict | None = None) -> subprocess.CompletedProcess:
    """One start of ``run`` (resuming it) on 2 ranks with ``faults``; a stop file left older than the start
    must be removed with its line, not stop the run (else RuntimeError)."""
    from tests.conftest import pretrain

    stale = (run / "STOP").exists()
    r = pretrain(args(shards, run), nproc=2, check=False, faults=faults or {"MEGATOK_FAULT_NONE": "1"}, timeout=300)
    if stale and "a stop file older than this run's start" not in r.stdout:
        raise RuntimeError(f"{run}: the stale stop file was not removed at the start: {r.stdout[-1000:]}")
    return r


def published(run: Path) -> set[str]:
    return set(checkpoints.published_tags(run)) if (run / checkpoints.CHECKPOINTS).is_dir() else set()


def step_of(tag: str | None) -> int:
    return int(tag[4:]) if tag else 0


class Campaign:
    def __init__(self, out: Path, shards: Path, seed: int, per_run: int, root: bool):
        self.out, self.shards, self.rng, self.per_run = out, shards, random.Random(seed), per_run
        self.kinds = KINDS if root else KINDS[:-1]
        self.injected, self.unexpected = Counter(), []
        self.runs = self.runs_lost = self.checkpoints_lost = self.losses_equal = 0
        self.reference, self.queue = None, []

    def resumable(self, run: Path) -> str | None:
        """The checkpoint a start would resume (None: none published), or None with a note when every one
        is damaged."""
        if not published(run):
            return None
        try:
            return checkpoints.resume_tag(run, "auto", warn=False)
        except checkpoints.CheckpointError as e:
            self.note(f"{run.parent.name}: no usable checkpoint ({e})")
            return None

    def next_kind(self) -> str:
        """The kinds in a shuffled cycle: every kind once in each len(kinds) faults."""
        if not self.queue:
            self.queue = self.rng.sample(self.kinds, len(self.kinds))
        return self.queue.pop()

    def note(self, what: str) -> None:
        self.unexpected.append(what)
        print(f"campaign: UNEXPECTED: {what}", flush=True)

    def fault(self, run: Path, kind: str) -> bool:
        """Inject one fault of ``kind`` into ``run`` (its launch included where the fault is in one); False
        when the run is too near its end for one."""
        now = step_of(self.resumable(run))
        if now >= STEPS - 1:
            return False  # nothing left of this run to break: it trains to its end
        saves = [s for s in range(now + 1, STEPS) if s % SAVE_EVERY == 0]
        if kind in ("kill_before_rename", "kill_before_latest") and not saves:
            kind = "kill_all_ranks"
        step = self.rng.randint(now + 1, STEPS - 1)
        latest = checkpoints.latest_tag(run) if published(run) else None
        before = {t for t in published(run) if latest and t <= latest}  # named by ``latest`` once
        damaged = self.damaged
        if kind == "kill_one_rank":
            r = launch(self.shards, run, {"MEGATOK_FAULT_DIE_AT": f"{self.rng.randint(0, 1)}:{step}"})
        elif kind == "kill_all_ranks":
            r = launch(self.shards, run, {"MEGATOK_FAULT_DIE_AT": f"all:{step}"})
        elif kind == "kill_before_rename":
            r = launch(self.shards, run, {"MEGATOK_FAULT_DIE_IN_SAVE": str(self.rng.choice(saves))})
        elif kind == "kill_before_latest":
            r = launch(self.shards, run, {"MEGATOK_FAULT_DIE_BEFORE_LATEST": str(self.rng.choice(saves))})
        elif kind == "full_disk":  # the tmpfs the run directory is on, filled to 64 KiB of free space
            free = shutil.disk_usage(run.parent).free
            (run.parent / "filler").write_bytes(b"\0" * max(0, free - 64 * 1024))
            r = launch(self.shards, run)
            (run.parent / "filler").unlink()
        else:  # a clean stop at ``step``, then the damage between two starts
            r = launch(self.shards, run, {"MEGATOK_FAULT_STOP_AT": str(step)})
            if r.returncode != 0:
                self.note(f"{run.parent.name}: a clean stop at step {step} exited {r.returncode}: {r.stderr[-500:]}")
            newest = checkpoints.latest_tag(run)
            if kind == "flip_bytes" and len(published(run)) < 2:
                kind = "empty_latest"  # damage to the only checkpoint leaves nothing to resume, by design
            if kind == "flip_bytes" and newest:
                files = [p for p in (run / "checkpoints" / newest).iterdir() if p.is_file()]
                victim = self.rng.choice(files)
                data = bytearray(victim.read_bytes())
                data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
                victim.write_bytes(bytes(data))
                damaged.add(newest)
            elif kind == "empty_latest":
                (run / "checkpoints" / "latest").write_text("")
            elif kind == "stale_stop":
                (run / "STOP").touch()
                os.utime(run / "STOP", (time.time() - 3600, time.time() - 3600))
        self.injected[kind] += 1
        if kind in ("kill_one_rank", "kill_all_ranks", "kill_before_rename", "kill_before_latest") and \
                r.returncode == 0 and losses(run) and max(losses(run)) < STEPS:
            self.note(f"{run.parent.name}: {kind} at step {step}: the launch exited 0 before the end")
        # what was published before, and not damaged here, is there unless a later save rotated it out
        after = published(run)
        kept_by_rotation = sorted(after)[-KEEP:] if after else []
        for tag in before - damaged - after:
            if tag >= min(kept_by_rotation, default="~"):
                self.checkpoints_lost += 1
                self.note(f"{run.parent.name}: {kind} (after {', '.join(self.done)}): published checkpoint {tag} "
                          f"is gone")
        self.done.append(kind)
        return True
        if latest and self.resumable(run) is None:
            self.note(f"{run.parent.name}: {kind}: nothing left to resume (it had {latest})")

    def one_run(self, i: int, most: int) -> None:
        """Run ``i``: up to ``most`` (and ``per_run``) faults, then to its end; its losses compared."""
        run = self.out / f"run{i:03d}" / "run"
        run.parent.mkdir(parents=True)
        self.damaged, self.done = set(), []  # checkpoints this run's faults damaged; its faults so far
        if "full_disk" in self.kinds:  # a size-limited filesystem of its own
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "megatok-campaign", str(run.parent)], check=True)
        try:
            for _ in range(min(self.per_run, most)):
                kind = self.next_kind()
                if not self.fault(run, kind):
                    self.queue.append(kind)  # drawn again in the next run
                    break
            for _ in range(3):  # to its end, with no fault (a damaged checkpoint may cost a second start)
                r = launch(self.shards, run)
                if r.returncode == 0 and max(losses(run), default=0) == STEPS:
                    break
            got = losses(run)
            self.runs += 1
            if got == self.reference:
                self.losses_equal += 1
            else:
                self.runs_lost += 1
                diff = [s for s in self.reference if got.get(s) != self.reference[s]]
                self.note(f"{run.parent.name}: losses differ from the uninterrupted run's at steps {diff[:8]} "
                          f"(last rc {r.returncode}: {r.stderr[-300:]})")
        finally:
            if "full_disk" in self.kinds:
                shutil.copytree(run.parent, run.parent.with_name(run.parent.name + "-kept"),
                                ignore=shutil.ignore_patterns("*.pt"))
                subprocess.run(["umount", str(run.parent)], check=False)

    def report(self) -> dict:
        return {"faults": sum(self.injected.values()), "by_kind": dict(sorted(self.injected.items())),
                "runs": self.runs, "runs_lost": self.runs_lost, "published_checkpoints_lost": self.checkpoints_lost,
                "runs_with_equal_losses": self.losses_equal, "unexpected": self.unexpected,
                "steps_per_run": STEPS, "save_every": SAVE_EVERY, "keep_checkpoints": KEEP}


def run_campaign(out: Path, shards: Path, faults: int, seed: int, per_run: int = 4) -> dict:
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    c = Campaign(out, shards, seed, per_run, root=os.geteuid() == 0)
    ref = out / "reference"
    r = launch(shards, ref)
    if r.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed: {r.stderr[-2000:]}")
    c.reference = losses(ref)
    with tqdm(total=faults, desc="fault campaign (faults)", disable=not sys.stderr.isatty()) as bar:
        while (done := sum(c.injected.values())) < faults:
            c.one_run(c.runs, faults - done)
            bar.update(sum(c.injected.values()) - done)
            (out / "campaign.json").write_text(json.dumps({"seed": seed, **c.report()}, indent=2) + "\n")
    return {"seed": seed, **c.report()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=200, help="faults to inject in all (default 200)")
    ap.add_argument("--per-run", type=int, default=4, help="faults per run before it trains to its end")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="a directory for the runs and campaign.json")
    ap.add_argument("--shards", type=Path, help="training shards (default: built as the tests build theirs)")
    a = ap.parse_args(argv)
    shards = a.shards
    if shards is None:
        from megatok.data.shards import build_shards
        from tests.conftest import stdlib_texts

        corpus = a.out / "corpus.jsonl"
        a.out.mkdir(parents=True, exist_ok=True)
        with corpus.open("w") as f:
            for i, text in enumerate(stdlib_texts()):
                f.write(json.dumps({"text": text, "lang": "en", "domain": "code" if i % 3 else "prose"}) + "\n")
        shards = a.out / "shards"
        if not shards.is_dir():
            build_shards([str(corpus)], str(shards), val_fraction=0.1, num_shards=4, progress=False)
    report = run_campaign(a.out, shards, a.faults, a.seed, a.per_run)
    print(json.dumps(report, indent=2))
    return 0 if not report["unexpected"] else 1


if __name__ == "__main__":
    sys.exit(main())
