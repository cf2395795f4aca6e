"""The checkpointer: which checkpoint a start resumes (rank 0 decides for every rank), what a start
abandons (set aside, never deleted), and every save (written by all ranks, published atomically by
rank 0, older ones rotated out). The files themselves: megatok.train.checkpoint."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as tdist

from megatok.config import Config, TrainConfig
from megatok.run import same_model
from megatok.run.lock import RunDirInUse, RunLock
from megatok.train import checkpoint
from megatok.train.position import layout_matches


@dataclass
class Start:
    """Where a run starts: the checkpoint ``tag`` to load (None: from scratch; ``universal-<tag>`` when
    converted for another world size) with its metadata ``meta``; whether that was written with this
    run's data layout (``same_layout``: only then are the ranks' generators restored), and the
    config.json this start replaced (rank 0), which a set-aside trajectory keeps."""

    tag: str | None = None
    meta: dict | None = None
    same_layout: bool = True
    previous_config: str | None = None

    @property
    def step(self) -> int:
        return self.meta["step"] if self.meta else 0


def _row_step(line: str) -> float:
    """A metrics row's step; a row cut short by a kill counts as after every step."""
    try:
        return json.loads(line).get("step", 0)
    except json.JSONDecodeError:
        return math.inf


def set_aside_abandoned(run_dir: Path, step: int, fresh: bool, previous_config: str | None = None) -> Path | None:
    """Rank 0 at start, resuming from ``step`` (0: a fresh start). Checkpoints after ``step`` belong to
    a trajectory this run abandons (it resumes from an earlier checkpoint, or starts over in a used
    directory): they move, with the metrics rows after ``step``, into RUN_DIR/superseded-<time>/, so
    nothing is lost and the live directory holds one trajectory (``keep_checkpoints`` prunes only it,
    ``latest`` names the resumed checkpoint). Returns that directory. Otherwise the rows after ``step``
    are replays of what the resumed run is about to redo, and are dropped; a fresh start keeps every
    earlier row aside too. The set-aside directory keeps ``previous_config`` (the config.json this start
    replaced) as its config.json."""
    later = [t for t in checkpoint.published_tags(run_dir) if int(t.removeprefix("step")) > step]
    path = run_dir / "metrics.jsonl"
    rows = [line for line in path.read_text().splitlines(keepends=True) if line.strip()] if path.is_file() else []
    keep, after = [], []
    for line in rows:
        (after if fresh or _row_step(line) > step else keep).append(line)
    aside = None
    if later or (fresh and rows):
        aside = run_dir / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
        while aside.exists():
            aside = aside.with_name(aside.name + "+")
        (aside / checkpoint.CHECKPOINTS).mkdir(parents=True)
        (aside / "metrics.jsonl").write_text("".join(after))
        if previous_config is not None:
            (aside / "config.json").write_text(previous_config)
        # ``latest`` first: killed halfway, the next start resumes from it and moves the rest.
        checkpoint.set_latest(run_dir, checkpoint.tag_for(step) if step else None)
        for tag in later:
            os.replace(checkpoint.checkpoint_dir(run_dir) / tag, aside / checkpoint.CHECKPOINTS / tag)
    if after:
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
    return aside


