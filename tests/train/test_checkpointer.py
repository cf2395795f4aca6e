"""Checkpoints, in this process: megatok's own files in a checkpoint directory (what a restart cleans up
or restores, how the data readers' cursors are read back, what counts as damage, that a save is on disk
before it is published, the layout of megatok.json and the flat one written before it), and the
Checkpointer over the real DeepSpeed engine (a save of the components' parts, the start that resumes it)."""

import errno
import hashlib
import json
import shutil
import os
from pathlib import Path

import pytest
import torch

from megatok.config import lr_lambda
from megatok.dsconfig import deepspeed_config
from megatok.run import checkpoints
from megatok.run.same_model import model_shapes
from megatok.train import checkpointer
from megatok.train.checkpointer import Checkpointer
from tests.train.conftest import engine_step, random_batch, tiny_config, tiny_engine


def meta(step, world=1, **parts):
    """megatok.json's content (run.checkpoints.parse_meta) for a checkpoint of ``step`` by ``world`` ranks."""
    return {"format": checkpoints.FORMAT, "step": step, "world_size": world, **parts}


def published(tmp_path, name, step, world=None):
    """A checkpoint directory with megatok's metadata; with ``world``, DeepSpeed-like files too (torch.save
    archives: the model states and one ZeRO optimizer partition per rank, ZeRO-2) and every rank's RNG file."""
    d = tmp_path / "checkpoints" / name
    d.mkdir(parents=True)
    written = meta(step, world, engine={"zero_stage": 2}) if world else {"format": checkpoints.FORMAT, "step": step}
    (d / checkpoints.META).write_text(json.dumps(written))
    if world:
        torch.save({"module": {"w": torch.zeros(64)}}, d / "mp_rank_00_model_states.pt")
        for r in range(world):
            torch.save({"state": torch.ones(64)}, d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
            (d / f"rng_rank{r}.json").write_text("{}")
    return d


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def test_a_restart_removes_half_written_copies_and_restores_a_checkpoint_moved_aside(tmp_path):
    published(tmp_path, "step00000002", 2)
    # killed while re-saving step 4: the published step 4 was moved aside, the new copy not yet in place
    published(tmp_path, "step00000004.old-123.tmp", 4)
    published(tmp_path, "step00000004.tmp", 4)
    checkpointer.set_latest(tmp_path, "step00000004")
    (tmp_path / "checkpoints" / "step00000006.tmp").mkdir()  # half written, never published
    (tmp_path / "checkpoints" / "universal-step00000002").mkdir()  # a conversion left behind
    (tmp_path / "checkpoints" / "latest.tmp-99").write_text("step00000006")  # an update that never landed
    published(tmp_path, "step00000002.old-7.tmp", 2)  # moved aside, and its re-save did land
    checkpointer.remove_stale(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step00000002", "step00000004"]
    assert checkpoints.read_meta(tmp_path, checkpoints.latest_tag(tmp_path))["step"] == 4


CURSOR = {"sources": [[0, 1, 2, 9]], "read": [0], "bad_shards": 0, "offset": 7}


def test_a_checkpoints_cursors_are_read_back_or_named_when_damaged(tmp_path):
    ckpt = published(tmp_path, "step00000002", 2)
    assert checkpoints.read_cursors(tmp_path, "step00000002", 0, 1) == {}  # a save given no cursors
    (ckpt / "stream_rank0.json").write_text(json.dumps({"cursors": {"3": CURSOR}}))
    assert checkpoints.read_cursors(tmp_path, "step00000002", 0, 1) == {3: CURSOR}
    with pytest.raises(checkpoints.CheckpointError, match="another number of data sources than the 2 configured"):
        checkpoints.read_cursors(tmp_path, "step00000002", 0, 2)
    (ckpt / "stream_rank1.json").write_text('{"cursors": [')
    with pytest.raises(checkpoints.CheckpointError, match=f"{ckpt / 'stream_rank1.json'}: not a megatok stream"):
        checkpoints.read_cursors(tmp_path, "step00000002", 1, 1)


def test_damaged_checkpoints_are_named_and_auto_resume_falls_back_past_them(tmp_path, capsys):
    good = published(tmp_path, "step00000002", 2, world=2)
    assert checkpoints.damage(tmp_path, "step00000002") is None
    bad = published(tmp_path, "step00000004", 4, world=2)
    truncate(bad / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt is damaged" in checkpoints.damage(tmp_path, "step00000004")
    lost = published(tmp_path, "step00000006", 6, world=2)
    (lost / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    assert checkpoints.damage(tmp_path, "step00000006") == "1 optimizer partitions for the 2 ranks that wrote it"
    gone = published(tmp_path, "step00000007", 7, world=2)  # every partition lost: no optimizer to resume
    for f in gone.glob("*_optim_states.pt"):
        f.unlink()
    assert checkpoints.damage(tmp_path, "step00000007") == "0 optimizer partitions for the 2 ranks that wrote it"
    shutil.rmtree(gone)
    no_model = published(tmp_path, "step00000005", 5, world=2)  # DeepSpeed's model states gone
    (no_model / "mp_rank_00_model_states.pt").unlink()
    assert checkpoints.damage(tmp_path, "step00000005") == "mp_rank_00_model_states.pt missing (ZeRO stage 2, 2 ranks)"
    shutil.rmtree(no_model)
    z3 = published(tmp_path, "step00000005", 5, world=2)  # ZeRO-3: every rank writes its own model states
    written = json.loads((z3 / checkpoints.META).read_text())
    (z3 / checkpoints.META).write_text(json.dumps({**written, "engine": {"zero_stage": 3}}))
    (z3 / "mp_rank_00_model_states.pt").unlink()
    for r in range(2):
        torch.save({"module": None}, z3 / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
    assert checkpoints.damage(tmp_path, "step00000005") is None
    (z3 / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    assert checkpoints.damage(tmp_path, "step00000005") == (
        "zero_pp_rank_1_mp_rank_00_model_states.pt missing (ZeRO stage 3, 2 ranks)")
    shutil.rmtree(z3)
    (published(tmp_path, "step00000008", 8, world=1) / checkpoints.META).unlink()
    assert checkpoints.damage(tmp_path, "step00000008").startswith("megatok.json: ")

    checkpointer.set_latest(tmp_path, "step00000006")
    assert checkpoints.resume_tag(tmp_path, "auto") == "step00000002"  # past the damaged 6 and 4
    warning = capsys.readouterr().out
    assert "skipping damaged checkpoint(s) step00000006 (1 optimizer partitions" in warning
    assert "step00000004 (zero_pp_rank_1" in warning and "resuming from step00000002" in warning
    assert checkpoints.resume_tag(tmp_path, "auto", warn=False) == "step00000002" and not capsys.readouterr().out
    assert checkpoints.resume_tag(tmp_path, "step00000002") == "step00000002"
    with pytest.raises(checkpoints.CheckpointError, match="step00000006: cannot be resumed: 1 optimizer partitions"):
        checkpoints.resume_tag(tmp_path, "latest")  # what checkpoints/latest names, damaged: no fallback
    checkpointer.set_latest(tmp_path, "step00000002")
    assert checkpoints.resume_tag(tmp_path, "latest") == "step00000002"
    checkpointer.set_latest(tmp_path, "step00000006")
    with pytest.raises(checkpoints.CheckpointError, match=f"{bad}: cannot be resumed: zero_pp_rank_1"):
        checkpoints.resume_tag(tmp_path, "step00000004")
    truncate(good / "mp_rank_00_model_states.pt")
    with pytest.raises(checkpoints.CheckpointError, match="no usable checkpoint: step00000006 .*step00000002"):
        checkpoints.resume_tag(tmp_path, "auto")
    checkpointer.set_latest(tmp_path, None)
    assert checkpoints.resume_tag(tmp_path, "auto") is None  # nothing to resume: a fresh start
    with pytest.raises(checkpoints.CheckpointError, match="--resume latest: no checkpoint yet"):
        checkpoints.resume_tag(tmp_path, "latest")


@pytest.mark.parametrize("content", ["", "\n", "step0000", "\x00\x00garbage"])
def test_an_empty_or_torn_latest_falls_back_to_the_newest_usable_checkpoint(tmp_path, capsys, content):
    published(tmp_path, "step00000002", 2, world=1)
    published(tmp_path, "step00000004", 4, world=1)
    (tmp_path / "checkpoints" / "latest").write_text(content)
    assert checkpoints.resume_tag(tmp_path, "auto") == "step00000004"
    assert f"{tmp_path / 'checkpoints' / 'latest'} names no checkpoint" in capsys.readouterr().out
    shutil.rmtree(tmp_path / "checkpoints" / "step00000004")
    assert checkpoints.resume_tag(tmp_path, "auto", warn=False) == "step00000002"
    shutil.rmtree(tmp_path / "checkpoints" / "step00000002")
    assert checkpoints.resume_tag(tmp_path, "auto", warn=False) is None  # none left: a fresh start


def test_what_else_counts_as_damage_and_what_does_not(tmp_path):
    d = published(tmp_path, "step00000002", 2, world=1)
    (d / "rng_rank0.json").write_text("{}")
    (d / "stream_rank0.json").write_text(json.dumps({"cursors": {"0": CURSOR}}))
    assert checkpoints.damage(tmp_path, "step00000002") is None
    # DeepSpeed's checkpoint_serialization=false writes torch's legacy (non-zip) format
    torch.save({"state": torch.ones(4)}, d / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
               _use_new_zipfile_serialization=False)
    assert checkpoints.damage(tmp_path, "step00000002") is None
    (d / "stream_rank0.json").write_text(json.dumps({"cursors": {"0": {**CURSOR, "offset": "7"}}}))
    assert checkpoints.damage(tmp_path, "step00000002").startswith("stream_rank0.json: reader 0: not a cursor")
    (d / "stream_rank0.json").write_text(json.dumps({"cursors": {"0": CURSOR}}))
    (d / "rng_rank0.json").write_text('{"python": [')
    assert checkpoints.damage(tmp_path, "step00000002").startswith("rng_rank0.json: ")

    # killed while re-saving step 4, its published copy moved aside: usable, restored at the next start
    aside = published(tmp_path, "step00000004.old-9.tmp", 4, world=1)
    checkpointer.set_latest(tmp_path, "step00000004")
    assert checkpoints.damage(tmp_path, "step00000004") is None
    assert checkpoints.resume_tag(tmp_path, "auto") == checkpoints.resume_tag(tmp_path, "step00000004") == "step00000004"
    checkpointer.remove_stale(tmp_path)
    assert not aside.exists() and checkpoints.read_meta(tmp_path, "step00000004")["step"] == 4


class FilesEngine:
    """What checkpointer.save needs of a DeepSpeed engine: its weights, and a save that writes files
    (into a subdirectory too, as ZeRO's universal layout does)."""
    device = torch.device("cpu")

    def __init__(self):
        self.module = torch.nn.Linear(2, 2)

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        d = Path(save_dir) / tag
        (d / "zero").mkdir(parents=True, exist_ok=True)
        torch.save(self.module.state_dict(), d / "mp_rank_00_model_states.pt")
        torch.save({"state": torch.ones(4)}, d / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        (d / "zero" / "fp32.pt").write_bytes(b"\0" * 64)


def test_every_file_of_a_checkpoint_is_on_disk_before_it_is_published(tmp_path, monkeypatch, single_rank):
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    tag = checkpointer.save(FilesEngine(), tmp_path, 3, meta(3))
    ckdir = tmp_path / "checkpoints"
    publish = events.index(("replace", str(ckdir / f"{tag}.tmp"), str(ckdir / tag)))
    synced_before = set()
    for e in events[:publish]:  # a file is on disk when it was fsync'd, or renamed after it was (megatok's)
        if e[0] == "fsync" or e[1] in synced_before:
            synced_before.add(e[-1])
    tmp = ckdir / f"{tag}.tmp"
    files = {str(tmp / p.relative_to(ckdir / tag)) for p in (ckdir / tag).rglob("*")}
    assert files and files | {str(tmp)} <= synced_before  # every file and directory, DeepSpeed's included
    # a name renamed into the directory (megatok.json) is on disk: the directory is fsync'd after it
    last_into_tmp = max(i for i, e in enumerate(events[:publish]) if e[0] == "replace")
    assert ("fsync", str(tmp)) in events[last_into_tmp:publish]
    # the rename is on disk before ``latest`` points at it, and ``latest`` itself after
    latest = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(ckdir / "latest"))
    assert ("fsync", str(ckdir)) in events[publish:latest] and ("fsync", str(ckdir)) in events[latest:]
    assert checkpoints.latest_tag(tmp_path) == tag and checkpoints.damage(tmp_path, tag) is None


class FullDiskEngine(FilesEngine):
    """The disk fills while DeepSpeed writes its second file: torch.save under a 16 KB file-size limit
    fails as on a full disk (torch's zip writer raises a RuntimeError, not an OSError); or ``error``."""

    def __init__(self, error=None):
        super().__init__()
        self.error = error

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        import resource

        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        torch.save(self.module.state_dict(), d / "mp_rank_00_model_states.pt")
        if self.error:
            raise self.error
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        # a write past it fails with EFBIG (CPython ignores SIGXFSZ, which would otherwise end the process)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16_000, limit[1]))
        try:
            torch.save({"state": torch.ones(16_000)}, d / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)


@pytest.mark.parametrize("where", ["torch.save", "deepspeed", "megatok.json", "latest"])
def test_a_checkpoint_that_cannot_be_written_is_one_error_and_keeps_the_last_good_one(tmp_path, monkeypatch,
                                                                                   single_rank, where):
    good = checkpointer.save(FilesEngine(), tmp_path, 3, meta(3))
    engine = FilesEngine()
    if where == "torch.save":
        engine = FullDiskEngine()
    elif where == "deepspeed":
        engine = FullDiskEngine(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "zero_pp_rank_0_optim_states.pt"))
    else:  # rank 0's metadata, or the ``latest`` update after the rename
        real_write = checkpointer._write_atomic

        def write(path, text):
            if path.name == {"megatok.json": checkpoints.META, "latest": "latest"}[where]:
                raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(path))
            real_write(path, text)

        monkeypatch.setattr(checkpointer, "_write_atomic", write)
    tmp = tmp_path / "checkpoints" / "step00000005.tmp"
    with pytest.raises(checkpoints.CheckpointError) as info:
        checkpointer.save(engine, tmp_path, 5, meta(5))
    message = str(info.value)
    assert message.startswith(f"{tmp}: the step-5 checkpoint could not be written (")
    assert {"torch.save": "(torch.save: [enforce fail at inline_container", "deepspeed": os.strerror(errno.ENOSPC),
            "megatok.json": os.strerror(errno.EDQUOT), "latest": os.strerror(errno.EDQUOT)}[where] in message
    assert " GiB free on its filesystem); it was not published" in message
    assert message.endswith(f"the last good checkpoint is still {good}; the next start deletes the partial copy")
    assert "\n" not in message and isinstance(info.value, FileNotFoundError)  # the tools' one-line errors
    assert checkpoints.latest_tag(tmp_path) == good and checkpoints.damage(tmp_path, good) is None
    if where == "latest":  # renamed into place, but ``latest`` still names the last good one
        assert checkpoints.published_tags(tmp_path) == [good, "step00000005"] and not tmp.exists()
        return
    assert checkpoints.published_tags(tmp_path) == [good] and tmp.is_dir()
    checkpointer.remove_stale(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", good]


def test_a_lost_mount_is_named_even_when_latest_cannot_be_read(tmp_path, monkeypatch, single_rank):
    def unreachable(run_dir):
        raise OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN), str(checkpoints.checkpoint_dir(run_dir) / "latest"))

    monkeypatch.setattr(checkpointer, "latest_tag", unreachable)
    engine = FullDiskEngine(OSError(errno.ESTALE, os.strerror(errno.ESTALE), "mp_rank_00_model_states.pt"))
    with pytest.raises(checkpoints.CheckpointError) as info:
        checkpointer.save(engine, tmp_path, 5, meta(5))
    assert f"([Errno {errno.ESTALE}] {os.strerror(errno.ESTALE)}: 'mp_rank_00_model_states.pt'; " in str(info.value)
    assert str(info.value).endswith(f"it was not published, `latest` cannot be read either ([Errno {errno.ENOTCONN}] "
                                    f"{os.strerror(errno.ENOTCONN)}: '{tmp_path / 'checkpoints' / 'latest'}'); the "
                                    f"next start deletes the partial copy")


@pytest.mark.parametrize("error", [RuntimeError("a bug"), ConnectionResetError(errno.ECONNRESET, "a rank is gone")])
def test_other_errors_in_a_save_are_not_taken_for_a_full_disk(tmp_path, single_rank, error):
    with pytest.raises(type(error)) as info:  # a lost rank stays a lost rank (exit 4), a bug a traceback
        checkpointer.save(FullDiskEngine(error), tmp_path, 5, meta(5))
    assert info.value is error and checkpoints.latest_tag(tmp_path) is None


def test_a_save_warns_when_the_next_one_will_not_fit(tmp_path, monkeypatch, capsys, single_rank):
    tag = checkpointer.save(FilesEngine(), tmp_path, 3, meta(3))
    assert "warning" not in capsys.readouterr().out  # this machine has room
    size = sum(f.stat().st_size for f in (tmp_path / "checkpoints" / tag).rglob("*") if f.is_file())
    real = checkpointer.shutil.disk_usage
    monkeypatch.setattr(checkpointer.shutil, "disk_usage",
                        lambda path: real(path)._replace(free=size // 2))  # half a checkpoint's room left
    checkpointer.save(FilesEngine(), tmp_path, 4, meta(4), keep=2)
    out = capsys.readouterr().out
    assert f"megatok: warning: {tmp_path / 'checkpoints'}: 0.00 GiB free, less than the 0.00 GiB the step-4 " \
           f"checkpoint took: the next save will not fit" in out and "train.keep_checkpoints=2" in out
    monkeypatch.setattr(checkpointer.shutil, "disk_usage", lambda path: real(path)._replace(free=2 * size))
    checkpointer.save(FilesEngine(), tmp_path, 5, meta(5))
    assert "warning" not in capsys.readouterr().out


@pytest.mark.parametrize("keep_every, left", [(None, [6, 7]), (3, [3, 6, 7]), (2, [2, 4, 6, 7])])
def test_saves_keep_the_newest_and_every_multiple_of_keep_every(tmp_path, single_rank, keep_every, left):
    for step in range(1, 8):
        checkpointer.save(FilesEngine(), tmp_path, step, meta(step), keep=2, keep_every=keep_every)
    assert checkpoints.published_tags(tmp_path) == [checkpoints.tag_for(s) for s in left]
    assert checkpoints.latest_tag(tmp_path) == "step00000007"


def test_only_step_tags_are_kept_for_good():
    tags = ["step00000002", "step00000004-copy", "step00000005", "step00000006"]
    assert checkpointer.rotated_out(tags, 1, 2) == ["step00000004-copy", "step00000005"]


def test_a_rank_saves_and_restores_only_its_own_gpus_generator(monkeypatch):
    """A rank sees all 8 GPUs of its node under the deepspeed launcher, but a resume may see fewer (4 per
    node, or one per task under srun): restoring one state per GPU then indexed a device that is not
    there. The GPU is faked: this rank's device is cuda:3, its generator state a 16-byte tensor."""
    states = {3: torch.arange(16, dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": states[3].clone())
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.zeros(16, dtype=torch.uint8)] * 8)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda t, device="cuda": states.__setitem__(3, t.clone()))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda ts: pytest.fail("restores every GPU's state"))
    saved = json.loads(json.dumps(checkpointer.rng_state()))
    assert saved["cuda"] == [list(range(16))]
    states[3] = torch.zeros(16, dtype=torch.uint8)
    checkpointer.set_rng_state(saved)
    assert states[3].tolist() == list(range(16))


#: A megatok.json as megatok wrote it before it had one part per component (of a 2-step run of the
#: tests' tiny model, two of its parameters' shapes kept).
FLAT = {"step": 2, "epoch": 0, "stream_origin": {"step": 0, "epochs": [0]}, "data_digest": "27d4b2f80306ba68",
        "data_digest_spelled": "27d4b2f80306ba68",
        "layout": {"world_size": 1, "micro_batch_size": 2, "grad_accum": 1, "num_workers": 1, "seq_len": 64, "seed": 0},
        "zero_stage": 2, "precision": "fp32", "skipped_in_row": 0, "bytes_seen": 256.0, "flops": 88008960.0,
        "eval_pending": False, "param_shapes": {"embed.weight": [258, 32], "encoder.layers.0.attn_norm.weight": [32]},
        "model_files": {}, "tag": "step00000002"}


def test_a_flat_megatok_json_is_read_into_the_parts_of_the_current_layout(tmp_path):
    assert checkpoints.parse_meta(json.dumps(FLAT)) == {
        "format": 2, "step": 2, "tag": "step00000002", "world_size": 1,
        "model": {"param_shapes": FLAT["param_shapes"], "model_files": {}},
        "engine": {"zero_stage": 2, "precision": "fp32", "skipped_in_row": 0},
        "data": {k: FLAT[k] for k in ("layout", "epoch", "stream_origin", "data_digest", "data_digest_spelled")},
        "metrics": {"bytes_seen": 256.0, "flops": 88008960.0},
        "evaluation": {"pending": False}}
    current = checkpoints.parse_meta(json.dumps(FLAT))
    assert checkpoints.parse_meta(json.dumps(current)) == current
    with pytest.raises(ValueError, match="format 3, written by a newer megatok than this one"):
        checkpoints.parse_meta(json.dumps({**current, "format": 3}))
    # an update rewrites one part, and the whole file in the current layout
    d = published(tmp_path, "step00000002", 2)
    (d / checkpoints.META).write_text(json.dumps(FLAT))
    checkpointer.update_meta(tmp_path, "step00000002", "evaluation", {"pending": True})
    rewritten = json.loads((d / checkpoints.META).read_text())
    assert rewritten == {**current, "evaluation": {"pending": True}, "self_sha256": rewritten["self_sha256"]}
    assert checkpoints.self_problem(rewritten) is None  # with its own digest again


def test_a_save_holds_each_parts_state_and_a_start_resumes_it(single_rank, shards, tmp_path):
    """The Checkpointer writes the engine's DeepSpeed states, this rank's generators and data cursors, and
    megatok.json with the step, the ranks, the model's identity and each component's part as given; a start
    of the same run directory chooses it and hands back each part, the cursors and the generators as they
    were; a resumed engine takes the config's learning rate on the saved schedule."""
    cfg = tiny_config(shards, tmp_path / "run", "train.lr=0.001")
    engine, saver = tiny_engine(cfg), Checkpointer(cfg.train, 0)
    assert saver.start(cfg, "auto", deepspeed_config(cfg, 1)).meta is None  # a fresh run directory
    for n in (1, 2):
        engine_step(engine, n, random_batch(cfg, n))
    parts = {"engine": engine.state_dict(), "data": {"epoch": 0}, "evaluation": {"pending": True}}
    tag = saver.save(engine, 2, parts, cursors={3: CURSOR})
    drawn = torch.rand(4)  # the generator as saved, drawn from
    saver.release_lock()
    d = tmp_path / "run" / "checkpoints" / tag
    written = json.loads((d / checkpoints.META).read_text())
    # every other file's size and SHA-256 (the states DeepSpeed wrote, the generators, the cursors)
    files = {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.name != checkpoints.META}
    assert set(written["files"]) == files and {"mp_rank_00_model_states.pt", "rng_rank0.json",
                                              "stream_rank0.json"} <= files
    assert written["files"]["rng_rank0.json"] == {"bytes": (d / "rng_rank0.json").stat().st_size, "sha256":
                                                  hashlib.sha256((d / "rng_rank0.json").read_bytes()).hexdigest()}
    assert written == {"tag": "step00000002", "format": checkpoints.FORMAT, "step": 2, "world_size": 1,
                       "model": {"param_shapes": model_shapes(cfg), "model_files": {}}, **parts,
                       "files": written["files"], "self_sha256": written["self_sha256"]}

    cfg = tiny_config(shards, tmp_path / "run", "train.lr=0.002")
    resumer = Checkpointer(cfg.train, 0)
    start = resumer.start(cfg, "auto", deepspeed_config(cfg, 1))
    assert (start.tag, start.name, start.step, start.meta) == (tag, tag, 2, written)
    assert start.cursors(0, 1) == {3: CURSOR} and start.cursors(1, 1) == {}
    resumed = tiny_engine(cfg)
    torch.manual_seed(99)
    resumer.load(resumed, start, restore_rng=True)
    assert torch.equal(torch.rand(4), drawn)
    for saved, loaded in zip(engine.ds.module.parameters(), resumed.ds.module.parameters()):
        assert torch.equal(saved, loaded)
    resumed.load_state_dict(start.meta["engine"])
    assert resumed.lr == 0.002 * lr_lambda(cfg)(2) and resumed.skipped_in_row == 0
    resumer.update(tag, "evaluation", {"pending": False})
    updated = checkpoints.read_meta(tmp_path / "run", tag)
    assert updated == {**written, "evaluation": {"pending": False}, "self_sha256": updated["self_sha256"]}
    assert checkpoints.damage(tmp_path / "run", tag) is None  # its own digest written anew
    torch.manual_seed(99)
    resumer.load(tiny_engine(cfg), start, restore_rng=False)  # this rank's generators left alone
    assert not torch.equal(torch.rand(4), drawn)
    resumer.release_lock()


def flip(path, at=0.5):
    """One byte inside ``path`` (by default in its middle: tensor data, not the zip directory) inverted."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


def test_bytes_damaged_inside_a_checkpoint_are_found_by_their_sums_and_auto_resume_falls_back(
        single_rank, shards, tmp_path, capsys):
    """A flipped byte inside a DeepSpeed file leaves its zip directory whole (the completeness check passes)
    but not its SHA-256, recorded at the save: the checkpoint is named damaged, with the file, and a start
    resumes the one before it; one whose size changed is found without reading it. A checkpoint saved before
    the sums were recorded is still usable."""
    cfg = tiny_config(shards, tmp_path / "run")
    engine, saver = tiny_engine(cfg), Checkpointer(cfg.train, 0)
    saver.start(cfg, "auto", deepspeed_config(cfg, 1))
    tags = []
    for n in (1, 2, 3, 4):
        engine_step(engine, n, random_batch(cfg, n))
        if n % 2 == 0:
            tags.append(saver.save(engine, n, {"engine": engine.state_dict()}, cursors={}))
    saver.release_lock()
    run = tmp_path / "run"
    d = run / "checkpoints" / tags[1]
    states = d / "mp_rank_00_model_states.pt"
    flip(states)
    assert checkpoints._archive_problem(states) is None  # the archive still reads
    assert checkpoints.damage(run, tags[1], sums=False) is None  # sizes only (the other machines' check)
    assert checkpoints.damage(run, tags[1]) == ("mp_rank_00_model_states.pt is damaged (its SHA-256 differs from "
                                                "the one recorded at the save)")
    resumer = Checkpointer(cfg.train, 0)
    start = resumer.start(cfg, "auto", deepspeed_config(cfg, 1))
    resumer.release_lock()
    assert start.tag == tags[0]
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if "skipping damaged" in ln]
    assert f"{tags[1]} (mp_rank_00_model_states.pt is damaged" in line and f"resuming from {tags[0]}" in line
    with pytest.raises(checkpoints.CheckpointError, match=f"{d}: cannot be resumed: mp_rank_00_model_states.pt"):
        checkpoints.resume_tag(run, tags[1])
    flip(states)  # back as saved
    assert checkpoints.damage(run, tags[1]) is None
    size = (d / "rng_rank0.json").stat().st_size
    with open(d / "rng_rank0.json", "a") as f:
        f.write(" ")  # still valid JSON, one byte longer
    assert checkpoints.damage(run, tags[1]) == f"rng_rank0.json is damaged ({size + 1} bytes, {size} at the save)"
    meta = json.loads((d / checkpoints.META).read_text())
    (d / checkpoints.META).write_text(json.dumps(meta, indent=2).replace('"step": 4', '"step": 5'))
    assert checkpoints.damage(run, tags[1]) == ("megatok.json is damaged (its content differs from the digest it "
                                                "was written with)")  # megatok.json itself: its own digest
    del meta["files"], meta["self_sha256"]  # as saved before the sums were recorded
    (d / checkpoints.META).write_text(json.dumps(meta))
    assert checkpoints.damage(run, tags[1]) is None


CONVERT = """
import datetime, json, os, shutil, sys, time, torch, torch.distributed as dist
from pathlib import Path
from deepspeed.checkpoint import ds_to_universal
from megatok.train import checkpointer
rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
run = Path(os.environ["RUN"])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))  # connecting on a busy machine
dist.barrier()
dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=5))  # then collectives time out after 5 s
calls = []
def slow(args):  # a conversion longer than the collective timeout
    calls.append(args.input_folder)
    time.sleep(12)
    Path(args.output_folder).mkdir()
    if os.environ.get("FAIL"):
        raise RuntimeError("no space left")
