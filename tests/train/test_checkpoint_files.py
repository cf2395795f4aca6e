"""megatok's own files in a checkpoint directory, without an engine: what a restart cleans up or
restores, and how the data readers' cursors are read back."""

import json

import pytest

from megatok.train import checkpoint


def published(tmp_path, name, step):
    d = tmp_path / "checkpoints" / name
    d.mkdir(parents=True)
    (d / checkpoint.META).write_text(json.dumps({"step": step}))
    return d


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


def test_a_checkpoints_cursors_are_read_back_or_named_when_damaged(tmp_path):
    ckpt = published(tmp_path, "step00000002", 2)
    assert checkpoint.read_cursors(tmp_path, "step00000002", 0) == {}  # a checkpoint from before cursors
    (ckpt / "stream_rank0.json").write_text(json.dumps({"cursors": {"3": {"offset": 7}}}))
    assert checkpoint.read_cursors(tmp_path, "step00000002", 0) == {3: {"offset": 7}}
    (ckpt / "stream_rank1.json").write_text('{"cursors": [')
    with pytest.raises(ValueError, match=f"{ckpt / 'stream_rank1.json'}: not a megatok stream position"):
        checkpoint.read_cursors(tmp_path, "step00000002", 1)
