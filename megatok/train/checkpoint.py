"""Checkpoints written: DeepSpeed's own format under RUN_DIR/checkpoints/<tag>, published atomically.
Reading them (which are published, damage, the resume choice) is megatok.run.checkpoints.

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
from pathlib import Path

import numpy as np
import torch

# The trainer reads its run's checkpoints through these too (checkpoint.resume_tag, checkpoint.read_meta, ...).
from megatok.run.checkpoints import (CHECKPOINTS, META, CheckpointError, checkpoint_dir, damage,  # noqa: F401
                                     last_good, latest_tag, published_tags, read_cursors, read_meta, restorable,
                                     resume_tag, stream_file, tag_for)


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


def mark_evaluated(run_dir: str | Path, tag: str) -> None:
    """Rank 0: the evaluation a checkpoint left pending (``eval_pending``) has been run and logged."""
    path = checkpoint_dir(run_dir) / tag / META
    _write_atomic(path, json.dumps({**json.loads(path.read_text()), "eval_pending": False}, indent=2))


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
