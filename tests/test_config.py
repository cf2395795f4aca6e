"""Config mistakes fail with one line naming the key, before any process group starts."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatok.config import ConfigError, load_config, warnings_for
from megatok.dsconfig import deepspeed_config
from tests.conftest import run_tool

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)
    return p


def error_of(*args, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(*args, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.json")))
def test_shipped_configs_load(name):
    cfg = load_config(ROOT / "configs" / name, world_size=2 if name == "tiny.json" else 8)
    assert cfg.train.grad_accum >= 1


def test_unknown_key_names_full_path_and_closest_name(tmp_path):
    p = write(tmp_path, "c.json", {"train": {"max_step": 3}})
    msg = error_of(p)
    assert "train.max_step" in msg and "did you mean 'train.max_steps'" in msg and str(p) in msg
    msg = error_of(write(tmp_path, "d.json", {"modle": {}}))
    assert "modle" in msg and "'model'" in msg


def test_unknown_strategy_option_and_unknown_strategy(tmp_path):
    msg = error_of(write(tmp_path, "c.json", {"boundary": {"strategy": "policy", "gama": 0.9}}))
    assert "boundary.gama" in msg and "boundary.gamma" in msg
    msg = error_of(write(tmp_path, "d.json", {"boundary": {"strategy": "fixed", "gamma": 0.9}}))
    assert "boundary.gamma" in msg and "fixed" in msg
    msg = error_of(write(tmp_path, "e.json", {"boundary": {"strategy": "bogus"}}))
    assert "boundary.strategy" in msg and "policy" in msg


def test_wrong_type_and_range(tmp_path):
    msg = error_of(write(tmp_path, "c.json", {"train": {"max_steps": "many"}}))
    assert "train.max_steps" in msg and "many" in msg
    msg = error_of(write(tmp_path, "d.json", {"boundary": {"target_rate": 1.5}}))
    assert "boundary.target_rate" in msg
    msg = error_of(write(tmp_path, "e.json", {"data": {"seq_len": 0}}))
    assert "data.seq_len" in msg


@pytest.mark.parametrize("section,key,value", [
    ("train", "max_steps", "5"), ("train", "lr", "1e-3"), ("logging", "progress", "yes"), ("logging", "progress", 1),
    ("model", "activation_checkpointing", "false"), ("train", "betas", ["0.9", 0.95]), ("train", "max_steps", 2.5),
    ("boundary", "batch_baseline", 1), ("boundary", "gamma", "0.99"), ("boundary", "window", "8"),
])
def test_values_are_not_coerced(tmp_path, section, key, value):
    """pydantic's default would read "5" as 5 and "yes" or 1 as true; a config means what its JSON says."""
    msg = error_of(write(tmp_path, "c.json", {section: {key: value}}))
    assert f"{section}.{key}" in msg and json.dumps(value) in msg


def test_a_union_typed_key_names_what_failed_not_pydantics_member_tag(tmp_path):
    msg = error_of(write(tmp_path, "c.json", {"eval": {"heldout": ["a.jsonl", 1]}}))
    assert msg.endswith("eval.heldout.1: Input should be a valid string (got 1)"), msg


def test_whole_numbers_written_as_floats_and_numbers_given_to_strings(tmp_path):
    p = write(tmp_path, "c.json", {"train": {"max_steps": 1e3, "lr": 1, "betas": [0, 0.5]},
                                   "boundary": {"strategy": "policy", "window": 8.0, "gamma": 1}})
    cfg = load_config(p, ["logging.wandb_name=7", "eval.every=2e2", "eval.heldout=null"], world_size=1)
    assert cfg.train.max_steps == 1000 and type(cfg.train.max_steps) is int
    assert cfg.eval.every == 200 and type(cfg.eval.every) is int
    assert cfg.boundary.options.window == 8 and type(cfg.boundary.options.window) is int
    assert cfg.train.lr == 1.0 and cfg.train.betas == (0.0, 0.5) and cfg.boundary.options.gamma == 1.0
    assert cfg.logging.wandb_name == "7" and cfg.eval.heldout is None


