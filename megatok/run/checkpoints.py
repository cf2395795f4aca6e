"""A run directory's checkpoints, read: where they are, what their metadata holds, which are published,
whether one is damaged, which one a resume takes. No engine and no process group; the trainer writes
them (megatok.train.checkpointer).

RUN_DIR/checkpoints/<tag> holds DeepSpeed's model, optimizer and LR-schedule files, megatok's
``megatok.json`` (see :func:`parse_meta`), and per rank ``rng_rank<r>.json`` (its RNG states) and
``stream_rank<r>.json`` (its data readers' cursors); ``latest`` names the newest published one.
Only JSON is parsed here; DeepSpeed's archives are checked for completeness, not unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megatok.data.stream import is_cursor

CHECKPOINTS = "checkpoints"
META = "megatok.json"
#: The layout of megatok.json: the checkpoint's own fields, and one key per training component.
FORMAT = 2
#: The training components' parts of megatok.json, and the keys of the flat file written before the
#: parts (no "format") that each holds: {part: {flat key: its key in the part}}.
PARTS = {
    "model": {"param_shapes": "param_shapes", "model_files": "model_files"},
    "engine": {"zero_stage": "zero_stage", "precision": "precision", "skipped_in_row": "skipped_in_row",
               "optimizer_groups": "optimizer_groups"},
    "data": {k: k for k in ("layout", "epoch", "epochs", "stream_origin", "data_digest", "data_digest_spelled")},
    "metrics": {"bytes_seen": "bytes_seen", "flops": "flops"},
    "evaluation": {"eval_pending": "pending"},
}


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


def published_tags(run_dir: str | Path) -> list[str]:
    d = checkpoint_dir(run_dir)
    return sorted(p.name for p in d.glob("step*") if p.is_dir() and not p.name.endswith(".tmp")) if d.is_dir() else []


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


def parse_cursors(path: Path) -> dict[int, dict]:
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


_SUMS: dict[tuple, str] = {}  # SHA-256 by (path, inode, size, mtime): a file this process hashed, unchanged


def file_sum(path: Path) -> dict:
    """A file's size and SHA-256, as megatok.json's ``files`` records them. A file this process hashed before
    and that has not changed since (same inode, size and modification time) is not read again: the check
    before any process group and the trainer's start, in the same process, read a checkpoint's bytes once."""
    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _SUMS:
        with open(path, "rb") as f:
            _SUMS[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return {"bytes": st.st_size, "sha256": _SUMS[key]}


def summed_files(d: Path) -> list[str]:
    """The files of checkpoint directory ``d`` that megatok.json's ``files`` covers: all but itself."""
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.name != META)


def checksum_problem(d: Path, recorded: dict, sums: bool = True) -> str | None:
    """The first file of ``d`` whose size or SHA-256 differs from ``recorded`` (megatok.json's ``files``),
    or that is missing; sizes first (cheap), then (with ``sums``) the SHA-256s."""
    for name, want in sorted(recorded.items()):
        path = d / name
        if not path.is_file():
            return f"{name} missing (recorded at the save)"
        if path.stat().st_size != want["bytes"]:
            return f"{name} is damaged ({path.stat().st_size} bytes, {want['bytes']} at the save)"
    if not sums:
        return None
    names = sorted(recorded)
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:  # hashlib lets go of the GIL: files in parallel
        hashed = pool.map(lambda name: file_sum(d / name)["sha256"], names)
        for name, got in zip(names, hashed):
            if got != recorded[name]["sha256"]:
                return f"{name} is damaged (its SHA-256 differs from the one recorded at the save)"
    return None


