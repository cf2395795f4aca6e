"""The real DeepSpeed engine on CPU: 2 ranks under ZeRO-2 and ZeRO-3 against 1 rank with the same
global batch, and a checkpoint saved by one process and continued by another.

Equality of data between the layouts: 1 rank x 2 dataloader workers and 2 ranks x 1 worker give
the same readers (reader = rank * workers + worker), and boundary sampling is seeded per
(step, micro_step * world + rank), so the global batch and its samples are identical.
"""

import shutil

import pytest

from megatok.metrics import read_metrics
from tests.conftest import TINY, pretrain, without_cursors

pytestmark = pytest.mark.dist
STEPS = 6
# The same sums in a different order (an all-reduce of two halves vs one accumulation): fp32
# rounding differs in the last bits, and it compounds slowly over steps.
REL_TOL = 2e-4


def read_rows(run_dir, split="train"):
    return {r["step"]: r for r in read_metrics(run_dir) if r.get("split") == split}


def losses(run_dir):
    return {step: r["loss"] for step, r in read_rows(run_dir).items()}


@pytest.fixture(scope="module")
def one_rank(shards, tmp_path_factory):
    run = tmp_path_factory.mktemp("one") / "run"
    pretrain(["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run}",
              f"train.max_steps={STEPS}", "train.micro_batch_size=4", "train.global_batch_size=8",
              "data.num_workers=2", "deepspeed.zero_optimization.stage=1", "train.grad_clip=0"])
    return read_rows(run), read_rows(run, "val")


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_match_one_rank_and_resume_continues(stage, one_rank, shards, tmp_path):
    run = tmp_path / "run"
    common = ["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}",
              f"train.max_steps={STEPS}", "train.micro_batch_size=4", "train.global_batch_size=8",
              "data.num_workers=1", f"deepspeed.zero_optimization.stage={stage}", "train.save_every=3",
              "train.grad_clip=0"]  # no clipping: a wrong gradient scale would not be normalised away
    one_rank, one_rank_val = one_rank
    # ZeRO-3 through the deepspeed launcher, as users launch it; ZeRO-2 with the ranks started directly
    r = pretrain(common + [f"train.run_dir={run}"], nproc=2, launcher="deepspeed" if stage == 3 else "env")
    # ZeRO-3 builds the model partitioned (train.zero_init, default on), ZeRO-2 whole.
    assert ("(built partitioned)" in r.stdout) == (stage == 3), r.stdout[-2000:]
    rows = read_rows(run)
    two = losses(run)
    assert sorted(two) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm", "bpb", "boundary_rate"):
            assert rows[step][key] == pytest.approx(one_rank[step][key], rel=REL_TOL), (step, key)
    assert two[STEPS] < two[1]
    # the streamed merge reads 2 ranks' partitions (a parameter may straddle them) as DeepSpeed's zero_to_fp32
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from megatok.run.merge import checkpoint_tensors

    want = get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoints"), tag=f"step{STEPS:08d}")
    got = checkpoint_tensors(run / "checkpoints" / f"step{STEPS:08d}")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k].load(), want[k]) for k in want)
    # FLOP/s per device: the job's model FLOPs over the interval, divided by the 2 ranks
    seconds = (rows[2]["bytes_seen"] - rows[1]["bytes_seen"]) / rows[2]["bytes_per_s"]
    assert rows[2]["tflops_per_device"] == pytest.approx((rows[2]["flops"] - rows[1]["flops"]) / seconds / 2 / 1e12,
                                                         rel=1e-6)
    # Validation (sampled boundaries) at the end: the same global batches and seeds at either world size.
    val = read_rows(run, "val")[STEPS]
    assert val["val_bytes"] == one_rank_val[STEPS]["val_bytes"]
    for key in ("val_bpb", "val_boundary_rate"):
        assert val[key] == pytest.approx(one_rank_val[STEPS][key], rel=REL_TOL), key

    # A new process group resumes from the step-3 checkpoint and must reproduce steps 4..6 exactly.
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    (resumed / "metrics.jsonl").unlink()
    # The data readers continue from their cursors; under ZeRO-3 from a checkpoint without them (as
    # older checkpoints are), by regenerating the 3 steps x 1 micro-batch each rank had consumed.
    ckpt = resumed / "checkpoints" / "step00000003"
    assert sorted(p.name for p in ckpt.glob("stream_rank*.json")) == ["stream_rank0.json", "stream_rank1.json"]
    if stage == 3:
        without_cursors(ckpt)
    # Under ZeRO-3 the resumed run builds the model whole (train.zero_init=false): the state it loads
    # makes it train exactly as the run built partitioned.
    r = pretrain(common + [f"train.run_dir={resumed}", "train.zero_init=false", "--resume", "step00000003"], nproc=2)
    assert "(built partitioned)" not in r.stdout and "ZeRO stage" in r.stdout
    how = "by regenerating 3 batches per rank" if stage == 3 else "at its readers' cursors"
    assert f"data stream resumed {how}" in r.stdout
    again = losses(resumed)
    assert sorted(again) == [4, 5, 6]
    for step in (4, 5, 6):
        assert again[step] == two[step], (step, again[step], two[step])  # bit-exact in fp32 on CPU


