"""tools/gpu_study.sh, the default policy, uniform and whitespace chunks at gpu-18m's shape in one GPU call: here
on a CPU, with the model shrunk through its replicate arguments, over prepared data laid out as --prepare
leaves it; and its clear errors."""

import gzip
import json
import os
import subprocess
import sys

from tests.conftest import ROOT, stdlib_texts


def gpu_study(*args, env=None, timeout=600):
    return subprocess.run(["bash", str(ROOT / "tools/gpu_study.sh"), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def prepared(work):
    """WORK/data as megatok-replicate --preset gpu-call --prepare-only leaves it (prose shards, held-out
    prose, the parallel set, the evaluation's sample)."""
    data = work / "data"
    data.mkdir(parents=True)
    with gzip.open(data / "prose.jsonl.gz", "wt") as f:  # the shards are built there from it, as on the device
        f.writelines(json.dumps({"text": t, "lang": "en", "domain": "docs"}) + "\n" for t in stdlib_texts(40))
    docs = [{"text": t, "lang": "en", "domain": "docs"} for t in stdlib_texts(2, 3000)]
    with gzip.open(data / "prose_heldout.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    (data / "heldout_udhr.jsonl").write_text(json.dumps({"text": "All human beings are born free.", "lang": "en",
                                                         "domain": "legal"}) + "\n")
    (data / "eval_prose.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))


def test_one_call_trains_evaluates_and_brings_back_the_metrics(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    prepared(work)
    small = ["--methods", "uniform", "--set", "model.d_model=32", "model.n_heads=2", "model.n_encoder_layers=1",
             "model.n_main_layers=1", "model.n_decoder_layers=1", "data.seq_len=128", "data.num_workers=0",
             "train.micro_batch_size=2", "train.global_batch_size=2", "train.max_steps=2", "train.save_every=2",
             "train.warmup_steps=1", "eval.every=0", "deepspeed.bf16.enabled=false", "train.compile=false"]
    r = gpu_study("--budget-s", "300", "--", *small,
                  env={"OUT": str(out), "WORK": str(work), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "gpu_study: exit 0" in r.stdout and (out / "environment.txt").read_text().strip()
    result = json.loads((out / "gpu-call" / "results.json").read_text())
    assert [run["method"] for run in result["runs"]] == ["uniform"] and result["runs"][0]["prose-sample"]["bpb"] > 0
    rows = [json.loads(x) for x in (out / "metrics" / "runs-uniform-seed0.jsonl").read_text().splitlines()]
    assert any(row.get("split") == "train" and row["step"] == 2 for row in rows)


def test_clear_errors(tmp_path):
    r = gpu_study(env={"OUT": str(tmp_path / "o"), "WORK": str(tmp_path / "nowhere")})
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert f"no prepared data in {tmp_path / 'nowhere'}/data" in r.stderr and "--prepare" in r.stderr
    r = gpu_study("--budget-s", "ten")
    assert r.returncode == 2 and "--budget-s wants whole seconds, got 'ten'" in r.stderr
    r = gpu_study("--budget-s", "60")
    assert r.returncode == 2 and "too short for a run" in r.stderr
    r = gpu_study("--budget-s")
    assert r.returncode == 2
    r = gpu_study("--fast")
    assert r.returncode == 2 and "unknown argument --fast" in r.stderr
