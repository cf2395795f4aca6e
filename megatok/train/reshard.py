"""A checkpoint for another number of ranks: rank 0 re-partitions a ZeRO checkpoint through DeepSpeed's
universal format once, into ``checkpoints/universal-<tag>`` (kept for later starts), while the other ranks
wait for it outside any collective, whose timeout a large conversion can exceed."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch.distributed as tdist

from megatok.run.checkpoints import META, CheckpointError, checkpoint_dir
from megatok.run.safe_load import weights_only_loads


def converted(ckdir: Path, tag: str) -> bool:
    """Whether ``universal-<tag>`` is a complete conversion of published checkpoint ``tag`` (its megatok.json,
    copied last, records the same files as the checkpoint's; or is the same file, for one saved before the
    sums were recorded)."""
    try:
        copy, source = (json.loads((ckdir / name / META).read_text()) for name in (f"universal-{tag}", tag))
    except (OSError, ValueError):
        return False
    return copy.get("files", copy) == source.get("files", source)


def _wait_for_conversion(ckdir: Path, tag: str, poll_s: float = 1.0, tell_s: float = 60.0,
                         limit_s: float = 24 * 3600) -> None:
    """Ranks other than 0: wait, outside any collective (whose timeout a large conversion can exceed), until
    rank 0 has converted ``tag`` or written why it could not."""
    failed, t0, told = ckdir / f"universal-{tag}.failed", time.monotonic(), 0.0
    while not converted(ckdir, tag):
        if failed.is_file():
            raise CheckpointError(failed.read_text().strip())
        waited = time.monotonic() - t0
        if waited > limit_s:
            raise CheckpointError(f"{ckdir / tag}: rank 0 has not converted it in {limit_s:.0f} s")
        if waited - told >= tell_s:
            told = waited
            print(f"megatok: rank {tdist.get_rank()}: waiting for rank 0 to convert {tag} ({waited:.0f} s)",
                  flush=True)
        time.sleep(poll_s)


def universal(run_dir: str | Path, tag: str, ds_config: dict) -> str:
    """Collective. Re-partition a ZeRO checkpoint for a different world size through DeepSpeed's
    universal format (rank 0 converts once into ``universal-<tag>``, kept for later starts; the other ranks
    wait for it outside the collective timeout); switches ``ds_config`` to load it. Returns the tag to
    load. ZeRO-0 checkpoints hold full states and need no conversion."""
    import argparse

    if ds_config.get("zero_optimization", {}).get("stage", 0) == 0:
        return tag
    ckdir = checkpoint_dir(run_dir)
    out, failed = ckdir / f"universal-{tag}", ckdir / f"universal-{tag}.failed"
    if tdist.get_rank() == 0:
        if not converted(ckdir, tag):
            from deepspeed.checkpoint import ds_to_universal

            failed.unlink(missing_ok=True)
            shutil.rmtree(out, ignore_errors=True)
            print(f"megatok: converting {tag} for {tdist.get_world_size()} ranks (DeepSpeed's universal format, "
                  f"into {out.name}, kept)", flush=True)
            try:
                with weights_only_loads():
                    ds_to_universal.main(argparse.Namespace(
                        input_folder=str(ckdir / tag), output_folder=str(out), num_extract_workers=1,
                        num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True))
                shutil.copy(ckdir / tag / META, out / META)  # last: marks the copy complete
            except BaseException as exn:
                why = f"{ckdir / tag}: the conversion for {tdist.get_world_size()} ranks failed on rank 0 " \
                      f"({type(exn).__name__}: {str(exn)[:300]})"
                failed.with_suffix(".tmp").write_text(why)
                os.replace(failed.with_suffix(".tmp"), failed)  # whole, for the ranks that read it
                raise
    else:
        _wait_for_conversion(ckdir, tag)
    tdist.barrier()
    ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    return out.name
