"""megatok's own files in a checkpoint directory, without an engine: what a restart cleans up or
restores, and how the data readers' cursors are read back."""

import json

import pytest
import torch

from megatok.train import checkpoint


def published(tmp_path, name, step, world=None):
    """A checkpoint directory with megatok's metadata; with ``world``, DeepSpeed-like files too (torch.save
    archives: the model states and one ZeRO optimizer partition per rank)."""
    d = tmp_path / "checkpoints" / name
    d.mkdir(parents=True)
    meta = {"step": step} if world is None else {"step": step, "layout": {"world_size": world}}
    (d / checkpoint.META).write_text(json.dumps(meta))
    if world:
        torch.save({"module": {"w": torch.zeros(64)}}, d / "mp_rank_00_model_states.pt")
        for r in range(world):
            torch.save({"state": torch.ones(64)}, d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    return d


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def test_a_restart_removes_half_written_copies_and_restores_a_checkpoint_moved_aside(tmp_path):
    published(tmp_path, "step00000002", 2)
    # killed while re-saving step 4: the published step 4 was moved aside, the new copy not yet in place
    published(tmp_path, "step00000004.old-123.tmp", 4)
    published(tmp_path, "step00000004.tmp", 4)
    checkpoint.set_latest(tmp_path, "step00000004")
    (tmp_path / "checkpoints" / "step00000006.tmp").mkdir()  # half written, never published
    (tmp_path / "checkpoints" / "universal-step00000002").mkdir()  # a conversion left behind
    published(tmp_path, "step00000002.old-7.tmp", 2)  # moved aside, and its re-save did land
    checkpoint.remove_stale(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step00000002", "step00000004"]
    assert checkpoint.read_meta(tmp_path, checkpoint.latest_tag(tmp_path)) == {"step": 4}


CURSOR = {"sources": [[0, 1, 2, 9]], "read": [0], "bad_shards": 0, "offset": 7}


def test_a_checkpoints_cursors_are_read_back_or_named_when_damaged(tmp_path):
    ckpt = published(tmp_path, "step00000002", 2)
    assert checkpoint.read_cursors(tmp_path, "step00000002", 0, 1) == {}  # a checkpoint from before cursors
    (ckpt / "stream_rank0.json").write_text(json.dumps({"cursors": {"3": CURSOR}}))
    assert checkpoint.read_cursors(tmp_path, "step00000002", 0, 1) == {3: CURSOR}
    with pytest.raises(checkpoint.CheckpointError, match="another number of data sources than the 2 configured"):
        checkpoint.read_cursors(tmp_path, "step00000002", 0, 2)
    (ckpt / "stream_rank1.json").write_text('{"cursors": [')
    with pytest.raises(checkpoint.CheckpointError, match=f"{ckpt / 'stream_rank1.json'}: not a megatok stream"):
        checkpoint.read_cursors(tmp_path, "step00000002", 1, 1)


def test_damaged_checkpoints_are_named_and_auto_resume_falls_back_past_them(tmp_path, capsys):
    good = published(tmp_path, "step00000002", 2, world=2)
    assert checkpoint.damage(tmp_path, "step00000002") is None
    bad = published(tmp_path, "step00000004", 4, world=2)
    truncate(bad / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt is damaged" in checkpoint.damage(tmp_path, "step00000004")
    lost = published(tmp_path, "step00000006", 6, world=2)
    (lost / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    assert checkpoint.damage(tmp_path, "step00000006") == "1 optimizer partitions for the 2 ranks that wrote it"
    (published(tmp_path, "step00000008", 8, world=1) / checkpoint.META).unlink()
    assert checkpoint.damage(tmp_path, "step00000008").startswith("megatok.json: ")

    checkpoint.set_latest(tmp_path, "step00000006")
    assert checkpoint.resume_tag(tmp_path, "auto") == "step00000002"  # past the damaged 6 and 4
    warning = capsys.readouterr().out
    assert "skipping damaged checkpoint(s) step00000006 (1 optimizer partitions" in warning
    assert "step00000004 (zero_pp_rank_1" in warning and "resuming from step00000002" in warning
    assert checkpoint.resume_tag(tmp_path, "auto", warn=False) == "step00000002" and not capsys.readouterr().out
    assert checkpoint.resume_tag(tmp_path, "step00000002") == "step00000002"
    with pytest.raises(checkpoint.CheckpointError, match=f"{bad}: cannot be resumed: zero_pp_rank_1"):
        checkpoint.resume_tag(tmp_path, "step00000004")
    truncate(good / "mp_rank_00_model_states.pt")
    with pytest.raises(checkpoint.CheckpointError, match="no usable checkpoint: step00000006 .*step00000002"):
        checkpoint.resume_tag(tmp_path, "auto")
    checkpoint.set_latest(tmp_path, None)
    assert checkpoint.resume_tag(tmp_path, "auto") is None  # nothing to resume: a fresh start


def test_what_else_counts_as_damage_and_what_does_not(tmp_path):
    d = published(tmp_path, "step00000002", 2, world=1)
    (d / "rng_rank0.json").write_text("{}")
    (d / "stream_rank0.json").write_text(json.dumps({"cursors": {"0": CURSOR}}))
    assert checkpoint.damage(tmp_path, "step00000002") is None
    # DeepSpeed's checkpoint_serialization=false writes torch's legacy (non-zip) format
    torch.save({"state": torch.ones(4)}, d / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
               _use_new_zipfile_serialization=False)
    assert checkpoint.damage(tmp_path, "step00000002") is None
    (d / "stream_rank0.json").write_text(json.dumps({"cursors": {"0": {**CURSOR, "offset": "7"}}}))
    assert checkpoint.damage(tmp_path, "step00000002").startswith("stream_rank0.json: reader 0: not a cursor")
    (d / "stream_rank0.json").write_text(json.dumps({"cursors": {"0": CURSOR}}))
    (d / "rng_rank0.json").write_text('{"python": [')
    assert checkpoint.damage(tmp_path, "step00000002").startswith("rng_rank0.json: ")

    # killed while re-saving step 4, its published copy moved aside: usable, restored at the next start
    aside = published(tmp_path, "step00000004.old-9.tmp", 4, world=1)
    checkpoint.set_latest(tmp_path, "step00000004")
    assert checkpoint.damage(tmp_path, "step00000004") is None
    assert checkpoint.resume_tag(tmp_path, "auto") == checkpoint.resume_tag(tmp_path, "step00000004") == "step00000004"
    checkpoint.remove_stale(tmp_path)
    assert not aside.exists() and checkpoint.read_meta(tmp_path, "step00000004")["step"] == 4
