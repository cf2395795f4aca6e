"""Checkpoints written, and the Checkpointer: which checkpoint a start resumes (rank 0 decides for every
rank), what a start abandons (set aside, never deleted), and every save (written by all ranks, published
atomically by rank 0, older ones rotated out). Reading them (which are published, damage, the resume
choice, megatok.json's layout) is megatok.run.checkpoints, which needs no trainer.

A save writes everything into ``<tag>.tmp`` (DeepSpeed's model, optimizer and LR-schedule files, in
DeepSpeed's own format, plus megatok's ``megatok.json``: the step, the model's identity and each training
component's state, and per rank ``rng_rank<r>.json`` with its Python, NumPy and torch RNG states and
``stream_rank<r>.json`` with its data readers' cursors), then rank 0 renames the directory to ``<tag>``
and only then replaces the ``latest`` pointer. A run killed at any moment therefore leaves
``latest`` on a complete checkpoint (every file is fsync'd before the rename, so this holds for a
crash of the machine too); stale ``*.tmp`` directories are removed at the next start.
Nothing is written from weights that are not finite. The newest ``keep`` checkpoints are kept.

Only JSON and DeepSpeed's files are read back; megatok's own files are never unpickled.
"""

from __future__ import annotations

import errno
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as tdist

from megatok.config import Config, TrainConfig
from megatok.run import same_model
from megatok.run.checkpoints import (CHECKPOINTS, FORMAT, META, CheckpointError, checkpoint_dir, file_sum,
                                     last_good, latest_tag, meta_text, parse_meta, published_tags, read_cursors,
                                     read_meta, resume_tag, stream_file, summed_files, tag_for)
from megatok.run.lock import RunDirInUse, RunLock
from megatok.run.safe_load import weights_only_loads
from megatok.train.reshard import converted, universal  # noqa: F401 - universal: the Checkpointer's start

# --------------------------------------------------------------------------- the files of a checkpoint


def set_latest(run_dir: str | Path, tag: str | None) -> None:
    """Point ``latest`` at a published checkpoint (None: no checkpoint)."""
    path = checkpoint_dir(run_dir) / "latest"
    if tag is not None:
        _write_atomic(path, tag)
    elif path.is_file():
        path.unlink()


def rotated_out(tags: list[str], keep: int, keep_every: int | None = None) -> list[str]:
    """Of the published ``tags`` (oldest first), those a save deletes: all but the newest ``keep``,
    except those whose step is a multiple of ``keep_every``."""
    def kept_for_good(tag: str) -> bool:
        digits = tag.removeprefix("step")
        return bool(keep_every) and digits.isdigit() and int(digits) % keep_every == 0

    return [t for t in (tags[:-keep] if keep > 0 else []) if not kept_for_good(t)]


def update_meta(run_dir: str | Path, tag: str, part: str, state: dict) -> None:
    """Rank 0: replace ``part`` of published checkpoint ``tag``'s megatok.json by ``state`` (the file
    rewritten atomically, in the current layout whichever it was written in)."""
    path = checkpoint_dir(run_dir) / tag / META
    _write_atomic(path, meta_text({**parse_meta(path.read_text()), part: state}))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it) durable, where the filesystem supports that (some
    FUSE and network filesystems refuse fsync on a directory: they order metadata themselves)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exn:
        if exn.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def sync_tree(path: Path) -> None:
    """fsync every file under ``path``, then every directory: DeepSpeed writes its files with torch.save,
    which leaves them in the page cache, and a checkpoint must be on disk before it is published
    (renamed into place), or a crash of the machine could publish files with missing data."""
    dirs = []
    for root, _, files in os.walk(path):
        dirs.append(Path(root))
        for name in files:
            with open(Path(root) / name, "rb") as f:
                os.fsync(f.fileno())
    for d in reversed(dirs):
        _fsync_dir(d)