def test_warmup_not_below_max_steps_is_a_warning(capsys):
    from megatok.config import warnings_for
    from megatok.size_report import dry_run

    tiny = ROOT / "configs/tiny.json"
    assert warnings_for(load_config(tiny, world_size=2)) == []
    (line,) = warnings_for(load_config(tiny, ["train.max_steps=30"], world_size=2))
    assert line.startswith("train.warmup_steps=30 is not below train.max_steps=30: the run ends before its warmup")
    assert dry_run(str(tiny), ["train.max_steps=5"], world=2) == 0
    assert "warning: train.warmup_steps=30 is not below train.max_steps=5" in capsys.readouterr().err


def test_batch_mismatch(tmp_path):
    p = write(tmp_path, "c.json", {"train": {"micro_batch_size": 4, "grad_accum": 2, "global_batch_size": 12}})
    msg = error_of(p, world_size=2)
    assert "train.global_batch_size=12" in msg and "= 16" in msg
    cfg = load_config(write(tmp_path, "d.json", {"train": {"micro_batch_size": 4, "global_batch_size": 16}}),
                      world_size=2)
    assert cfg.train.grad_accum == 2
    assert deepspeed_config(cfg, 2)["train_batch_size"] == 16
    msg = error_of(write(tmp_path, "e.json", {"train": {"micro_batch_size": 4, "global_batch_size": 10}}),
                   world_size=2)
    assert "train.global_batch_size=10" in msg
    # a run's config.json records the accumulation derived for its world size: relaunched on 2 ranks
    # instead of 1, the line says how to derive it again
    cfg.dump(tmp_path / "written.json")
    msg = error_of(tmp_path / "written.json", world_size=4)
    assert msg.endswith("x train.grad_accum (2) x world size (4) = 32; --set train.grad_accum=null derives it for "
                        "this world size (1)"), msg
    assert "--set" not in error_of(p, world_size=2)  # 12 is no multiple of 4 x 2: no accumulation fits


def test_extends_merges_and_overrides_are_typed(tmp_path):
    write(tmp_path, "base.json", {"model": {"d_model": 64, "n_heads": 2}, "train": {"max_steps": 50}})
    p = write(tmp_path, "child.json", {"extends": "base.json", "model": {"n_heads": 4}})
    cfg = load_config(p, ["train.max_steps=7", "boundary.gamma=0.5", "data.shards=a/b",
                          "deepspeed.zero_optimization.stage=3", "train.betas=[0.8,0.9]"], world_size=1)
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.train.max_steps) == (64, 4, 7)
    assert cfg.boundary.options.gamma == 0.5 and cfg.data.shards == "a/b"
    assert cfg.deepspeed["zero_optimization"]["stage"] == 3 and cfg.train.betas == (0.8, 0.9)
    msg = error_of(p, ["train.max_stepz=3"], world_size=1)
    assert "train.max_stepz" in msg and "train.max_steps" in msg


def test_extends_cycle_missing_file_and_bad_json(tmp_path):
    write(tmp_path, "a.json", {"extends": "b.json"})
    write(tmp_path, "b.json", {"extends": "a.json"})
    assert "cycle" in error_of(tmp_path / "a.json")
    assert "nothere.json" in error_of(write(tmp_path, "c.json", {"extends": "nothere.json"}))
    msg = error_of(write(tmp_path, "d.json", '{"train": {"max_steps": 3,}}'))
    assert "d.json" in msg and "line 1" in msg


