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
    model reads), which a resume checks against the config."""

    def __init__(self, train: TrainConfig, rank: int):
        self.run_dir, self.rank = Path(train.run_dir), rank
        self.every, self.keep, self.keep_every = train.save_every, train.keep_checkpoints, train.keep_every
        self.limit = (train.save_timeout_s, "train.save_timeout_s") if train.save_timeout_s else None
        self.identity: dict = {}

    def start(self, cfg: Config, resume: str, ds_config: dict) -> Start:
        """Collective. The checkpoint to resume (``resume``: "auto", "none" or a tag), chosen by rank 0 for
        every rank (their views of a shared filesystem may lag); a CheckpointError on every rank when it
        is damaged or holds another model than ``cfg`` builds. Rank 0 first removes what a killed run
        left half-written and, unless the start is refused, writes the run's config.json. A checkpoint
        of another world size is converted for this one (its ZeRO states re-partitioned), and
        ``ds_config`` switched to load that conversion."""
        world = tdist.get_world_size()
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
        return checkpoint.save(engine.ds, self.run_dir, step, {**state, **self.identity}, keep=self.keep,
                               keep_every=self.keep_every, cursors=cursors)

    def mark_evaluated(self, tag: str) -> None:
        """Rank 0: the evaluation checkpoint ``tag`` left pending has been run and logged."""
        checkpoint.mark_evaluated(self.run_dir, tag)

    def last_good(self) -> str:
        return checkpoint.last_good(self.run_dir)
