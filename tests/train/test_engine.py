"""The Engine (megatok.train.engine) on its own, in this process: the model under the real DeepSpeed
engine, its parameter groups, its step, and the skipped updates it counts and bounds (its state)."""

import pytest
import torch

from megatok.train.engine import param_groups
from tests.train.conftest import engine_step, random_batch, tiny_config, tiny_engine


def weights(engine):
    return [p.detach().clone() for p in engine.ds.module.parameters()]


def test_the_engine_trains_on_inputs_and_next_bytes_with_weight_decay_on_matrices_only(single_rank, shards,
                                                                                        tmp_path):
    cfg = tiny_config(shards, tmp_path, "train.weight_decay=0.1")
    engine = tiny_engine(cfg)
    tokens = random_batch(cfg)
    with torch.no_grad():
        torch.manual_seed(1)
        want = engine.ds.module(tokens[:, :-1], tokens[:, 1:]).loss
        torch.manual_seed(1)
        assert engine.forward(tokens).loss == want  # inputs tokens[:, :-1], targets tokens[:, 1:]
    # the policy's own parameters (its default lr_scale) are the last two groups, with the same weight decay rule
    decay, rest, own_decay, own_rest = param_groups(engine.ds.module, 0.1)
    for d, r in ((decay, rest), (own_decay, own_rest)):
        assert {p.dim() for p in d["params"]} == {2} and {p.dim() for p in r["params"]} == {1}
    assert {id(p) for g in (own_decay, own_rest) for p in g["params"]} == {
        id(p) for p in engine.ds.module.boundary.parameters()}
    assert sum(len(g["params"]) for g in (decay, rest, own_decay, own_rest)) == len(list(engine.ds.module.parameters()))
    assert [g["weight_decay"] for g in engine.ds.optimizer.param_groups] == [0.1, 0.0, 0.1, 0.0]
    assert engine.lr == cfg.train.lr / cfg.train.warmup_steps  # the first step's
    before = weights(engine)
    assert engine_step(engine, 1, tokens) == 0
    own = [id(p) in {id(q) for q in engine.ds.module.boundary.parameters()} for p in engine.ds.module.parameters()]
    moved = [not torch.equal(w, p) for w, p in zip(before, weights(engine))]
    assert all(m for m, o, w in zip(moved, own, before) if w.dim() == 2 and not o)  # every other matrix trains
    assert not any(m for m, o in zip(moved, own) if o)  # the policy's heads wait for start_step (50)


def test_skipped_updates_are_counted_and_a_streak_longer_than_the_limit_ends_the_run(single_rank, shards,
                                                                                   tmp_path):
    """ZeRO-2 skips an update whose gradients are not finite: the engine counts it, the streak goes on
    across a resume (its state), and more than train.max_skipped_steps in a row end the run. ZeRO-0
    cannot skip: a non-finite loss ends the run at once."""
    cfg = tiny_config(shards, tmp_path, "train.max_skipped_steps=2")
    engine, tokens = tiny_engine(cfg), random_batch(cfg)
    before = weights(engine)
    assert [engine_step(engine, 1, tokens, True), engine_step(engine, 2, tokens, True)] == [1, 1]
    assert all(torch.equal(w, p) for w, p in zip(before, weights(engine)))  # no update
    assert [engine_step(engine, 3, tokens), engine_step(engine, 4, tokens, True)] == [0, 1]
    assert engine.state_dict() == {"zero_stage": 2, "precision": "fp32", "skipped_in_row": 1, "optimizer_groups": 4}
    resumed = tiny_engine(cfg)
    resumed.load_state_dict(engine.state_dict())
    assert engine_step(resumed, 5, tokens, True) == 1  # the second in a row
    with pytest.raises(FloatingPointError, match=r"3 optimizer steps in a row skipped for non-finite gradients "
                                                 r"\(train.max_skipped_steps=2\) at step 6"):
        engine_step(resumed, 6, tokens, True)

    zero0 = tiny_engine(tiny_config(shards, tmp_path, "deepspeed.zero_optimization.stage=0"))
    with pytest.raises(FloatingPointError, match="non-finite loss at step 1 under ZeRO stage 0"):
        engine_step(zero0, 1, tokens, True)