def rng_state() -> dict:
    """This process's generators; of the GPUs, only its own device's (a rank sees every GPU of its
    node under the deepspeed launcher, and a resume may see another number)."""
    py = random.getstate()
    np_state = np.random.get_state()
    return {"python": [py[0], list(py[1]), py[2]],
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "torch": torch.random.get_rng_state().tolist(),
            "cuda": [torch.cuda.get_rng_state().tolist()] if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.random.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"] and torch.cuda.is_available():  # this rank's device's (rng_state)
        torch.cuda.set_rng_state(torch.tensor(state["cuda"][0], dtype=torch.uint8))


def weights_finite(engine) -> bool:
    """Collective: True when every rank's (partition of the) weights is finite."""
    ok = torch.ones((), device=engine.device)
    for p in engine.module.parameters():
        t = getattr(p, "ds_tensor", None)  # ZeRO-3 keeps each rank's partition here
        t = p if t is None else t
        if t.numel() and not torch.isfinite(t).all():
            ok.zero_()
            break
    tdist.all_reduce(ok, op=tdist.ReduceOp.MIN)
    return bool(ok.item())


def remove_stale(run_dir: str | Path) -> None:
    """Rank 0 at start: drop half-written ``*.tmp`` checkpoints and ``latest`` updates left by a killed or
    failed run, and ``universal-*`` conversions that are not complete copies of a published checkpoint
    (:func:`converted`: a resume must not load one made from an earlier checkpoint of the same step; a
    complete one is kept for the next start at the same world size). A published checkpoint that a re-save at its step had moved aside (``<tag>.old-<pid>.tmp``)
    when the run was killed goes back in place first."""
    d = checkpoint_dir(run_dir)
    for old in sorted(d.glob("step*.old-*.tmp")) if d.is_dir() else []:
        final = d / old.name.split(".old-")[0]
        if not final.exists() and (old / META).is_file():
            os.replace(old, final)
    for p in [*d.glob("*.tmp"), *d.glob("universal-*")] if d.is_dir() else []:
        if not p.name.startswith("universal-") or not converted(d, p.name.removeprefix("universal-")):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    for p in d.glob("latest.tmp-*") if d.is_dir() else []:  # a ``latest`` update that never landed
        p.unlink(missing_ok=True)



# A full disk, a quota, a file-size limit, a read-only or stale (NFS) mount, an I/O error.
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO, errno.ESTALE}


def torch_write_failed(exn: BaseException) -> bool:
    """torch.save's zip writer failing: it reports a full disk or a quota as a RuntimeError such as
    "[enforce fail at inline_container.cc:...] . unexpected pos 576 vs 534", without the file's name.
    (Its reader's errors come from the same file, "inline_container.cc", and are not write failures.)"""
    return isinstance(exn, RuntimeError) and any(s in str(exn) for s in ("unexpected pos", "PytorchStreamWriter"))


def storage_failure(exn: BaseException) -> bool:
    """Whether an error anywhere in a run is the storage failing (see STORAGE_ERRNOS), not a bug."""
    return (isinstance(exn, OSError) and exn.errno in STORAGE_ERRNOS) or torch_write_failed(exn)


def free_space(path: str | Path) -> str:
    """"12.34 GiB free on its filesystem", or "" where that cannot be read (a lost mount)."""
    try:
        return f"{shutil.disk_usage(path).free / 2**30:.2f} GiB free on its filesystem"
    except OSError:
        return ""


def _write_failed(exn: Exception) -> bool:
    """Inside a save, any OSError but a lost connection is a failed write; so is torch's writer failing."""
    if isinstance(exn, OSError):
        return not isinstance(exn, (ConnectionError, TimeoutError))
    return torch_write_failed(exn)


def _unwritten(run_dir: str | Path, tmp: Path, step: int, exn: Exception) -> CheckpointError:
    reason = str(exn).splitlines()[0] if str(exn) else type(exn).__name__
    if not isinstance(exn, OSError):
        reason = f"torch.save: {reason}"
    free = free_space(checkpoint_dir(run_dir))
    free = f"; {free}" if free else ""
    try:  # a lost mount fails here too
        latest = latest_tag(run_dir)
        last = f"the last good checkpoint is still {latest}" if latest else "and there is no earlier checkpoint"
    except OSError as again:
        last = f"`latest` cannot be read either ({again})"
    return CheckpointError(f"{tmp}: the step-{step} checkpoint could not be written ({reason}{free}); it was not "
                           f"published, {last}; the next start deletes the partial copy")


def _publish(run_dir: str | Path, tmp: Path, tag: str, meta: dict) -> None:
    """Rank 0: the metadata, the rename into place (moving aside a copy saved before at this step), then
    ``latest``, each durable before the next."""
    ckdir = tmp.parent
    _write_atomic(tmp / META, meta_text({"tag": tag, **meta}))
    final = ckdir / tag
    if final.exists():  # saved again at the same step (e.g. a pre-emption right after a save)
        old = ckdir / f"{tag}.old-{os.getpid()}.tmp"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(ckdir)
    set_latest(run_dir, tag)


def _sum_share(tmp: Path) -> dict:
    """Collective: the sizes and SHA-256 of this rank's share of the files in ``tmp`` (rank r hashes every
    world-th file of rank 0's sorted list, so the ranks read a checkpoint's bytes in parallel)."""
    names = [summed_files(tmp) if tdist.get_rank() == 0 else None]
    tdist.broadcast_object_list(names, src=0)
    rank, world = tdist.get_rank(), tdist.get_world_size()
    return {name: file_sum(tmp / name) for name in names[0][rank::world]}


