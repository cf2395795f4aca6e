"""The data stream of a run (megatok.train.data_stream): where a resumed stream starts (data_position),
what its state holds, and a DataStream resumed from it, without a trainer."""

import json

import pytest
import torch

from megatok.config import load_config
from megatok.train.data_stream import data_digests, data_position, layout
from tests.conftest import ROOT


def test_a_new_layout_finishes_the_epoch_from_cursors_or_starts_the_next_without(capsys):
    cfg = load_config("configs/tiny.json", ["train.global_batch_size=16", "data.num_workers=1"])
    old = {**layout(cfg, 2), "world_size": 2}
    meta = {"step": 10, "epoch": 3, "layout": old}
    assert data_position({**meta, "layout": layout(cfg, 1)}, cfg, 1)[:2] == (10 * cfg.train.grad_accum, [0])

    start_batch, epochs, origin = data_position(meta, cfg, 1)  # no cursors (a checkpoint from before them)
    assert (start_batch, epochs, origin) == (0, [4], {"step": 10, "epochs": [4]})
    assert "the data stream starts epoch 4" in capsys.readouterr().out

    cursors = {0: {"sources": [[3, 1, 2, 40]], "read": [0], "bad_shards": 0, "offset": 5},
               1: {"sources": [[2, 7, 0, 90]], "read": [0], "bad_shards": 0, "offset": 0}}  # reader 1 lags
    start_batch, epochs, origin = data_position(meta, cfg, 1, cursors, [8])
    assert (start_batch, epochs) == (0, [3])
    # reader 0 of 2 had shards 0, 2, 4, 6 of epoch 3's order: it was in the 2nd, at document 2; reader 1,
    # still in epoch 2, had read nothing of its epoch-3 shards 1, 3, 5, 7
    from megatok.data.stream import epoch_order
    order = [int(i) for i in epoch_order(8, cfg.train.seed, 3, 0, 1)]
    assert origin["unread"] == [[[order[2], 2], [order[4], 0], [order[6], 0]] + [[order[k], 0] for k in (1, 3, 5, 7)]]
    assert "finishes epoch 3 with what the earlier layout had not read (7 shard pieces)" in capsys.readouterr().out
    # a later checkpoint of the new layout continues that stream
    later = {"step": 14, "epoch": 3, "layout": layout(cfg, 1), "stream_origin": origin}
    assert data_position(later, cfg, 1) == (4 * cfg.train.grad_accum, [3], origin)
    # on other shards the same layout resumes the recorded epoch without the old shards' pieces
    assert data_position(later, cfg, 1, same_data=False) == (4 * cfg.train.grad_accum, [3], {"step": 10, "epochs": [3]})


def test_all_cursors_of_a_checkpoint_or_none(tmp_path):
    from megatok.train.checkpointer import Start
    from megatok.train.data_stream import all_cursors

    ckpt = tmp_path / "checkpoints" / "step00000004"
    ckpt.mkdir(parents=True)
    cursor = {"sources": [[0, 1, 2, 9]], "read": [0], "bad_shards": 0, "offset": 3}
    for rank in (0, 1):
        (ckpt / f"stream_rank{rank}.json").write_text(json.dumps({"cursors": {str(rank): cursor}}))
    start = Start("step00000004", {"tag": "step00000004", "step": 4}, run_dir=tmp_path)
    old = {"world_size": 2, "num_workers": 1}
    assert all_cursors(start, old, 1) == {0: cursor, 1: cursor}
    assert all_cursors(start, old, 2) == {}  # cursors of another number of sources
    assert all_cursors(start, {"world_size": 2, "num_workers": 2}, 1) == {}  # 2 of 4 readers
    (ckpt / "stream_rank1.json").unlink()
    assert all_cursors(start, old, 1) == {}


def test_a_reader_never_consumed_from_is_known_to_be_at_its_start(shards, tmp_path):
    """One step of one rank with two dataloader workers consumes a batch of reader 0 only; reader 1's
    cursor is its start, so a resume with one worker shares out the epoch rather than skipping it."""
    from megatok.run import checkpoints
    from tests.conftest import TINY, pretrain

    run = tmp_path / "run"
    common = ["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run}",
              "train.micro_batch_size=2", "train.global_batch_size=2", "train.save_every=1"]
    pretrain(common + ["train.max_steps=1", "data.num_workers=2"])
    cursors = checkpoints.read_cursors(run, "step00000001", 0, 1)
    assert sorted(cursors) == [0, 1] and cursors[1]["sources"] == [[0, 0, 0, 0]] and cursors[1]["offset"] == 0
    r = pretrain(common + ["train.max_steps=2", "data.num_workers=1"])
    assert "the data stream finishes epoch 0 with what the earlier layout had not read" in r.stdout