def test_bf16_trains_on_one_rank(shards, tmp_path):
    run = tmp_path / "bf16"
    pretrain(["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run}",
              "train.max_steps=3", "train.micro_batch_size=2", "deepspeed.bf16.enabled=true",
              "deepspeed.zero_optimization.stage=1"])
    got = losses(run)
    assert len(got) == 3 and all(0 < v < 10 for v in got.values())
    assert (run / "checkpoints" / "latest").read_text().strip() == "step00000003"


def test_bf16_with_fp32_gradient_accumulation_resumes_exactly(shards, tmp_path):
    """The GPU configs' precision from 1b up: bf16, gradients accumulated in fp32 (2 micro-batches) under
    ZeRO-2; a resume in a new process replays the steps after the checkpoint bit for bit."""
    run = tmp_path / "bf16"
    argv = ["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run}",
            "train.max_steps=4", "train.save_every=2", "train.micro_batch_size=2", "train.global_batch_size=4",
            "deepspeed.bf16.enabled=true", 'deepspeed.data_types={"grad_accum_dtype": "fp32"}']
    r = pretrain(argv)
    assert "ZeRO stage 2, bf16" in r.stdout, r.stdout[-2000:]
    want = losses(run)
    assert sorted(want) == [1, 2, 3, 4] and all(0 < v < 10 for v in want.values())
    pretrain(argv + ["--resume", "step00000002"])
    got = losses(run)
    assert [got[s] for s in (3, 4)] == [want[s] for s in (3, 4)]


def test_compiled_blocks_train_like_eager_and_their_checkpoints_load_without(shards, tmp_path):
    """train.compile under ZeRO-3 (whose parameter hooks run around the compiled blocks), with activation
    checkpointing and a validation pass: the same losses as eager, and a checkpoint that an eager run resumes.
    No graph break: DeepSpeed's per-layer hooks inside a block split it (43 recompilations here); each
    block as a ZeRO-3 leaf compiles whole (3: the byte and chunk rotary tables, and eval's no-grad)."""
    common = ["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", "train.max_steps=3",
              "train.save_every=2", "train.micro_batch_size=4", "train.global_batch_size=4", "eval.every=2",
              "deepspeed.zero_optimization.stage=3", "model.activation_checkpointing=true",
              "train.dist_timeout_s=900"]  # the first step compiles: minutes on a loaded machine
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    pretrain(common + [f"train.run_dir={eager}"])
    cache = tmp_path / "inductor"  # a cold cache, and proof that inductor compiled kernels
    r = pretrain(common + [f"train.run_dir={compiled}", "train.compile=true"], timeout=600,
                 env={"TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCH_LOGS": "graph_breaks,recompiles"})
    assert ", torch.compile (the first steps compile)," in r.stdout and list(cache.rglob("*.py"))
    log = r.stdout + r.stderr
    assert "Graph break" not in log and log.count("Recompiling function") <= 4, log[-3000:]
    want, got = losses(eager), losses(compiled)
    assert sorted(got) == [1, 2, 3] and got == pytest.approx(want, rel=1e-5)
    assert read_rows(compiled, "val")[2]["val_bpb"] == pytest.approx(read_rows(eager, "val")[2]["val_bpb"], rel=1e-5)
    r = pretrain(common + [f"train.run_dir={compiled}", "--resume", "step00000002"])  # eager, from the compiled run
    assert "torch.compile" not in r.stdout and losses(compiled)[3] == pytest.approx(want[3], rel=1e-5)


def test_the_whole_compiled_forward_trains_like_eager(shards, tmp_path):
    """train.compile 'model' under ZeRO-2 (inductor on the CPU, one rank): the packed model's whole training
    forward as one graph, no break and no recompile across steps, the losses eager's; evaluation stays eager."""
    common = ["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", "train.max_steps=3",
              "train.micro_batch_size=2", "train.global_batch_size=2", "eval.every=3", "model.pack_chunks=1.5",
              "deepspeed.zero_optimization.stage=2", "train.dist_timeout_s=900"]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    pretrain(common + [f"train.run_dir={eager}"])
    r = pretrain(common + [f"train.run_dir={compiled}", "train.compile=model"], timeout=900,
                 env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TORCH_LOGS": "graph_breaks,recompiles"})
    log = r.stdout + r.stderr
    assert "Graph break" not in log and "Recompiling function" not in log, log[-3000:]
    want, got = losses(eager), losses(compiled)
    assert sorted(got) == [1, 2, 3] and got == pytest.approx(want, rel=1e-5)
    assert read_rows(compiled, "val")[3]["val_bpb"] == pytest.approx(read_rows(eager, "val")[3]["val_bpb"], rel=1e-6)


def test_the_ranks_follow_deepspeeds_accelerator_not_a_visible_gpu():
    """DS_ACCELERATOR=cpu on a machine with a GPU (the tests' setting): DeepSpeed keeps the model on the
    CPU, so the data and the collectives must stay there too (gloo; nccl cannot reduce CPU tensors).
    The GPU is faked: torch.cuda.is_available() answers True."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    script = ("import torch; torch.cuda.is_available = lambda: True\n"
              "from megatok.train import dist\n"
              "device = dist.init(60)\n"
              "print(device, torch.distributed.get_backend())\n"
              "dist.finish()\n")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "cpu gloo"