def damage(run_dir: str | Path, tag: str, sums: bool = True) -> str | None:
    """What makes a published checkpoint unusable, or None. Checks that megatok's files read (the
    metadata, every rank's RNG states and data cursors), that every DeepSpeed file is a complete
    archive (see _archive_problem: the data itself is not read), that DeepSpeed's model states are there
    (one file, or one per rank under ZeRO-3), and that a ZeRO checkpoint has one optimizer partition per
    rank of the run that wrote it; where megatok.json records the files' sums (``files``), that every file
    has its recorded size and SHA-256 (with ``sums`` false, the sizes only). A checkpoint a killed re-save had moved
    aside counts as in place (the next start restores it)."""
    d = restorable(run_dir, tag)
    try:
        raw = json.loads((d / META).read_text())
        if isinstance(raw, dict) and (problem := self_problem(raw)):
            return problem
        meta = parse_meta((d / META).read_text())
        world = int(meta["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as exn:
        return f"{META}: {exn}"
    # every rank's RNG states; every rank's data cursors, or none (a save given no cursors writes none)
    for kind in ("rng_rank", "stream_rank"):
        have = {f.name for f in d.glob(f"{kind}*.json")}
        missing = [f"{kind}{r}.json" for r in range(world) if f"{kind}{r}.json" not in have]
        if missing and (have or kind == "rng_rank"):
            return f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} missing (written by {world} ranks)"
    for f in sorted(d.glob("rng_rank*.json")) + sorted(d.glob("stream_rank*.json")):
        try:
            parse_cursors(f) if f.name.startswith("stream") else json.loads(f.read_text())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exn:
            return f"{f.name}: {exn}"
    files = sorted(d.glob("*.pt"))
    if not files:
        return "no DeepSpeed files"
    for f in files:
        if problem := _archive_problem(f):
            return problem
    stage = int(meta.get("engine", {}).get("zero_stage", 0))
    model_files = ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)] if stage == 3
                   else ["mp_rank_00_model_states.pt"])  # ZeRO-3: every rank's; else rank 0 writes the one
    if missing := [n for n in model_files if not (d / n).is_file()]:
        return f"{', '.join(missing[:2])}{' ...' if len(missing) > 2 else ''} missing (ZeRO stage {stage}, {world} ranks)"
    partitions = len(list(d.glob("*_optim_states.pt")))
    if (partitions or stage >= 1) and partitions != world:  # none at all under ZeRO 1-3
        return f"{partitions} optimizer partitions for the {world} ranks that wrote it"
    if isinstance(meta.get("files"), dict):
        return checksum_problem(d, meta["files"], sums)
    return None


def resume_tag(run_dir: str | Path, requested: str, warn: bool = True, sums: bool = True) -> str | None:
    """The checkpoint to resume: ``requested`` (a tag, or "latest": the one checkpoints/latest names) if it is
    usable, else a CheckpointError; for "auto", ``latest`` or, when that is damaged, the newest usable
    checkpoint before it (rank 0 warns: the damaged ones are set aside with the abandoned trajectory, not
    deleted), with ``warn``, and None (a fresh start) when there is none."""
    if requested == "latest":
        requested = latest_tag(run_dir)
        if requested is None:
            raise CheckpointError(f"{checkpoint_dir(run_dir)}: --resume latest: no checkpoint yet (--resume auto "
                                  f"starts from step 0 when there is none)")
    if requested != "auto":
        if not restorable(run_dir, requested).is_dir():
            tags = published_tags(run_dir)
            raise CheckpointError(f"{checkpoint_dir(run_dir)}: no checkpoint {requested}; "
                                  + (f"its checkpoints: {', '.join(tags)} (or --resume auto)" if tags else
                                     "it holds none (--resume auto or none starts from step 0)"))
        if problem := damage(run_dir, requested, sums):
            raise CheckpointError(f"{checkpoint_dir(run_dir) / requested}: cannot be resumed: {problem}")
        return requested
    latest = latest_tag(run_dir)
    if latest is None:
        return None
    tags = published_tags(run_dir)
    if re.fullmatch(r"step\d{8}", latest) is None:  # empty or torn: the newest usable one instead
        if warn:
            print(f"megatok: warning: {checkpoint_dir(run_dir) / 'latest'} names no checkpoint "
                  f"({json.dumps(latest[:40])}); resuming from the newest usable one", flush=True)
        latest = tags[-1] if tags else None
        if latest is None:
            return None
    skipped = []
    for tag in [latest, *reversed([t for t in tags if t < latest])]:
        problem = damage(run_dir, tag, sums)
        if problem is None:
            if skipped and warn:
                print(f"megatok: warning: skipping damaged checkpoint(s) {'; '.join(skipped)}; resuming from "
                      f"{tag}", flush=True)
            return tag
        skipped.append(f"{tag} ({problem})")
    raise CheckpointError(f"{checkpoint_dir(run_dir)}: no usable checkpoint: {'; '.join(skipped)} "
                          f"(--resume none starts over and sets them aside)")