class Checkpointer:
    """RUN_DIR/checkpoints of one run: a checkpoint every train.save_every steps (and at the last step, and
    at a stop request), the newest train.keep_checkpoints kept and every train.keep_every-th for good.
    A save may take train.save_timeout_s (``limit``) before the watchdog ends the run. Every checkpoint
    records what model it holds (``identity``: the parameters' shapes and the digests of the files the
    model reads), which a resume checks against the config. The run holds the run directory's lock
    (megatok.run.lock) from its start to its end: one writer per run directory."""

    def __init__(self, train: TrainConfig, rank: int):
        self.run_dir, self.rank = Path(train.run_dir), rank
        self.every, self.keep, self.keep_every = train.save_every, train.keep_checkpoints, train.keep_every
        self.limit = (train.save_timeout_s, "train.save_timeout_s") if train.save_timeout_s else None
        self.identity: dict = {}
        self.lock = RunLock(self.run_dir)

    def start(self, cfg: Config, resume: str, ds_config: dict, lock_wait_s: float = 0.0) -> Start:
        """Collective. The run directory's lock first (:meth:`take_lock`). The checkpoint to resume
        (``resume``: "auto", "none" or a tag), chosen by rank 0 for every rank (their views of a shared
        filesystem may lag); a CheckpointError on every rank when it is damaged or holds another model
        than ``cfg`` builds. Rank 0 first removes what a killed run left half-written and, unless the
        start is refused, writes the run's config.json. A checkpoint of another world size is converted
        for this one (its ZeRO states re-partitioned), and ``ds_config`` switched to load that conversion."""
        world = tdist.get_world_size()
        self.take_lock(lock_wait_s)
        self.identity = {"param_shapes": same_model.model_shapes(cfg), "model_files": same_model.model_files(cfg)}
        choice, previous = [None, None], None
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            checkpoint.remove_stale(self.run_dir)
            try:
                choice[0] = None if resume == "none" else checkpoint.resume_tag(self.run_dir, resume)
                if choice[0]:
                    same_model.check_same_model(self.run_dir, choice[0], cfg)
            except checkpoint.CheckpointError as e:
                choice[1] = str(e)
            if not choice[1]:  # a refused start leaves the run's config.json as it was
                config = self.run_dir / "config.json"
                previous = config.read_text() if config.is_file() else None
                cfg.dump(config)
        tdist.broadcast_object_list(choice, src=0)
        if choice[1]:
            raise checkpoint.CheckpointError(choice[1])
        if choice[0] is None:
            return Start(previous_config=previous)
        tag = choice[0]
        meta = checkpoint.read_meta(self.run_dir, tag)
        same_layout = layout_matches(meta["layout"], cfg, world)
        if not same_layout and meta["layout"]["world_size"] != world:
            tag = checkpoint.universal(self.run_dir, tag, ds_config)
        return Start(tag, meta, same_layout, previous)

    def take_lock(self, wait_s: float = 0.0, round_s: float = 10.0) -> None:
        """Collective: rank 0 takes the run directory's lock, waiting up to ``wait_s`` seconds for another
        run on it to end, in rounds of at most ``round_s`` seconds that every rank follows (no collective
        waits longer); then every other rank holds its share. RunDirInUse on every rank if it is not free."""
        deadline, told = time.monotonic() + wait_s, []

        def tell(why: str) -> None:
            if not told:
                print(f"megatok: {why}; waiting up to {wait_s:g} s for it to end", flush=True)
                told.append(why)

        while True:
            status = [None, None, True]  # ("held", token) or ("wait" | "refused", why, waitable)
            if self.rank == 0:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                try:
                    previous = self.lock.acquire(min(round_s, max(0.0, deadline - time.monotonic())), tell)
                    status = ["held", self.lock.token, True]
                    if previous:
                        print(f"megatok: {self.run_dir}: took over the lock of a run that ended without releasing "
                              f"it ({previous})", flush=True)
                except RunDirInUse as e:
                    status = ["wait" if e.waitable and time.monotonic() < deadline else "refused", str(e), e.waitable]
            tdist.broadcast_object_list(status, src=0)
            if status[0] == "held":
                if self.rank != 0:
                    self.lock.join(status[1])
                return
            if status[0] == "refused":
                raise RunDirInUse(status[1], waitable=status[2])

    def still_ours(self) -> None:
        """Collective, before a save: rank 0 checks that the run directory's lock still names this run
        (RunDirInUse on every rank if another run took it over)."""
        problem = [None]
        if self.rank == 0:
            try:
                self.lock.verify()
            except RunDirInUse as e:
                problem[0] = str(e)
        tdist.broadcast_object_list(problem, src=0)
        if problem[0]:
            raise RunDirInUse(problem[0], waitable=False)

    def release_lock(self) -> None:
        """The run ended cleanly (every rank; rank 0 after the others, see Trainer.close)."""
        self.lock.release()

    def load(self, engine, start: Start) -> None:
        """Collective: DeepSpeed's states (model, optimizer, schedule) into the Engine ``engine``, and this
        rank's generators where the layout is the same; a conversion is deleted once loaded (a copy)."""
        checkpoint.load(engine.ds, self.run_dir, start.tag, restore_rng=start.same_layout)
        if self.rank == 0 and start.tag.startswith("universal-"):
            shutil.rmtree(checkpoint.checkpoint_dir(self.run_dir) / start.tag, ignore_errors=True)

    def set_aside(self, start: Start) -> None:
        """Rank 0: what this start abandons moves to RUN_DIR/superseded-<time>/ (set_aside_abandoned)."""
        if self.rank != 0:
            return
        aside = set_aside_abandoned(self.run_dir, start.step, fresh=start.meta is None,
                                    previous_config=start.previous_config)
        if aside:
            where = f"resuming from step {start.step}" if start.meta else "starting from step 0"
            print(f"megatok: {where}; the later checkpoints and metrics are kept in {aside}", flush=True)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, engine, step: int, state: dict, cursors: dict[int, dict]) -> str:
        """Collective: the Engine's DeepSpeed states, ``state`` (the trainer's components') and the model's
        identity in megatok.json, this rank's data ``cursors``; returns the published tag."""
        self.still_ours()
        return checkpoint.save(engine.ds, self.run_dir, step, {**state, **self.identity}, keep=self.keep,
                               keep_every=self.keep_every, cursors=cursors)

    def mark_evaluated(self, tag: str) -> None:
        """Rank 0: the evaluation checkpoint ``tag`` left pending has been run and logged."""
        checkpoint.mark_evaluated(self.run_dir, tag)

    def last_good(self) -> str:
        return checkpoint.last_good(self.run_dir)