def test_numbers_that_are_not_finite_and_text_that_is_not_utf8_are_one_line(tmp_path):
    """JSON's NaN and Infinity, which Python's reader takes, and literals that overflow (1e400) are one error
    naming the key, in a file or a --set; so is a config file that is not UTF-8 (no traceback)."""
    msg = error_of(write(tmp_path, "a.json", '{"train": {"dist_timeout_s": Infinity}}'))
    assert msg.endswith("a.json: train.dist_timeout_s: inf is not a finite number"), msg
    assert "train.lr: inf is not a finite number" in error_of(write(tmp_path, "b.json", '{"train": {"lr": 1e400}}'))
    assert "train.betas[1]: nan is not a finite number" in error_of(
        write(tmp_path, "c.json", '{"train": {"betas": [0.9, NaN]}}'))
    with pytest.raises(ConfigError, match=r"--set boundary.gamma=-Infinity\): boundary.gamma: -inf is not a finite"):
        load_config(ROOT / "configs/tiny.json", ["boundary.gamma=-Infinity"])
    latin = tmp_path / "d.json"
    text = b'{"train": {"run_dir": "runs/caf\xe9"}}'  # Latin-1, not UTF-8
    latin.write_bytes(text)
    want = f"d.json: not UTF-8 text (byte 0xe9 at offset {text.index(0xe9)}); save the config as UTF-8"
    assert error_of(latin).endswith(want)


