"""Checkpoints: DeepSpeed's own format under RUN_DIR/checkpoints/<tag>, published atomically.

A save writes everything into ``<tag>.tmp`` (DeepSpeed's model, optimizer and LR-schedule files,
plus megatok's ``megatok.json`` with the step and data layout, and per rank ``rng_rank<r>.json``
with its Python, NumPy and torch RNG states and ``stream_rank<r>.json`` with its data readers'
cursors), then rank 0 renames the directory to ``<tag>``
and only then replaces the ``latest`` pointer. A run killed at any moment therefore leaves
``latest`` on a complete checkpoint (every file is fsync'd before the rename, so this holds for a
crash of the machine too); stale ``*.tmp`` directories are removed at the next start.
Nothing is written from weights that are not finite. The newest ``keep`` checkpoints are kept.

Only JSON and DeepSpeed's files are read back; megatok's own files are never unpickled.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import zipfile
from pathlib import Path

import numpy as np
import torch

from megatok.data.stream import is_cursor

CHECKPOINTS = "checkpoints"
META = "megatok.json"


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def latest_tag(run_dir: str | Path) -> str | None:
    latest = checkpoint_dir(run_dir) / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def last_good(run_dir: str | Path) -> str:
    """The latest checkpoint's tag, or "none yet": for the line a failed run ends with."""
    return latest_tag(run_dir) or "none yet"


def set_latest(run_dir: str | Path, tag: str | None) -> None:
    """Point ``latest`` at a published checkpoint (None: no checkpoint)."""
    path = checkpoint_dir(run_dir) / "latest"
    if tag is not None:
        _write_atomic(path, tag)
    elif path.is_file():
        path.unlink()


def published_tags(run_dir: str | Path) -> list[str]:
    d = checkpoint_dir(run_dir)
    return sorted(p.name for p in d.glob("step*") if p.is_dir() and not p.name.endswith(".tmp")) if d.is_dir() else []


def rotated_out(tags: list[str], keep: int, keep_every: int | None = None) -> list[str]:
    """Of the published ``tags`` (oldest first), those a save deletes: all but the newest ``keep``,
    except those whose step is a multiple of ``keep_every``."""
    def kept_for_good(tag: str) -> bool:
        digits = tag.removeprefix("step")
        return bool(keep_every) and digits.isdigit() and int(digits) % keep_every == 0

    return [t for t in (tags[:-keep] if keep > 0 else []) if not kept_for_good(t)]


def mark_evaluated(run_dir: str | Path, tag: str) -> None:
    """Rank 0: the evaluation a checkpoint left pending (``eval_pending``) has been run and logged."""
    path = checkpoint_dir(run_dir) / tag / META
    _write_atomic(path, json.dumps({**json.loads(path.read_text()), "eval_pending": False}, indent=2))


class CheckpointError(FileNotFoundError):
    """A checkpoint that cannot be used: damaged or missing files. (A FileNotFoundError, so that every
    tool reports it in one line as it reports a missing checkpoint.)"""


def restorable(run_dir: str | Path, tag: str) -> Path:
    """Where a published checkpoint is: ``<tag>``, or the copy a killed re-save had moved aside, which
    remove_stale puts back at the next start."""
    d = checkpoint_dir(run_dir) / tag
    if not d.exists():
        for old in sorted(d.parent.glob(f"{tag}.old-*.tmp")):
            if (old / META).is_file():
                return old
    return d


def _parse_cursors(path: Path) -> dict[int, dict]:
    """A ``stream_rank<r>.json``: {reader: cursor}; ValueError unless every cursor has the stream's shape."""
    out = {}
    for r, c in json.loads(path.read_text())["cursors"].items():
        if not is_cursor(c):
            raise ValueError(f"reader {r}: not a cursor: {c}")
        out[int(r)] = c
    return out


def _archive_problem(path: Path) -> str | None:
    """torch.save's zip archive: its directory (at the end of the file) must read, so a truncated or
    emptied file fails without reading the data. The legacy format (DeepSpeed's
    ``checkpoint_serialization: false``) is checked for its pickle header only."""
    try:
        with zipfile.ZipFile(path):
            return None
    except (zipfile.BadZipFile, OSError) as exn:
        try:
            with open(path, "rb") as f:
                if f.read(2) == b"\x80\x02" and path.stat().st_size > 64:
                    return None
        except OSError:
            pass
        return f"{path.name} is damaged ({exn})"


