"""train.compile 'model' (megatok.model.blocks.compile_training_forward): the packed model's whole training
forward (byte layers, policy, main network, heads, losses, discounted returns) traces as one graph with no
break, and 200 training steps of a learning policy, across its start step and its latch, compile it once;
the losses and gradients are eager's."""

import pytest
import torch
from torch._dynamo.utils import counters

from megatok.config import load_config
from megatok.model.blocks import compile_training_forward
from megatok.model.unet import ByteUNet
from megatok.perf.plain_step import adamw, plain_step

SETS = ["data.seq_len=64", "model.d_model=32", "model.n_heads=2", "model.n_main_layers=1", "model.pack_chunks=1.5",
        "train.micro_batch_size=2", "boundary.start_step=20", "boundary.start_margin=0.0001"]


SCHEDULES = ["boundary.gamma_start=0.5", "boundary.gamma_steps=40", "boundary.explore=0.3", "boundary.explore_steps=40",
             "boundary.entropy=0.01"]


def model_and_batches(steps=200, sets=()):
    cfg = load_config("configs/tiny.json", [*SETS, *sets], world_size=1)
    torch.manual_seed(0)
    model = ByteUNet(cfg.model, cfg.boundary).train()
    g = torch.Generator().manual_seed(0)
    text = torch.randint(97, 123, (steps, 2, 65), generator=g)
    text[:, :, ::6] = 32  # words
    return cfg, model, text


def test_two_hundred_learning_steps_compile_once_without_a_break(monkeypatch):
    from megatok.model import blocks

    monkeypatch.setattr(blocks, "COMPILE_BACKEND", "eager")  # dynamo's tracing, guards and graphs; no codegen
    torch._dynamo.reset()
    counters.clear()
    cfg, model, text = model_and_batches()
    compile_training_forward(model)  # fullgraph: a graph break raises
    opt = adamw(model, cfg.train, torch.device("cpu"))
    for step, batch in enumerate(text):
        model.boundary.step = step
        plain_step(model, opt, batch, grad_clip=1.0, bf16=False)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # no recompile in 200 steps
    assert bool(model.boundary.started)  # the latch opened: the policy learned in the same graph
    model.eval()  # evaluation stays eager (no new graph)
    with torch.no_grad():
        model(text[0, :, :-1])
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("schedules, step", [(False, 30), (True, 20), (True, 50)],
                         ids=["latch", "mid-schedule", "past-schedules"])
def test_the_compiled_forward_gives_eagers_loss_and_gradients(monkeypatch, schedules, step):
    """The same weights and draws, eagerly and compiled: the loss and every gradient (with gamma, explore and
    entropy schedules: in them, and past their ends, where compiled code keeps the terms at a share of 0)."""
    from megatok.model import blocks

    monkeypatch.setattr(blocks, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    _, model, text = model_and_batches(steps=1, sets=SCHEDULES if schedules else ())
    x, y = text[0, :, :-1], text[0, :, 1:]
    model.boundary.step = step
    model.boundary.started.fill_(True)  # the latch open: the policy's terms and their gradients in play
    got, state = [], {k: v.clone() for k, v in model.boundary.state_dict().items()}  # the latch, which a call moves
    for compiled in (False, True):
        if compiled:
            compile_training_forward(model)
            model.boundary.load_state_dict(state)
        model.zero_grad()
        torch.manual_seed(1)
        out = model(x, y)
        out.loss.backward()
        got.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = got
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-5, atol=1e-7, msg=name)


def test_schedules_moving_with_the_step_compile_once_and_match_eager(monkeypatch):
    """gamma_start/gamma_steps, explore/explore_steps and entropy move with the step: compiled, they are tensors
    of the step (no recompile through and past their schedules), and a step mid-schedule gives eager's loss."""
    from megatok.model import blocks

    monkeypatch.setattr(blocks, "COMPILE_BACKEND", "eager")
    cfg = load_config("configs/tiny.json", [*SETS, *SCHEDULES], world_size=1)
    text = model_and_batches(steps=60)[2]
    losses = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = ByteUNet(cfg.model, cfg.boundary).train()
        if compiled:
            compile_training_forward(model)
        opt = adamw(model, cfg.train, torch.device("cpu"))
        got = []
        for step, batch in enumerate(text):
            model.boundary.step = step
            torch.manual_seed(100 + step)
            got.append(plain_step(model, opt, batch, grad_clip=1.0, bf16=False).loss.detach())
        losses.append(torch.tensor([float(x) for x in got]))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # steps 0-59 cross both schedules' ends
    eager, compiled = losses
    torch.testing.assert_close(compiled[:30], eager[:30], rtol=1e-4, atol=1e-5)  # mid-schedule: the same steps


def test_whitespace_chunks_compile_once(monkeypatch):
    """The separator table is built in the graph while compiling (a cache filled while tracing recompiled)."""
    from megatok.model import blocks

    monkeypatch.setattr(blocks, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    counters.clear()
    cfg = load_config("configs/tiny.json", [*SETS[:-2], "boundary.strategy=whitespace"], world_size=1)
    torch.manual_seed(0)
    model = ByteUNet(cfg.model, cfg.boundary).train()
    compile_training_forward(model)
    opt = adamw(model, cfg.train, torch.device("cpu"))
    for batch in model_and_batches(steps=4)[2]:
        plain_step(model, opt, batch, grad_clip=1.0, bf16=False)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