def test_deepspeed_section_is_checked(tmp_path):
    msg = error_of(write(tmp_path, "c.json", {"deepspeed": {"train_batch_size": 8}}))
    assert "deepspeed.train_batch_size" in msg and "train.global_batch_size" in msg
    msg = error_of(write(tmp_path, "d.json", {"deepspeed": {"zero_optimisation": {"stage": 2}}}))
    assert "did you mean 'deepspeed.zero_optimization'" in msg
    msg = error_of(write(tmp_path, "e.json", {"deepspeed": {"zero_optimization": {"stag": 2}}}))
    assert "deepspeed.zero_optimization.stag" in msg
    msg = error_of(write(tmp_path, "f.json", {"deepspeed": {"zero_optimization": {"stage": 5}}}))
    assert msg.endswith("deepspeed.zero_optimization.stage must be 0, 1, 2 or 3 (got 5)")
    msg = error_of(write(tmp_path, "g.json", {"deepspeed": {"bf16": {"enabled": "maybe"}}}))
    assert msg.endswith('deepspeed.bf16.enabled must be true or false (got "maybe")')  # DeepSpeed would refuse it late
    # the rest of the section as DeepSpeed reads it, here and not after the process group has started
    for i, (section, want) in enumerate([
            ({"bf16": {"enable": True}}, "deepspeed: DeepSpeedBF16Config: enable: Extra inputs are not permitted"),
            ({"data_types": {"grad_accum_dtype": "fp17"}}, "DeepSpeed refuses the section: 'fp17' is not a valid"),
            ({"checkpoint": {"tag_validation": "bogus"}}, "DeepSpeed refuses the section: Checkpoint config contains "
                                                          "invalid tag_validation value of BOGUS"),
            ({"steps_per_print": "x"}, 'deepspeed.steps_per_print must be a positive integer or null (got "x")'),
            ({"prescale_gradients": True}, "deepspeed.prescale_gradients: DeepSpeed does not support it with ZeRO "
                                           "stage 2 and reduce_scatter"),
            ({"zero_optimization": {"stage": 3}, "gradient_predivide_factor": 2.0},
             "deepspeed.gradient_predivide_factor: DeepSpeed does not support it with ZeRO stage 3"),
            ({"elasticity": {"enabled": True}}, "deepspeed.elasticity: unknown key"),
            # without ZeRO the engine refuses gradients accumulated in another dtype than the model's
            ({"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
             "deepspeed.data_types.grad_accum_dtype: DeepSpeed accumulates in the model's dtype (bfloat16) without "
             "ZeRO and refuses another at start; use ZeRO stage 2 or 3, or leave it out"),
            # ZeRO-1 would train with DeepSpeed's BF16 optimizer, whose checkpoints zero_to_fp32 cannot read
            ({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
             "deepspeed.data_types.grad_accum_dtype: fp32 under bf16 and ZeRO stage 1 makes DeepSpeed train with its "
             "BF16 optimizer, whose checkpoints megatok's tools (export, evaluate, generate) cannot read"),
            ({"zero_optimization": {"stage": 0}, "data_types": {"grad_accum_dtype": "bf16"}},
             "in the model's dtype (float32) without ZeRO"),
    ]):
        section = {"zero_optimization": {"stage": 2}, **section}
        msg = error_of(write(tmp_path, f"ds{i}.json", {"deepspeed": section}))
        assert want in msg and "\n" not in msg, msg
    ok = {"zero_optimization": {"stage": 2, "reduce_scatter": False}, "prescale_gradients": True,
          "data_types": {"grad_accum_dtype": "fp32"}, "steps_per_print": None}
    assert load_config(write(tmp_path, "ok.json", {"deepspeed": ok})).deepspeed == ok
    for stage in (0, 2, 3):  # the model's own dtype without ZeRO; fp32 accumulation of bf16 under ZeRO-2/3
        ok = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
              "data_types": {"grad_accum_dtype": "bf16" if stage == 0 else "fp32"}}
        assert load_config(write(tmp_path, "ok.json", {"deepspeed": ok})).deepspeed == ok
    # what megatok does itself: accepted (a run that set it stays readable), with a warning at launch
    idle = {"activation_checkpointing": {"partition_activations": "yes"}, "compile": {"deepcompile": True},
            "tensorboard": {"enabled": True}}
    cfg = load_config(write(tmp_path, "idle.json", {"deepspeed": idle}))
    assert warnings_for(cfg) == [
        "deepspeed.activation_checkpointing does nothing here: megatok recomputes blocks itself: set "
        "model.activation_checkpointing",
        "deepspeed.compile does nothing here: megatok compiles its blocks itself: set train.compile",
        "deepspeed.tensorboard does nothing here: megatok writes its metrics rows to TensorBoard itself: set "
        "logging.tensorboard"]
    from megatok.dsconfig import deepspeed_config  # and DeepSpeed is not handed them

    assert not set(idle) & set(deepspeed_config(cfg, 1))


def test_a_directory_given_as_config(tmp_path):
    assert error_of(tmp_path) == f"config: {tmp_path.resolve()} is a directory, not a JSON config"
    msg = error_of(write(tmp_path, "c.json", {"extends": str(tmp_path)}))
    assert msg.endswith(f"extends: {tmp_path} is a directory, not a JSON config")


def test_mixture_weights_are_checked(tmp_path):
    cfg = load_config(write(tmp_path, "ok.json", {"data": {"shards": {"data/web": 3, "data/code": 0.5}}}))
    assert cfg.data.shards == {"data/web": 3.0, "data/code": 0.5}
    msg = error_of(write(tmp_path, "zero.json", {"data": {"shards": {"data/web": 3, "data/code": 0}}}))
    assert "data.shards" in msg and "'data/code' must be a positive finite number, not 0" in msg
    msg = error_of(write(tmp_path, "inf.json", '{"data": {"shards": {"data/web": Infinity}}}'))
    assert msg.endswith('data.shards["data/web"]: inf is not a finite number'), msg
    msg = error_of(write(tmp_path, "text.json", {"data": {"val_shards": {"data/web": "half"}}}))
    assert "data.val_shards" in msg and "'data/web'" in msg
    assert "at least one source" in error_of(write(tmp_path, "empty.json", {"data": {"shards": {}}}))
    for empty in ([], "", " "):
        msg = error_of(write(tmp_path, "none.json", {"data": {"val_shards": empty}}))
        assert "data.val_shards: names no shards" in msg, msg
    assert "data.shards: an empty shard name" in error_of(write(tmp_path, "blank.json", {"data": {"shards": ["a", ""]}}))
    msg = error_of(write(tmp_path, "ints.json", {"data": {"shards": [1, 2]}}))
    assert "data.shards: expected a shard directory or URL pattern, a list of them, or a {source: weight} mixture" in msg


def test_launcher_names_the_mixture_source_short_of_shards(tmp_path, shards):
    p = write(tmp_path, "c.json", {"extends": str(ROOT / "configs/tiny.json"),
                                   "data": {"shards": {str(shards): 1}, "num_workers": 3}})
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "launch/pretrain.py"), "--config", str(p)],
                       capture_output=True, text=True, env=env, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if "[WARNING]" not in ln and ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"data.shards source {shards}: 4 shards for 6 readers" in lines[0]