def save(engine, run_dir: str | Path, step: int, meta: dict, keep: int = 3,
         cursors: dict[int, dict] | None = None, keep_every: int | None = None,
         still_ours: Callable[[], None] | None = None) -> str:
    """Collective: every rank calls it, with its readers' data ``cursors``; ``meta`` is megatok.json's
    content (run.checkpoints.parse_meta), its tag added. Returns the published tag. Afterwards the newest
    ``keep`` checkpoints remain, and every one whose step is a multiple of ``keep_every``. megatok.json,
    written last, records every other file's size and SHA-256 (``files``: verified at a resume).
    ``still_ours`` (rank 0: the run lock's verify) is called right before the checkpoint is published; what it
    raises ends every rank, the checkpoint unpublished."""
    if not weights_finite(engine):
        raise FloatingPointError(f"weights are not finite at step {step}: checkpoint not written "
                                 f"(last good: {last_good(run_dir)})")
    rank = tdist.get_rank()
    ckdir, tag = checkpoint_dir(run_dir), tag_for(step)
    tmp = ckdir / f"{tag}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    tdist.barrier()
    try:
        engine.save_checkpoint(str(ckdir), tag=tmp.name, client_state={"megatok": meta}, save_latest=False)
        _write_atomic(tmp / f"rng_rank{rank}.json", json.dumps(rng_state()))
        if cursors:
            _write_atomic(tmp / stream_file(rank),
                          json.dumps({"cursors": {str(r): c for r, c in sorted(cursors.items())}}))
        tdist.barrier()
        # One process per machine flushes what its machine wrote; every rank when the launcher does not
        # say which ranks share a machine (no LOCAL_RANK).
        if os.environ.get("LOCAL_RANK", "0") == "0":
            sync_tree(tmp)
        sums = _sum_share(tmp)
    except (OSError, RuntimeError) as exn:  # a full disk, a quota, a lost mount: the last good one stays
        if not _write_failed(exn):
            raise
        raise _unwritten(run_dir, tmp, step, exn) from None
    shares = [None] * tdist.get_world_size()
    tdist.all_gather_object(shares, sums)
    taken = [None]
    if rank == 0:
        try:
            if still_ours is not None:
                still_ours()
        except RunDirInUse as e:
            taken[0] = str(e)
    tdist.broadcast_object_list(taken, src=0)
    if taken[0]:
        raise RunDirInUse(taken[0], waitable=False)
    if rank == 0:
        try:
            _publish(run_dir, tmp, tag, {**meta, "files": {k: v for share in shares for k, v in share.items()}})
        except OSError as exn:
            if not _write_failed(exn):
                raise
            raise _unwritten(run_dir, tmp, step, exn) from None
        for old_tag in rotated_out(published_tags(run_dir), keep, keep_every):
            if old_tag != tag:
                shutil.rmtree(ckdir / old_tag, ignore_errors=True)
                shutil.rmtree(ckdir / f"universal-{old_tag}", ignore_errors=True)  # its conversion, if any
        _warn_if_the_next_will_not_fit(ckdir / tag, step, keep)
    tdist.barrier()
    return tag


def _warn_if_the_next_will_not_fit(published: Path, step: int, keep: int) -> None:
    """Rank 0 after a save: say so now, not at the next save, when the filesystem has less room than
    the checkpoint just written took (old ones are deleted only after a new one is published)."""
    try:
        size = sum(f.stat().st_size for f in published.rglob("*") if f.is_file())
        free = shutil.disk_usage(published.parent).free
    except OSError:
        return
    if free < size:
        print(f"megatok: warning: {published.parent}: {free / 2**30:.2f} GiB free, less than the "
              f"{size / 2**30:.2f} GiB the step-{step} checkpoint took: the next save will not fit (old checkpoints "
              f"are deleted only after a new one is published; train.keep_checkpoints={keep})", flush=True)


def load(engine, run_dir: str | Path, tag: str, *, restore_rng: bool = True) -> dict:
    """Collective. Loads a published checkpoint into the DeepSpeed ``engine`` (and this rank's generators,
    with ``restore_rng``); returns its megatok metadata."""
    meta = read_meta(run_dir, tag)
    with weights_only_loads():  # DeepSpeed's reads, without running code from the files
        path, _ = engine.load_checkpoint(str(checkpoint_dir(run_dir)), tag=tag)
    if path is None:
        raise RuntimeError(f"{checkpoint_dir(run_dir) / tag}: DeepSpeed could not load this checkpoint")
    rng = checkpoint_dir(run_dir) / tag / f"rng_rank{tdist.get_rank()}.json"
    if restore_rng and rng.is_file():
        set_rng_state(json.loads(rng.read_text()))
    return meta


# --------------------------------------------------------------------------- the Checkpointer