def test_the_data_is_the_same_however_its_local_path_is_spelled_and_wherever_the_project_moved(
        shards, tmp_path, monkeypatch):
    import os
    import shutil

    from megatok.train.data_stream import data_matches

    def digests(spec):
        return data_digests(load_config(ROOT / "configs/tiny.json", [f"data.shards={spec}"], world_size=1))

    here = digests(shards)
    meta = {"step": 4, **here}
    for spelling in (f"{shards}/", f"{shards}/./", os.path.relpath(shards)):
        assert data_matches(meta, digests(spelling))
    assert data_matches({"step": 4, "data_digest": here["data_digest_spelled"]}, here)  # from before real paths
    assert data_matches({"step": 4}, here)  # from before digests
    # a project moved with its relative paths: other real paths, the same spelling
    project = tmp_path / "a"
    shutil.copytree(shards, project / "data" / "shards")
    monkeypatch.chdir(project)
    moved = {"step": 4, **digests("data/shards")}
    shutil.move(project, tmp_path / "b")
    monkeypatch.chdir(tmp_path / "b")
    assert data_matches(moved, digests("data/shards"))
    (tmp_path / "b" / "data" / "shards" / "train-00000.tar").write_bytes(b"other")  # other data
    assert not data_matches(moved, digests("data/shards"))


def test_respelled_mixture_sources_keep_their_place(shards, tmp_path, capsys):
    """A new layout with the sources spelled another way still knows each source: its epoch (no
    cursors) and the cursors' unread pieces (with cursors)."""
    other = tmp_path / "other"
    other.mkdir()
    for p in shards.iterdir():
        (other / p.name).symlink_to(p)

    def cfg_for(a, b, extra=()):
        return load_config("configs/tiny.json", ["data.shards=" + json.dumps({a: 1, b: 1}),
                                                 "data.num_workers=1", *extra])

    old_cfg = cfg_for(str(shards), str(other), ["train.global_batch_size=16"])
    new_cfg = cfg_for(f"{shards}/", f"{other}/./", ["train.global_batch_size=32"])
    meta = {"step": 10, "epoch": 5, "epochs": {str(shards): 3, str(other): 5}, "layout": layout(old_cfg, 2)}
    start_batch, epochs, origin = data_position(meta, new_cfg, 2)
    assert (start_batch, epochs) == (0, [4, 6]) and origin == {"step": 10, "epochs": [4, 6]}
    capsys.readouterr()
    cursors = {r: {"sources": [[3, 0, 0, 0], [5, 0, 0, 0]], "read": [0, 0], "bad_shards": 0, "offset": 0}
               for r in range(2)}
    start_batch, epochs, origin = data_position(meta, new_cfg, 2, cursors, [4, 4])
    assert epochs == [3, 5] and len(origin["unread"]) == 2
    assert "finishes epoch" in capsys.readouterr().out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_resumed_from_its_state_gives_the_batches_that_came_next(single_rank, shards, tmp_path, capsys,
                                                                          workers):
    """A DataStream's state (the checkpoint's "data" part: the layout, the data's digests, the epochs and
    the stream's origin) and its readers' cursors: a stream resumed from them, at the checkpoint's step,
    continues with the very batches the first stream went on with, from the cursors or, without them,
    by regenerating the batches before."""
    from megatok.data.encoding import encoding_for
    from megatok.train.checkpointer import Start
    from megatok.train.data_stream import DataStream
    from tests.train.conftest import tiny_config

    cfg = tiny_config(shards, tmp_path, f"data.num_workers={workers}")
    first = DataStream(cfg, encoding_for(cfg), 0, 1, single_rank)
    first.open()
    for _ in range(3):
        first.next_batch()
    state, cursors = first.state_dict(), dict(first.cursors)
    later = [first.next_batch() for _ in range(4)]
    first.close()
    assert state == {"epoch": 0, "stream_origin": {"step": 0, "epochs": [0]}, **data_digests(cfg),
                     "layout": layout(cfg, 1)}
    assert sorted(cursors) == list(range(max(1, workers)))
    saved = tmp_path / "checkpoints" / "step00000003"
    saved.mkdir(parents=True)
    (saved / "stream_rank0.json").write_text(json.dumps({"cursors": {str(r): c for r, c in cursors.items()}}))
    start = Start("step00000003", {"tag": "step00000003", "step": 3, "data": state}, run_dir=tmp_path)
    for how in ("at its readers' cursors", "by regenerating 3 batches per rank"):
        resumed = DataStream(cfg, encoding_for(cfg), 0, 1, single_rank)
        assert resumed.same_layout(state)
        resumed.load_state_dict(state, start)
        resumed.open()
        assert all(torch.equal(resumed.next_batch(), want) for want in later), how
        resumed.close()
        assert f"data stream resumed {how}" in capsys.readouterr().out
        (saved / "stream_rank0.json").unlink(missing_ok=True)  # a checkpoint without the cursors