def test_baseline_needs_two_sequences_per_micro_batch(tmp_path):
    msg = error_of(write(tmp_path, "c.json", {"train": {"micro_batch_size": 1}}), world_size=1)
    assert "batch_baseline" in msg and "micro_batch_size" in msg
    # over the data-parallel ranks, one sequence per rank is enough on 2 ranks, not on 1
    dp = {"train": {"micro_batch_size": 1}, "boundary": {"strategy": "policy", "baseline_scope": "data_parallel"}}
    assert "baseline_scope 'data_parallel' on 2 or more ranks" in error_of(write(tmp_path, "d.json", dp), world_size=1)
    assert load_config(write(tmp_path, "e.json", dp), world_size=2).boundary.options.baseline_scope == "data_parallel"


def test_launcher_fails_before_any_process_group(tmp_path):
    p = write(tmp_path, "c.json", {"extends": str(ROOT / "configs/tiny.json"), "train": {"max_stepss": 3}})
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    t = time.time()
    r = subprocess.run([sys.executable, str(ROOT / "launch/pretrain.py"), "--config", str(p)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if "[WARNING]" not in ln and ln.strip()]
    assert len(lines) == 1 and "train.max_stepss" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and "process group" not in r.stdout + r.stderr
    assert time.time() - t < 60  # MASTER_PORT=1 would have failed or hung an init
    # every rank finds the mistake; only each machine's first says it (not 8 identical lines per node)
    r = subprocess.run([sys.executable, str(ROOT / "launch/pretrain.py"), "--config", str(p)], capture_output=True,
                       text=True, env={**env, "RANK": "1", "LOCAL_RANK": "1"}, timeout=120)
    assert r.returncode == 2 and not [ln for ln in r.stderr.splitlines() if "[WARNING]" not in ln and ln.strip()]


def test_the_configuration_reference_in_docs_is_current():
    r = run_tool("config_reference", "--check", ROOT / "docs/config.md")
    assert r.returncode == 0, r.stderr


def test_a_stale_configuration_reference_is_named_with_the_command_that_refreshes_it(tmp_path):
    from megatok.config_reference import BEGIN, END

    doc = tmp_path / "ref.md"
    doc.write_text(f"intro\n{BEGIN}\nold\n{END}\nrest\n")
    r = run_tool("config_reference", "--check", doc)
    assert r.returncode == 1 and f"megatok-config-reference --write {doc}" in r.stderr
    assert run_tool("config_reference", "--write", doc).returncode == 0
    assert run_tool("config_reference", "--check", doc).returncode == 0
    assert doc.read_text().startswith("intro\n") and doc.read_text().endswith("rest\n")


def test_lr_schedule_warms_up_from_the_first_step_and_decays_to_the_floor(tmp_path):
    from megatok.config import lr_lambda

    cfg = load_config(write(tmp_path, "c.json", {"train": {"max_steps": 100, "warmup_steps": 10, "min_lr_ratio": 0.1}}),
                      world_size=1)
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(0.1)  # the first update already trains
    assert [round(f(s), 6) for s in (4, 9)] == [0.5, 1.0]
    assert f(10) == pytest.approx(1.0) and f(55) == pytest.approx(0.55) and f(100) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 100))
    cfg0 = load_config(None, ["train.warmup_steps=0", "train.max_steps=1"], world_size=1)
    assert lr_lambda(cfg0)(0) == pytest.approx(1.0)