ds_to_universal.main = slow
ds = {"zero_optimization": {"stage": 2}}
try:
    result = {"tag": checkpointer.universal(run, "step00000002", ds), "ds": ds, "calls": calls}
except Exception as e:
    result = {"error": f"{type(e).__name__}: {e}", "calls": calls}
torch.save(result, out)
os._exit(0)
"""


@pytest.mark.parametrize("fail", [False, True])
def test_a_conversion_for_another_world_size_outlasts_the_collective_timeout_and_is_kept(tmp_path, monkeypatch,
                                                                                         fail):
    """Rank 0 converts (here: 12 s, with a 5 s collective timeout) while rank 1 waits outside any collective;
    the complete conversion is kept for the next start and converted again only when it no longer matches
    the checkpoint. A failed conversion ends rank 1 too, with rank 0's reason."""
    from tests.conftest import two_gloo_ranks

    published(tmp_path / "run", "step00000002", 2, world=2)
    monkeypatch.setenv("FAIL", "1" if fail else "")
    monkeypatch.setenv("RUN", str(tmp_path / "run"))
    (tmp_path / "first").mkdir()
    zero, one = two_gloo_ranks(tmp_path / "first", CONVERT)
    ckdir = tmp_path / "run" / "checkpoints"
    if fail:
        assert zero["error"] == "RuntimeError: no space left"
        assert one["error"] == (f"CheckpointError: {ckdir / 'step00000002'}: the conversion for 2 ranks failed on "
                                f"rank 0 (RuntimeError: no space left)")
        checkpointer.remove_stale(tmp_path / "run")  # the next start clears the failed one
        assert sorted(p.name for p in ckdir.iterdir()) == ["step00000002"]
        return
    assert zero["tag"] == one["tag"] == "universal-step00000002" and zero["ds"]["checkpoint"]["load_universal"]
    assert len(zero["calls"]) == 1 and one["calls"] == []
    checkpointer.remove_stale(tmp_path / "run")
    assert checkpointer.converted(ckdir, "step00000002")  # kept: a second start converts nothing
    (tmp_path / "second").mkdir()  # (a file store of its own)
    zero, one = two_gloo_ranks(tmp_path / "second", CONVERT)
    assert zero["calls"] == one["calls"] == [] and zero["tag"] == one["tag"] == "universal-step00000002"
    # re-saved at the same step (a rollback): the old conversion no longer matches, and a start drops it
    (ckdir / "step00000002" / checkpoints.META).write_text(json.dumps(meta(2, 2, files={"x": 1})))
    assert not checkpointer.converted(ckdir, "step00000002")
    checkpointer.remove_stale(tmp_path / "run")
    assert not (ckdir / "universal-step00000002").exists()


def test_the_lock_is_checked_again_right_before_a_checkpoint_is_published(tmp_path, single_rank):
    """A run whose lock was taken while it wrote its files does not publish them: the checkpoint stays
    unpublished (the next start removes the partial copy) and ``latest`` names the one before."""
    from megatok.run.lock import RunDirInUse

    first = checkpointer.save(FilesEngine(), tmp_path, 2, meta(2), still_ours=lambda: None)

    def taken():
        raise RunDirInUse(f"{tmp_path} was taken over by another run", waitable=False)

    with pytest.raises(RunDirInUse, match="was taken over by another run"):
        checkpointer.save(FilesEngine(), tmp_path, 4, meta(4), still_ours=taken)
    assert checkpoints.latest_tag(tmp_path) == first == "step00000002"
    assert checkpoints.published_tags(tmp_path) == ["step00000002"]