def damage(run_dir: str | Path, tag: str) -> str | None:
    """What makes a published checkpoint unusable, or None. Checks that megatok's files read (the
    metadata, every rank's RNG states and data cursors), that every DeepSpeed file is a complete
    archive (see _archive_problem: the data itself is not read), and that a ZeRO checkpoint has one
    optimizer partition per rank of the run that wrote it. A checkpoint a killed re-save had moved
    aside counts as in place (the next start restores it)."""
    d = restorable(run_dir, tag)
    try:
        meta = json.loads((d / META).read_text())
        world = int(meta["layout"]["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as exn:
        return f"{META}: {exn}"
    for kind in ("rng_rank", "stream_rank"):  # every rank's, or none (written before cursors existed)
        have = {f.name for f in d.glob(f"{kind}*.json")}
        missing = [f"{kind}{r}.json" for r in range(world) if f"{kind}{r}.json" not in have]
        if have and missing:
            return f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} missing (written by {world} ranks)"
    for f in sorted(d.glob("rng_rank*.json")) + sorted(d.glob("stream_rank*.json")):
        try:
            _parse_cursors(f) if f.name.startswith("stream") else json.loads(f.read_text())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exn:
            return f"{f.name}: {exn}"
    files = sorted(d.glob("*.pt"))
    if not files:
        return "no DeepSpeed files"
    for f in files:
        if problem := _archive_problem(f):
            return problem
    partitions = len(list(d.glob("*_optim_states.pt")))
    if (partitions or meta.get("zero_stage", 0) >= 1) and partitions != world:  # none at all under ZeRO 1-3
        return f"{partitions} optimizer partitions for the {world} ranks that wrote it"
    return None


def resume_tag(run_dir: str | Path, requested: str, warn: bool = True) -> str | None:
    """The checkpoint to resume: ``requested`` (a tag) if it is usable, else a CheckpointError; for
    "auto", ``latest`` or, when that is damaged, the newest usable checkpoint before it (rank 0 warns:
    the damaged ones are set aside with the abandoned trajectory, not deleted), with ``warn``."""
    if requested != "auto":
        if not restorable(run_dir, requested).is_dir():
            tags = published_tags(run_dir)
            raise CheckpointError(f"{checkpoint_dir(run_dir)}: no checkpoint {requested}; "
                                  + (f"its checkpoints: {', '.join(tags)} (or --resume auto)" if tags else
                                     "it holds none (--resume auto or none starts from step 0)"))
        if problem := damage(run_dir, requested):
            raise CheckpointError(f"{checkpoint_dir(run_dir) / requested}: cannot be resumed: {problem}")
        return requested
    latest = latest_tag(run_dir)
    if latest is None:
        return None
    skipped = []
    for tag in [latest, *reversed([t for t in published_tags(run_dir) if t < latest])]:
        problem = damage(run_dir, tag)
        if problem is None:
            if skipped and warn:
                print(f"megatok: warning: skipping damaged checkpoint(s) {'; '.join(skipped)}; resuming from "
                      f"{tag}", flush=True)
            return tag
        skipped.append(f"{tag} ({problem})")
    raise CheckpointError(f"{checkpoint_dir(run_dir)}: no usable checkpoint: {'; '.join(skipped)} "
                          f"(--resume none starts over and sets them aside)")


def read_meta(run_dir: str | Path, tag: str) -> dict:
    path = checkpoint_dir(run_dir) / tag / META
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not a complete megatok checkpoint")
    return json.loads(path.read_text())


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
    saved = state["cuda"]
    if saved and torch.cuda.is_available():
        # one state: this rank's device; a list of several: one per GPU the rank saw, by device index
        i = 0 if len(saved) == 1 else torch.cuda.current_device()
        if i < len(saved):
            torch.cuda.set_rng_state(torch.tensor(saved[i], dtype=torch.uint8))


def weights_finite(engine) -> bool:
    """Collective: True when every rank's (partition of the) weights is finite."""
    import torch.distributed as dist

    ok = torch.ones((), device=engine.device)
    for p in engine.module.parameters():
        t = getattr(p, "ds_tensor", None)  # ZeRO-3 keeps each rank's partition here
        t = p if t is None else t
        if t.numel() and not torch.isfinite(t).all():
            ok.zero_()
            break
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def remove_stale(run_dir: str | Path) -> None:
    """Rank 0 at start: drop half-written ``*.tmp`` checkpoints and ``latest`` updates left by a killed or
    failed run, and ``universal-*`` conversions a killed run did not get to remove (derived copies: a
    later resume converts afresh, and must not load one made from an earlier checkpoint of the same
    step). A published checkpoint that a re-save at its step had moved aside (``<tag>.old-<pid>.tmp``)
    when the run was killed goes back in place first."""
    d = checkpoint_dir(run_dir)
    for old in sorted(d.glob("step*.old-*.tmp")) if d.is_dir() else []:
        final = d / old.name.split(".old-")[0]
        if not final.exists() and (old / META).is_file():
            os.replace(old, final)
    for p in [*d.glob("*.tmp"), *d.glob("universal-*")] if d.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)
    for p in d.glob("latest.tmp-*") if d.is_dir() else []:  # a ``latest`` update that never landed
        p.unlink(missing_ok=True)