def test_wsd_and_constant_schedules():
    from megatok.config import lr_lambda

    sets = ["train.max_steps=100", "train.warmup_steps=10", "train.min_lr_ratio=0.1"]
    f = lr_lambda(load_config(None, sets + ["train.lr_schedule=wsd", "train.decay_steps=20"], world_size=1))
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)  # the same warmup
    assert all(f(s) == 1.0 for s in range(10, 80))  # stable
    assert f(80) == pytest.approx(1 - 0.9 / 20) and f(89) == pytest.approx(0.55) and f(99) == pytest.approx(0.1)
    assert all(f(s) > f(s + 1) for s in range(79, 99))
    f = lr_lambda(load_config(None, sets + ["train.lr_schedule=wsd"], world_size=1))  # default: the last 20%
    assert f(79) == 1.0 and f(80) < 1.0 and f(99) == pytest.approx(0.1)
    f = lr_lambda(load_config(None, sets + ["train.lr_schedule=constant"], world_size=1))
    assert f(4) == pytest.approx(0.5) and f(10) == f(99) == 1.0
    overlap = r"train.decay_steps=95 is more than train.max_steps \(100\) - train.warmup_steps \(10\)"
    with pytest.raises(ConfigError, match=overlap):
        load_config(None, sets + ["train.lr_schedule=wsd", "train.decay_steps=95"], world_size=1)
    with pytest.raises(ConfigError, match=r"train.decay_steps=4 \(the default, 20% of max_steps\)"):
        load_config(None, ["train.max_steps=20", "train.lr_schedule=wsd"], world_size=1)  # warmup 20
    with pytest.raises(ConfigError, match="train.decay_steps is only for train.lr_schedule 'wsd'"):
        load_config(None, sets + ["train.decay_steps=5"], world_size=1)


def test_a_schedule_longer_than_the_run_is_followed_part_way():
    from megatok.config import lr_lambda

    sets = ["train.warmup_steps=10", "train.min_lr_ratio=0.1"]
    for schedule in ("cosine", "wsd", "constant"):
        whole = lr_lambda(load_config(None, sets + ["train.max_steps=100", f"train.lr_schedule={schedule}"],
                                      world_size=1))
        part = lr_lambda(load_config(None, sets + ["train.max_steps=30", "train.schedule_steps=100",
                                                   f"train.lr_schedule={schedule}"], world_size=1))
        assert [part(s) for s in range(30)] == [whole(s) for s in range(30)]
    alone = lr_lambda(load_config(None, sets + ["train.max_steps=30"], world_size=1))  # its own schedule ends at 30
    assert alone(29) < 0.11 < 0.9 < part(29)
    with pytest.raises(ConfigError, match=r"train.schedule_steps=20 is below train.max_steps \(30\)"):
        load_config(None, sets + ["train.max_steps=30", "train.schedule_steps=20"], world_size=1)
    with pytest.raises(ConfigError, match=r"train.decay_steps=4 \(the default, 20% of schedule_steps\) is more "
                                          r"than train.schedule_steps \(20\)"):
        load_config(None, ["train.max_steps=10", "train.schedule_steps=20", "train.warmup_steps=18",
                           "train.lr_schedule=wsd"], world_size=1)


def test_a_chunk_capacity_is_above_the_target_rate_and_a_static_one_needs_it():
    cfg = load_config(None, ["model.chunk_capacity=0.4", "model.static_chunks=true"], world_size=1)
    assert (cfg.model.chunk_capacity, cfg.model.static_chunks) == (0.4, True)
    with pytest.raises(ConfigError, match=r"model.chunk_capacity=0.1 is below boundary.target_rate \(0.2\)"):
        load_config(None, ["model.chunk_capacity=0.1"], world_size=1)
    with pytest.raises(ConfigError, match="model.static_chunks needs model.chunk_capacity"):
        load_config(None, ["model.static_chunks=true"], world_size=1)
    for bad in ("0", "1.5"):
        with pytest.raises(ConfigError, match="model.chunk_capacity"):
            load_config(None, [f"model.chunk_capacity={bad}"], world_size=1)
    assert load_config(ROOT / "configs/bpe/1b.json", world_size=8).model.kind == "bpe"  # inherits it, ignores it