@dataclass
class Start:
    """Where a run starts: from scratch (``meta`` None), or from a published checkpoint of ``run_dir``
    (``name``), loaded as ``tag`` (``universal-<name>`` when converted for another world size), whose
    megatok.json (in the current layout) is ``meta``; and the config.json this start replaced (rank 0),
    which a set-aside trajectory keeps."""

    tag: str | None = None
    meta: dict | None = None
    previous_config: str | None = None
    run_dir: Path | None = None

    @property
    def step(self) -> int:
        return self.meta["step"] if self.meta else 0

    @property
    def name(self) -> str | None:
        """The published checkpoint's tag."""
        return self.meta["tag"] if self.meta else None

    def cursors(self, rank: int, n_sources: int) -> dict[int, dict]:
        """Rank ``rank``'s data readers' cursors in the checkpoint, each for ``n_sources`` data sources ({}
        if its save was given none); a CheckpointError if they are damaged or for other sources."""
        return read_cursors(self.run_dir, self.name, rank, n_sources)


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
    later = [t for t in published_tags(run_dir) if int(t.removeprefix("step")) > step]
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
        (aside / CHECKPOINTS).mkdir(parents=True)
        (aside / "metrics.jsonl").write_text("".join(after))
        if previous_config is not None:
            (aside / "config.json").write_text(previous_config)
        # ``latest`` first: killed halfway, the next start resumes from it and moves the rest.
        set_latest(run_dir, tag_for(step) if step else None)
        for tag in later:
            os.replace(checkpoint_dir(run_dir) / tag, aside / CHECKPOINTS / tag)
    if after:
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
    return aside


class Checkpointer:
    """RUN_DIR/checkpoints of one run: a checkpoint every train.save_every steps (and at the last step, and
    at a stop request), the newest train.keep_checkpoints kept and every train.keep_every-th for good;
    its megatok.json holds each training component's part as the trainer hands them over (:meth:`save`).
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
            remove_stale(self.run_dir)
            try:
                choice[0] = None if resume == "none" else resume_tag(self.run_dir, resume)
                if choice[0]:
                    same_model.check_same_model(self.run_dir, choice[0], cfg)
            except CheckpointError as e:
                choice[1] = str(e)
            if not choice[1]:  # a refused start leaves the run's config.json as it was
                config = self.run_dir / "config.json"
                previous = config.read_text() if config.is_file() else None
                cfg.dump(config)
        tdist.broadcast_object_list(choice, src=0)
        if choice[1]:
            raise CheckpointError(choice[1])
        if choice[0] is None:
            return Start(previous_config=previous)
        tag = choice[0]
        meta = read_meta(self.run_dir, tag)
        if meta["world_size"] != world:
            tag = universal(self.run_dir, tag, ds_config)
        return Start(tag, meta, previous, self.run_dir)

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
                problem = None
                if self.rank != 0:
                    try:
                        self.lock.join(status[1])
                    except RunDirInUse as e:
                        problem = str(e)
                problems = [None] * tdist.get_world_size()
                tdist.all_gather_object(problems, problem)  # every rank ends when one cannot share the lock
                if seen := next((p for p in problems if p), None):
                    raise RunDirInUse(seen, waitable=False)
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

    def load(self, engine, start: Start, restore_rng: bool) -> None:
        """Collective: DeepSpeed's states (model, optimizer, schedule) into the Engine ``engine``, and with
        ``restore_rng`` this rank's generators; a conversion is deleted once loaded (a copy)."""
        load(engine.ds, self.run_dir, start.tag, restore_rng=restore_rng)
        if self.rank == 0 and start.tag.startswith("universal-"):
            shutil.rmtree(checkpoint_dir(self.run_dir) / start.tag, ignore_errors=True)

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

    def save(self, engine, step: int, parts: dict[str, dict], cursors: dict[int, dict]) -> str:
        """Collective: the Engine's DeepSpeed states; megatok.json with the step, the ranks, the model's
        identity and ``parts`` (each training component's state, by its key); this rank's data
        ``cursors``. Returns the published tag."""
        self.still_ours()
        meta = {"format": FORMAT, "step": step, "world_size": tdist.get_world_size(), "model": self.identity,
                **parts}
        return save(engine.ds, self.run_dir, step, meta, keep=self.keep, keep_every=self.keep_every,
                    cursors=cursors, still_ours=self.lock.verify if self.rank == 0 else None)

    def update(self, tag: str, part: str, state: dict) -> None:
        """Rank 0: a component's state changed after checkpoint ``tag`` was published (an evaluation it left
        pending has been run): its ``part`` of the checkpoint's megatok.json becomes ``state``."""
        update_meta(self.run_dir, tag, part, state)

    def last_good(self) -> str:
        return last_good(self.run_dir)
