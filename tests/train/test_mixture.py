"""A data mixture (data.shards = {shards: weight}) through the real trainer: validation draws from
every source and reports each, the checkpoint records each source's epoch, changing the weights is a
layout change that starts each source's next epoch, and a resume after that continues the restarted
mixed stream bit for bit."""

import json
import os
import shutil

import pytest

from megatok.config import load_config
from megatok.data.encoding import BYTES
from megatok.data.shards import build_shards
from megatok.metrics import read_metrics
from megatok.run import checkpoints
from megatok.train.evaluation import validation_batches
from tests.conftest import PARALLEL, ROOT, TINY, pretrain, without_cursors

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def second_source(tmp_path_factory):
    """A source that looks nothing like the first (stdlib code): short Russian and Chinese sentences."""
    tmp = tmp_path_factory.mktemp("second")
    with open(tmp / "docs.jsonl", "w") as f:
        for i in range(120):
            lang = ("ru", "zh")[i % 2]
            f.write(json.dumps({"text": f"{i}: " + " ".join(PARALLEL[lang] * 4), "lang": lang}) + "\n")
    build_shards([str(tmp / "docs.jsonl")], str(tmp / "shards"), val_fraction=0.2, num_shards=2, progress=False)
    return tmp / "shards"


def mixture(a, b, wa, wb):
    return "data.shards=" + json.dumps({str(a): wa, str(b): wb})


def test_validation_takes_each_source_by_weight(shards, second_source):
    cfg = load_config("configs/tiny.json", [*TINY, mixture(shards, second_source, 3, 1), "eval.max_sequences=8",
                                            "train.micro_batch_size=2"])
    batches = validation_batches(cfg, 0, 1, BYTES)
    rows = [bytes(r[1:].clamp(max=255).tolist()) for _, b, _ in batches for r in b]
    second = [("Все люди".encode() in r or "人人".encode() in r) for r in rows]
    assert len(rows) == 8 and sum(second) == 2  # 6 sequences of the first source, 2 of the second
    assert [int(g) for _, _, labels in batches for g in labels] == [int(x) for x in second]  # rows' sources
    assert [i for i, _, _ in batches] == [0, 1, 2, 3]


def test_a_rank_with_only_padding_reports_every_source_key(shards, second_source):
    """Ranks all-reduce the validation sums key by key: a rank whose share is one padding batch must
    produce the same keys as one with real rows of both sources."""
    import torch

    from megatok.eval.bpb import evaluate_batches
    from megatok.model import build_model

    cfg = load_config("configs/tiny.json", [*TINY, mixture(shards, second_source, 1, 1), "eval.max_sequences=2",
                                            "eval.batch_size=2"])
    model = build_model(cfg)
    full, padding_only = validation_batches(cfg, 0, 2, BYTES), validation_batches(cfg, 1, 2, BYTES)
    assert [i for i, _, _ in full] == [0] and [i for i, _, _ in padding_only] == [-1]
    real = evaluate_batches(model, full, mode="sample", seed=1, device=torch.device("cpu"), groups=2)
    pad = evaluate_batches(model, padding_only, mode="sample", seed=1, device=torch.device("cpu"), groups=2)
    assert sorted(real) == sorted(pad) and {"targets/0", "targets/1"} <= set(real)
    assert real["targets/0"] > 0 and real["targets/1"] > 0 and real["targets"] == real["targets/0"] + real["targets/1"]
    assert pad["targets"] == pad["targets/0"] == pad["targets/1"] == 0


def test_head_to_head_default_documents_take_the_sources_in_turn(shards, second_source):
    from megatok.eval.head_to_head import heldout_documents

    cfg = load_config("configs/tiny.json", [*TINY, mixture(shards, second_source, 3, 1)])
    docs = heldout_documents(cfg)
    langs = [d.lang for d in docs[:6]]  # first source (en), second (ru or zh), first, ...
    assert set(langs[0::2]) == {"en"} and set(langs[1::2]) <= {"ru", "zh"}


def test_mixture_trains_resumes_exactly_and_reweights(shards, second_source, tmp_path):
    run = tmp_path / "run"
    common = ["--config", "configs/tiny.json", "--set", *TINY, "train.max_steps=4", "train.save_every=2",
              "train.micro_batch_size=2", "train.global_batch_size=2", "data.num_workers=1"]
    pretrain(common + [mixture(shards, second_source, 3, 1), f"train.run_dir={run}"])
    data = checkpoints.read_meta(run, "step00000004")["data"]
    assert data["layout"]["mixture"] == [[str(shards), 0.75], [str(second_source), 0.25]]
    assert list(data["epochs"]) == [str(shards), str(second_source)] and data["epoch"] == max(data["epochs"].values())
    rows = {r["step"]: r for r in read_metrics(run) if r.get("split") == "train"}
    assert sorted(rows) == [1, 2, 3, 4] and all(len(r["epochs"]) == 2 for r in rows.values())
    val = [r for r in read_metrics(run) if r.get("split") == "val"][-1]
    parts = val["by_source"]  # validation per source, and over all
    assert list(parts) == [str(shards), str(second_source)]
    assert sum(p["val_bytes"] for p in parts.values()) == val["val_bytes"]
    assert min(p["val_bpb"] for p in parts.values()) < val["val_bpb"] < max(p["val_bpb"] for p in parts.values())

    # The sources spelled another way (a trailing slash, a relative path) are the same sources: the
    # resume continues at the readers' cursors, exactly.
    respelled = tmp_path / "respelled"
    shutil.copytree(run, respelled)
    r = pretrain(common + [mixture(f"{shards}/", os.path.relpath(second_source, ROOT), 3, 1),
                           f"train.run_dir={respelled}", "--resume", "step00000002"])
    assert "data stream resumed at its readers' cursors" in r.stdout and "warning" not in r.stdout, r.stdout
    again = {r["step"]: r["loss"] for r in read_metrics(respelled) if r.get("split") == "train"}
    assert (again[3], again[4]) == (rows[3]["loss"], rows[4]["loss"])

    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    # New weights cannot continue the same readers: the stream restarts, first reading what the old
    # readers had not read of each source's current epoch. A run that stops after that and resumes with
    # the new weights must continue the restarted stream exactly (the checkpoint records where it restarted).
    epochs = checkpoints.read_meta(run, "step00000002")["data"]["epochs"]
    straight = tmp_path / "straight"
    shutil.copytree(run, straight)
    r = pretrain(common + [mixture(shards, second_source, 1, 1), f"train.run_dir={straight}", "--resume", "step00000002"])
    assert f"finishes epoch {epochs} with what the earlier layout had not read" in r.stdout
    pretrain(common + [mixture(shards, second_source, 1, 1), f"train.run_dir={resumed}", "train.max_steps=3",
                       "--resume", "step00000002"])
    # without its readers' cursors (as in checkpoints older than cursors), the resumed run regenerates
    # the restarted stream from where it restarted
    without_cursors(resumed / "checkpoints" / "step00000003")
    r = pretrain(common + [mixture(shards, second_source, 1, 1), f"train.run_dir={resumed}"])  # from step 3
    assert "data stream resumed by regenerating 1 batches per rank" in r.stdout
    want = {r["step"]: r["loss"] for r in read_metrics(straight) if r.get("split") == "train"}
    got = {r["step"]: r["loss"] for r in read_metrics(resumed) if r.get("split") == "train"}
    assert got[4] == want[4] and got[3] == want[3]
    origin = checkpoints.read_meta(resumed, "step00000004")["data"]["stream_origin"]
    assert origin["step"] == 2 and origin["epochs"] == list(epochs.values()) and len(origin["unread"]) == 2