def stream_file(rank: int) -> str:
    return f"stream_rank{rank}.json"


def read_cursors(run_dir: str | Path, tag: str, rank: int, n_sources: int) -> dict[int, dict]:
    """The data cursors of this rank's readers in a checkpoint ({} if it has none), each for
    ``n_sources`` data sources."""
    path = checkpoint_dir(run_dir) / tag / stream_file(rank)
    if not path.is_file():
        return {}
    try:
        cursors = _parse_cursors(path)
    except (ValueError, KeyError, TypeError, AttributeError) as exn:
        raise CheckpointError(f"{path}: not a megatok stream position ({exn})") from None
    if any(len(c["sources"]) != n_sources for c in cursors.values()):
        raise CheckpointError(f"{path}: cursors for another number of data sources than the {n_sources} configured")
    return cursors


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
    _write_atomic(tmp / META, json.dumps({**meta, "tag": tag}, indent=2))
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


def save(engine, run_dir: str | Path, step: int, meta: dict, keep: int = 3,
         cursors: dict[int, dict] | None = None, keep_every: int | None = None) -> str:
    """Collective: every rank calls it, with its readers' data ``cursors``. Returns the published tag.
    Afterwards the newest ``keep`` checkpoints remain, and every one whose step is a multiple of
    ``keep_every``."""
    import torch.distributed as dist

    if not weights_finite(engine):
        raise FloatingPointError(f"weights are not finite at step {step}: checkpoint not written "
                                 f"(last good: {last_good(run_dir)})")
    rank = dist.get_rank()
    ckdir, tag = checkpoint_dir(run_dir), tag_for(step)
    tmp = ckdir / f"{tag}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    try:
        engine.save_checkpoint(str(ckdir), tag=tmp.name, client_state={"megatok": meta}, save_latest=False)
        _write_atomic(tmp / f"rng_rank{rank}.json", json.dumps(rng_state()))
        if cursors:
            _write_atomic(tmp / stream_file(rank),
                          json.dumps({"cursors": {str(r): c for r, c in sorted(cursors.items())}}))
        dist.barrier()
        # One process per machine flushes what its machine wrote; every rank when the launcher does not
        # say which ranks share a machine (no LOCAL_RANK).
        if os.environ.get("LOCAL_RANK", "0") == "0":
            sync_tree(tmp)
    except (OSError, RuntimeError) as exn:  # a full disk, a quota, a lost mount: the last good one stays
        if not _write_failed(exn):
            raise
        raise _unwritten(run_dir, tmp, step, exn) from None
    dist.barrier()
    if rank == 0:
        try:
            _publish(run_dir, tmp, tag, meta)
        except OSError as exn:
            if not _write_failed(exn):
                raise
            raise _unwritten(run_dir, tmp, step, exn) from None
        for old_tag in rotated_out(published_tags(run_dir), keep, keep_every):
            if old_tag != tag:
                shutil.rmtree(ckdir / old_tag, ignore_errors=True)
        _warn_if_the_next_will_not_fit(ckdir / tag, step, keep)
    dist.barrier()
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
    """Collective. Loads a published checkpoint; returns its megatok metadata."""
    import torch.distributed as dist

    meta = read_meta(run_dir, tag)
    path, _ = engine.load_checkpoint(str(checkpoint_dir(run_dir)), tag=tag)
    if path is None:
        raise RuntimeError(f"{checkpoint_dir(run_dir) / tag}: DeepSpeed could not load this checkpoint")
    rng = checkpoint_dir(run_dir) / tag / f"rng_rank{dist.get_rank()}.json"
    if restore_rng and rng.is_file():
        set_rng_state(json.loads(rng.read_text()))
    return meta


def universal(run_dir: str | Path, tag: str, ds_config: dict) -> str:
    """Collective. Re-partition a ZeRO checkpoint for a different world size through DeepSpeed's
    universal format (rank 0 converts once into ``universal-<tag>``); switches ``ds_config`` to load
    it. Returns the tag to load. ZeRO-0 checkpoints hold full states and need no conversion."""
    import argparse

    import torch.distributed as dist

    if ds_config.get("zero_optimization", {}).get("stage", 0) == 0:
        return tag
    ckdir = checkpoint_dir(run_dir)
    out = ckdir / f"universal-{tag}"
    if dist.get_rank() == 0 and not (out / META).is_file():
        from deepspeed.checkpoint import ds_to_universal

        shutil.rmtree(out, ignore_errors=True)
        ds_to_universal.main(argparse.Namespace(
            input_folder=str(ckdir / tag), output_folder=str(out), num_extract_workers=1, num_merge_workers=1,
            keep_temp_folder=False, strict=True, inject_missing_state=True))
        shutil.copy(ckdir / tag / META, out / META)
    dist.barrier()
    ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    return out.name
