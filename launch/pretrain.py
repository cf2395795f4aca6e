"""Pretrain megatok.

    deepspeed --num_gpus 2 launch/pretrain.py --config configs/tiny.json [--set train.max_steps=20 ...]
    python launch/pretrain.py --config configs/tiny.json          # one process

The config is loaded and checked (and the data located) before any process group starts: a mistake
costs one line on stderr and exit code 2, never a half-started job.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings

# DeepSpeed 0.19's ZeRO calls a torch collective that torch 2.13 marks deprecated, once per step.
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.*", category=FutureWarning)

from megatok.config import ConfigError, load_config, warnings_for  # noqa: E402
from megatok.data.documents import DataError  # noqa: E402
from megatok.sizing import positive  # noqa: E402
from megatok.cli import command_parser  # noqa: E402


def parse_args(argv=None):
    p = command_parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="JSON config (may 'extends' another)")
    p.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="override config values by dotted key, e.g. train.max_steps=20 data.shards=data/shards")
    p.add_argument("--resume", default="auto",
                   help="'auto' (the latest usable checkpoint in the run directory, if any), 'latest' (the one "
                        "checkpoints/latest names: an error if there is none or it is damaged), 'none', or a "
                        "checkpoint tag")
    p.add_argument("--wait-for-lock", type=float, default=0.0, metavar="SECONDS",
                   help="if another run holds train.run_dir, wait up to SECONDS for it to end (default: fail at "
                        "once, naming it)")
    p.add_argument("--dry-run", nargs="?", type=positive(int), const=0, default=None, metavar="RANKS",
                   help="resolve the config for RANKS ranks (default $WORLD_SIZE, else 8), build the model on the "
                        "meta device, print its size table and the DeepSpeed config, exit (no data, no process group)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved configuration (every key, defaults and derived values included, as "
                        "JSON) and exit: nothing is created, no process group starts")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return p.parse_args(argv)


def check_data(cfg) -> list[str]:
    """Everything a run reads besides the config, checked before any process group starts. Returns the
    directories it created for the run directory, deepest first (a start refused later removes them)."""
    from megatok.data.documents import list_input_files
    from megatok.data.encoding import encoding_for
    from megatok.data.stream import check_readers, resolve_sources, validation_sources

    sources, weights = resolve_sources(cfg.data.shards, "train", key="data.shards")
    validation_sources(cfg.data.shards, cfg.data.val_shards)
    names = list(cfg.data.shards) if weights else [""]
    for urls, name in zip(sources, names):
        check_readers(len(urls), int(os.environ.get("WORLD_SIZE", "1")), max(1, cfg.data.num_workers),
                      f"data.shards source {name}" if name else "")
    encoding_for(cfg)  # the tokenizer of a bpe model exists, keeps the contract and fits model.vocab_size
    if cfg.train.init_from is not None:
        from megatok.train.warm_start import source

        source(cfg)  # names a readable checkpoint
    e = cfg.eval
    if e.heldout is not None:
        for p in [e.heldout] if isinstance(e.heldout, str) else e.heldout:
            if not os.path.isdir(p) or not os.path.isfile(os.path.join(p, "manifest.json")):
                list_input_files([p])
    if e.baseline_run is not None and not os.path.isfile(os.path.join(e.baseline_run, "config.json")):
        raise ConfigError(f"eval.baseline_run: {e.baseline_run} is not a run directory (no config.json)")
    if e.bpe_tokenizer is not None:
        from megatok.bpe import TokenizerError, load_tokenizer

        try:
            load_tokenizer(e.bpe_tokenizer)
        except (FileNotFoundError, TokenizerError) as err:
            raise ConfigError(f"eval.bpe_tokenizer: {err}") from None
    made = []
    if os.environ.get("LOCAL_RANK", "0") == "0":  # the run directory: created now, or a clear line
        run_dir = cfg.train.run_dir
        d = os.path.abspath(run_dir)
        while not os.path.exists(d) and d != os.path.dirname(d):
            made.append(d)
            d = os.path.dirname(d)
        try:
            os.makedirs(run_dir, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"train.run_dir: {run_dir} cannot be created ({err.strerror or err})") from None
        if not os.access(run_dir, os.W_OK | os.X_OK):
            raise ConfigError(f"train.run_dir: {run_dir} is not writable")
    return made


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run is not None:
        from megatok.size_report import dry_run

        return dry_run(args.config, args.overrides, args.dry_run or None)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            import json

            print(json.dumps(cfg.to_dict(), indent=2))
            return 0
        made = check_data(cfg)
    except (ConfigError, DataError) as e:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # every rank finds it; one line per machine says it
            print(f"error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        for line in warnings_for(cfg):
            print(f"warning: {line}", file=sys.stderr)
    # A damaged checkpoint, or one of another model, fails here, before any process group. One process per machine reads the
    # checkpoint's files (the launchers end its siblings when it exits 2; Slurm's srun path passes
    # --kill-on-bad-exit), not every rank: that would be ranks x files reads on a shared filesystem. The
    # files' SHA-256s are read by rank 0's machine only (the others check sizes), once: rank 0's start
    # inside the trainer reuses them.
    if args.resume != "none" and os.environ.get("LOCAL_RANK", "0") == "0":
        from megatok.run.checkpoints import CheckpointError, resume_tag
        from megatok.run.same_model import check_same_model

        try:
            if tag := resume_tag(cfg.train.run_dir, args.resume, warn=False,
                                 sums=os.environ.get("RANK", "0") == "0"):
                check_same_model(cfg.train.run_dir, tag, cfg)
        except CheckpointError as e:
            print(f"error: --resume {args.resume}: {e}", file=sys.stderr)
            for d in made:  # a refused start leaves no empty run directory behind
                try:
                    os.rmdir(d)
                except OSError:  # no longer empty: something else writes there
                    break
            return 2
    return run(cfg, args.resume, args.wait_for_lock)


def run(cfg, resume: str, lock_wait_s: float = 0.0) -> int:
    """Train; turn the ways a run can end badly into one clear line and an exit code."""
    from megatok.run.checkpoints import CheckpointError
    from megatok.run.lock import RunDirInUse
    from megatok.train import dist, peers
    from megatok.train.checkpointer import free_space, storage_failure
    from megatok.train.trainer import train

    rank = os.environ.get("RANK", "0")
    try:
        row = train(cfg, resume=resume, lock_wait_s=lock_wait_s)
    except RunDirInUse as e:  # one line, from rank 0
        hint = (f"; wait for it to end, or stop it (touch {os.path.join(cfg.train.run_dir, 'STOP')}), or start "
                f"with --wait-for-lock SECONDS")
        return _die(5, f"error: train.run_dir: {e}{hint if e.waitable else ''}" if rank == "0" else None)
    except (FloatingPointError, DataError, CheckpointError) as e:
        return _die(3, f"error: rank {rank}: {_worker_message(e)}")
    except Exception as e:  # noqa: BLE001 - a lost rank shows up as many different exception types
        if storage_failure(e):  # a write outside a checkpoint (metrics, evaluation, a conversion)
            free = free_space(cfg.train.run_dir)
            free = f"; {free}" if free else ""
            if isinstance(e, OSError):  # a failed write through an open file does not name it
                what = str(e) if e.filename else f"{e} (writing under {cfg.train.run_dir}{free})"
            else:
                what = f"a write failed (torch.save: {str(e).splitlines()[0]}{free})"
            return _die(3, f"error: rank {rank}: {what}; last good checkpoint: {_last_good(cfg)}")
        if dist.address_in_use(e):  # before is_comm_failure: torch raises it as a DistNetworkError too
            return _die(2, f"error: rank {rank}: the rendezvous port {os.environ.get('MASTER_PORT', '?')} is in use "
                           f"(EADDRINUSE: another job, or a run still shutting down, listens on it); start the job "
                           f"on a free port: deepspeed --master_port PORT, or MASTER_PORT=PORT for tools/quickstart.sh "
                           f"and tools/head_to_head.sh (which pick a free one by default)")
        if not dist.is_comm_failure(e):
            return _unexpected(e, cfg, rank)
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher ending the job waits for this line
        peers.last_words()  # this line, not the watchdog's too
        who = peers.lost()  # probes the other ranks (a few seconds at most): which one is gone
        reason = str(e).splitlines()[0][:200]
        if re.search(r"time[ds]? ?out", reason, re.IGNORECASE):  # it waited; else the connection closed at once
            within = (f"train.dist_timeout_s={cfg.train.dist_timeout_s:g} s" if not cfg.train.save_timeout_s else
                      f"{cfg.train.collective_timeout_s:g} s, the larger of train.dist_timeout_s and "
                      f"train.save_timeout_s")
            reason = f"no answer within {within}: {reason}"
        who = f"another rank: {who}" if who else "another rank, which died, hung or was killed"
        return _die(4, f"error: rank {rank}: lost contact with {who} ({reason}); last good checkpoint: "
                       f"{_last_good(cfg)}")
    except BaseException as e:  # Ctrl-C before the trainer handles stop requests
        return _unexpected(e, cfg, rank)
    if row.get("stopped") and rank == "0":
        print(f"megatok: {row['stopped']} at step {row['step']}; checkpoint written; run the same command to "
              f"resume", flush=True)
    return 0


def _unexpected(e: BaseException, cfg, rank: str) -> int:
    """Anything else (a bug, running out of GPU memory): its traceback, then one line, and the process
    leaves at once. Re-raising would wait forever at exit on the data workers, which ignore SIGTERM."""
    import traceback

    import torch

    if isinstance(e, KeyboardInterrupt):
        return _die(130, f"error: rank {rank}: interrupted; last good checkpoint: {_last_good(cfg)}")
    traceback.print_exc()
    what = f"{type(e).__name__}: {_worker_message(e)}".splitlines()[0][:300]
    if isinstance(e, torch.OutOfMemoryError):
        what += (" (out of device memory: lower train.micro_batch_size (train.global_batch_size is kept by more "
                 "accumulation), set model.activation_checkpointing, or use a higher ZeRO stage or offload; "
                 "megatok-model-size estimates the memory)")
    return _die(1, f"error: rank {rank}: {what}; last good checkpoint: {_last_good(cfg)}")


def _worker_message(e: BaseException) -> str:
    """The error's own message; for one re-raised from a DataLoader worker (its text is the worker's whole
    traceback), the worker's last line, which names the shard."""
    text = str(e)
    if "Original Traceback" not in text:
        return text
    last = text.rstrip().splitlines()[-1]
    head, _, rest = last.partition(": ")
    return rest if rest and head.split(".")[-1] == type(e).__name__ else last


def _last_good(cfg) -> str:
    from megatok.run.checkpoints import last_good

    try:
        return last_good(cfg.train.run_dir)
    except Exception as e:  # noqa: BLE001 - reporting a failure must not fail
        return f"unknown ({type(e).__name__}: {e})"


def _die(code: int, message: str | None) -> int:
    """Report and leave at once: after a failure, process-group teardown itself can block. DataLoader
    workers ignore SIGTERM (a stop request is the trainer's to handle) and os._exit skips their shutdown:
    they are killed (and reaped) first, so none outlives the run and none prints after the error line."""
    import multiprocessing
    import signal

    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's DataLoader handler raises when a worker dies
        children = multiprocessing.active_children()
        for child in children:
            child.kill()
        for child in children:
            child.join(5)
    finally:  # whatever happened above, the line is printed (if any) and the process leaves
        if message:
            print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
