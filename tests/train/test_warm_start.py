"""train.init_from (megatok.train.warm_start): a fresh run whose weights start from another run's
checkpoint, copied where names and shapes agree; what is not copied is named; mistakes are one line."""

import pytest
import torch

from megatok.config import ConfigError, load_config
from megatok.model import build_model
from megatok.run.checkpoints import latest_tag
from megatok.run.reader import consolidated_state_dict, run_config
from megatok.train.warm_start import warm_start
from tests.conftest import TINY, pretrain


def config(shards, tmp_path, *sets):
    return load_config("configs/tiny.json", [*TINY, f"data.shards={shards}", f"train.run_dir={tmp_path / 'b'}",
                                             *sets], world_size=1)


def test_shared_weights_are_copied_and_the_new_strategys_keep_their_initial_values(tiny_run, shards, tmp_path):
    source = consolidated_state_dict(tiny_run, latest_tag(tiny_run), run_config(tiny_run))
    cfg = config(shards, tmp_path, "boundary.value_baseline=true", f"train.init_from={tiny_run}")
    torch.manual_seed(0)
    model = build_model(cfg)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    said = warm_start(model, cfg)
    own = model.state_dict()
    assert "initial values kept: boundary.value_head.weight, boundary.value_head.bias;" in said
    assert said.endswith("not in this model: none") and f"{len(source)} tensors copied" in said
    for name, value in own.items():
        want = source[name] if name in source else fresh[name]
        assert torch.equal(value, want), name
    assert sum(not torch.equal(own[n], fresh[n]) for n in source) > len(source) // 2  # copied, not equal by chance
    # a checkpoint named by its path; the strategy the source trained with is left out
    cfg = config(shards, tmp_path, "boundary.strategy=whitespace",
                 f"train.init_from={tiny_run}/checkpoints/{latest_tag(tiny_run)}")
    said = warm_start(build_model(cfg), cfg)
    assert said.endswith("not in this model: boundary.started, boundary.gap_ema, boundary.head.weight, "
                         "boundary.head.bias")  # the policy's latch (its buffers) and its head


@pytest.mark.parametrize("sets, error", [
    (["train.init_from={tmp}/nowhere"], r"^train.init_from: .*nowhere.*no config.json"),
    (["train.init_from={run}/checkpoints/step99"], r"^train.init_from: .*step99: checkpoint not found"),
    (["train.init_from={run}", "model.d_model=64"], r"^train.init_from: \S+ is \(\d+(, \d+)*\) in .* here"),
    (["train.init_from={run}", 'deepspeed={{"zero_optimization": {{"stage": 3}}}}'], r"set train.zero_init false"),
])
def test_a_source_that_cannot_start_this_model_is_one_error(tiny_run, shards, tmp_path, sets, error):
    cfg = config(shards, tmp_path, *(s.format(tmp=tmp_path, run=tiny_run) for s in sets))
    with pytest.raises(ConfigError, match=error):
        warm_start(build_model(cfg), cfg)


def test_the_trainer_starts_from_the_source_and_a_bad_one_fails_before_any_process_group(tiny_run, shards,
                                                                                          tmp_path):
    args = ["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", "train.max_steps=1",
            "train.micro_batch_size=2", "train.global_batch_size=2", "boundary.strategy=whitespace"]
    r = pretrain([*args, f"train.run_dir={tmp_path / 'b'}", f"train.init_from={tiny_run}"])
    assert f"megatok: weights from {tiny_run} {latest_tag(tiny_run)}:" in r.stdout
    r = pretrain([*args, f"train.run_dir={tmp_path / 'c'}", f"train.init_from={tmp_path / 'none'}"], check=False)
    assert r.returncode == 2 and "train.init_from:" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "c").exists()