def test_the_policys_own_learning_rate_under_the_deepspeed_engine(single_rank, shards, tmp_path):
    """With start_step 2 and lr_scale 0.5 the policy's parameters are their own optimizer groups: they stay
    put for two updates while the rest of the model trains, then move at half the model's learning rate;
    a resumed engine restores each group's rate."""
    cfg = tiny_config(shards, tmp_path, "boundary.strategy=policy", "boundary.start_step=2", "boundary.lr_scale=0.5",
                      "boundary.start_margin=null", "deepspeed.zero_optimization.stage=2")  # no latch after step 2
    engine, tokens = tiny_engine(cfg), random_batch(cfg)
    model = engine.ds.module
    groups = param_groups(model, 0.1)
    assert len(groups) == 4 and {id(p) for g in groups[2:] for p in g["params"]} == {
        id(p) for p in model.boundary.parameters()}

    def head():
        return [p.detach().clone() for p in model.boundary.parameters()]

    def rest():
        return [p.detach().clone() for n, p in model.named_parameters() if not n.startswith("boundary.")]

    h0, r0 = head(), rest()
    for n in (1, 2):
        engine_step(engine, n, tokens)
    assert all(torch.equal(a, b) for a, b in zip(h0, head()))
    assert not all(torch.equal(a, b) for a, b in zip(r0, rest()))
    lrs = [g["lr"] for g in engine.ds.optimizer.param_groups]
    assert lrs[2] == lrs[3] == pytest.approx(0.5 * lrs[0]) and lrs[0] > 0  # for update 3
    engine_step(engine, 3, tokens)
    assert not all(torch.equal(a, b) for a, b in zip(h0, head()))
    resumed = tiny_engine(cfg)
    resumed.ds.lr_scheduler.last_epoch = engine.ds.lr_scheduler.last_epoch
    resumed.load_state_dict(engine.state_dict())
    assert [g["lr"] for g in resumed.ds.optimizer.param_groups] == pytest.approx(
        [g["lr"] for g in engine.ds.optimizer.param_groups])
    published = tiny_engine(tiny_config(shards, tmp_path, "boundary.strategy=policy", "boundary.lr_scale=1.0",
                                        "boundary.start_step=0", "boundary.start_margin=null",
                                        "boundary.lr_hold=false"))
    assert len(published.ds.optimizer.param_groups) == 2  # the published setting: the groups (and checkpoints) of before


@pytest.mark.parametrize("hold", [True, False])
def test_the_policys_held_learning_rate_stays_at_its_peak_while_the_models_decays(hold, shards, tmp_path):
    """lr_hold (the default): after the model's warmup the heads' factor is lr_scale x the peak, whatever the
    model's cosine has decayed to; lr_hold false: lr_scale x the model's factor at every step."""
    from megatok.config import lr_lambda
    from megatok.flops import build_meta_model
    from megatok.train.engine import group_schedules

    cfg = tiny_config(shards, tmp_path, "boundary.strategy=policy", "boundary.start_step=3", "boundary.lr_scale=0.5",
                      f"boundary.lr_hold={str(hold).lower()}", "train.warmup_steps=5", "train.max_steps=100",
                      "train.lr_schedule=cosine", "train.min_lr_ratio=0.1")
    model, schedule = build_meta_model(cfg), lr_lambda(cfg)
    main, _, own, _ = group_schedules(model, schedule, 4, cfg.train.warmup_steps)
    assert [own(s) for s in (0, 2)] == [0, 0]  # before start_step
    assert own(3) == pytest.approx(0.5 * schedule(3)) and schedule(3) < 1  # in warmup: the model's ramp
    assert main(99) == pytest.approx(0.1, abs=1e-3)  # the model at the end of its cosine
    assert [own(s) for s in (5, 50, 99)] == pytest.approx([0.5, 0.5, 0.5] if hold else [0.5 * schedule(s)
                                                                                        for s in (5, 50, 99)])