def parse_meta(text: str) -> dict:
    """A checkpoint's megatok.json, in the current layout (FORMAT)::

        {"tag": "step00000004", "format": 2, "step": 4, "world_size": 2,
         "model": {"param_shapes": {...}, "model_files": {...}},   what model it holds (checked on resume)
         "engine": {"zero_stage": 2, "precision": "fp32", "skipped_in_row": 0, "optimizer_groups": 2},
         "data": {"layout": {...}, "epoch": 0, "stream_origin": {...}, "data_digest": "...", ...},
         "metrics": {"bytes_seen": 24576.0, "flops": 4.1e9},
         "evaluation": {"pending": false},
         "files": {"mp_rank_00_model_states.pt": {"bytes": 1234, "sha256": "..."}, ...}}

    ``files``: every other file's size and SHA-256, recorded at the save (verified by :func:`damage`;
    checkpoints saved before it hold none). ``world_size``: the ranks that wrote it. Each training component's ``state_dict()`` is its part, and a
    resume gives each part back to that component alone. A flat file (as written before the parts: no
    "format") is read into this layout (PARTS says which key goes where); a ValueError for a format
    newer than this code reads."""
    meta = json.loads(text)
    if not isinstance(meta, dict):
        raise ValueError(f"not a JSON object: {text[:40]!r}")
    if "format" in meta:
        if meta["format"] > FORMAT:
            raise ValueError(f"format {meta['format']}, written by a newer megatok than this one (format {FORMAT})")
        return meta
    flat = set().union(*PARTS.values())
    out = {"format": FORMAT, **{k: v for k, v in meta.items() if k not in flat}}
    if isinstance(meta.get("layout"), dict) and "world_size" in meta["layout"]:
        out["world_size"] = meta["layout"]["world_size"]
    for part, keys in PARTS.items():
        out[part] = {key: meta[old] for old, key in keys.items() if old in meta}
    return out


SELF = "self_sha256"


def meta_text(meta: dict) -> str:
    """megatok.json's text for ``meta``, with its own digest (``self_sha256``: the SHA-256 of the rest,
    keys sorted), so that a changed byte in it is damage too (:func:`damage`)."""
    rest = {k: v for k, v in meta.items() if k != SELF}
    digest = hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()
    return json.dumps({**rest, SELF: digest}, indent=2)


def self_problem(meta: dict) -> str | None:
    """Why megatok.json's content does not match its own digest (None where it does, or has none: written
    before 2026-12-07)."""
    if "format" in meta and SELF in meta and json.loads(meta_text(meta))[SELF] != meta[SELF]:
        return f"{META} is damaged (its content differs from the digest it was written with)"
    return None


def read_meta(run_dir: str | Path, tag: str) -> dict:
    """Checkpoint ``tag``'s megatok.json, in the current layout (:func:`parse_meta`)."""
    path = checkpoint_dir(run_dir) / tag / META
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not a complete megatok checkpoint")
    return parse_meta(path.read_text())


def stream_file(rank: int) -> str:
    return f"stream_rank{rank}.json"


def read_cursors(run_dir: str | Path, tag: str, rank: int, n_sources: int) -> dict[int, dict]:
    """The data cursors of this rank's readers in a checkpoint ({} if its save was given none), each for
    ``n_sources`` data sources."""
    path = checkpoint_dir(run_dir) / tag / stream_file(rank)
    if not path.is_file():
        return {}
    try:
        cursors = parse_cursors(path)
    except (ValueError, KeyError, TypeError, AttributeError) as exn:
        raise CheckpointError(f"{path}: not a megatok stream position ({exn})") from None
    if any(len(c["sources"]) != n_sources for c in cursors.values()):
        raise CheckpointError(f"{path}: cursors for another number of data sources than the {n_sources} configured")
    return cursors


def disk_usage(run_dir: str | Path, tag: str) -> dict:
    """Bytes on disk of a checkpoint, by kind of file: DeepSpeed's model-states files (the weights; the
    whole optimizer too without ZeRO), its optimizer partitions (one per rank under ZeRO 1-3; the
    largest one, which a rank writes and reads), and megatok's JSON files with anything else."""
    d = restorable(run_dir, tag)
    if not d.is_dir():
        raise FileNotFoundError(f"{checkpoint_dir(run_dir) / tag}: checkpoint not found")
    out = {"tag": tag, "path": str(d), "files": 0, "model_states": 0, "optimizer": 0, "optimizer_files": 0,
           "largest_optimizer_file": 0, "other": 0}
    for f in sorted(p for p in d.rglob("*") if p.is_file()):
        size = f.stat().st_size
        out["files"] += 1
        if f.name.endswith("_optim_states.pt"):
            out["optimizer"] += size
            out["optimizer_files"] += 1
            out["largest_optimizer_file"] = max(out["largest_optimizer_file"], size)
        elif f.name.endswith("_model_states.pt"):
            out["model_states"] += size
        else:
            out["other"] += size
    out["total"] = out["model_states"] + out["optimizer"] + out["other"]
    return out