def test_every_gpu_config_sets_what_a_first_multi_gpu_run_needs():
    """The timeouts of a run whose first step compiles on every rank (and whose rank 0 scores the
    head-to-head while the others wait), compiled blocks and a chunk capacity: docs/training.md's "a first
    multi-GPU run". 100m too, which once extended base.json and its 600 s."""
    for name in ("100m", "350m", "1b", "3b", "7b", "13b"):
        cfg = load_config(ROOT / f"configs/{name}.json", world_size=8)
        t = cfg.train
        got = (t.dist_timeout_s, t.save_timeout_s, t.compile, cfg.model.chunk_capacity)
        assert got == (1800, 3600, True, 0.4), name


def test_keep_every_is_a_multiple_of_save_every():
    cfg = load_config(None, ["train.save_every=50", "train.keep_every=200"], world_size=1)
    assert cfg.train.keep_every == 200
    with pytest.raises(ConfigError, match=r"train.keep_every=120 is not a multiple of train.save_every \(50\)"):
        load_config(None, ["train.save_every=50", "train.keep_every=120"], world_size=1)
    with pytest.raises(ConfigError, match="train.keep_every"):
        load_config(None, ["train.keep_every=0"], world_size=1)


@pytest.mark.parametrize("overrides, message", [
    (["model.n_heads=3"], "config (with --set model.n_heads=3): model.d_model=256 is not divisible by model.n_heads=3"),
    (["model.d_model=100"], "config (with --set model.d_model=100): model.d_model=100 / model.n_heads=4 = 25: rotary "
                            "embeddings need an even head dimension"),
    (["model.d_main=100"], "config (with --set model.d_main=100): the main network's width 100 (model.d_main) / its 4 "
                           "heads (model.n_main_heads, default model.n_heads) = 25: rotary embeddings need an even head "
                           "dimension"),
    (["model.d_main=96", "model.n_main_heads=5"], "the main network's width 96 (model.d_main) is not divisible by its 5 "
                                                  "heads (model.n_main_heads)"),
])
def test_a_sections_own_check_names_its_keys_and_values_once(overrides, message):
    """The model section's checks (given the whole section, not one key) name the keys and values they read,
    with no section prefix repeated and no "(got dict)" from the validation library."""
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides, world_size=1)
    assert str(e.value).endswith(message) and "got dict" not in str(e.value) and "model: model" not in str(e.value)


def test_a_batch_that_does_not_fit_the_world_size_names_where_that_came_from(capsys):
    """A world size a tool chose (megatok-model-size's --gpus, --dry-run's default) is named in the error, so a
    config that fits the ranks it will run on is not edited for ranks nobody asked for."""
    from megatok.size_report import dry_run, print_config_sizes

    with pytest.raises(ConfigError, match=r"x world size \(8, from --gpus 8\); for this many ranks"):
        load_config(None, ["train.micro_batch_size=8", "train.global_batch_size=16"], world_size=8,
                    world_from="--gpus 8")
    assert print_config_sizes(["configs/tiny.json"]) == 2
    assert "world size (8, from --gpus 8 x --nodes 1; give the ranks you will train on)" in capsys.readouterr().err
    assert print_config_sizes(["configs/tiny.json"], gpus=2) == 0
    assert dry_run("configs/tiny.json") == 2
    assert "world size (8, from --dry-run's default 8; --dry-run N for N ranks)" in capsys.readouterr().err


def test_compiling_the_whole_model_needs_the_packed_layout_and_zero_below_3():
    """train.compile 'model' traces the whole forward as one graph: the row layout's host read and ZeRO-3's
    hooks would break it, so the config says so before any process group."""
    msg = error_of(None, ["train.compile=model"])
    assert "train.compile 'model'" in msg and "model.pack_chunks" in msg and "\n" not in msg
    msg = error_of(None, ["train.compile=model", "model.pack_chunks=1.5", "deepspeed.zero_optimization.stage=3"])
    assert "ZeRO stage 0-2" in msg
    assert load_config(None, ["train.compile=model", "model.pack_chunks=1.5"]).train.compile == "model"
    assert load_config(None, ["train.compile=true"]).train.compile is True
