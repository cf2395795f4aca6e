"""AdamW's fused step on CUDA (megatok.dsconfig.deepspeed_config): asked for where DeepSpeed runs on CUDA
and not under optimizer offload, and DeepSpeed hands it to torch's AdamW, whose update it leaves as it was
(checked on the CPU, where torch has a fused AdamW too, through a real engine under ZeRO-2)."""

import json
import subprocess
import sys

import torch

from megatok.config import load_config
from megatok.dsconfig import deepspeed_config
from tests.conftest import ROOT, TOOL_ENV


def test_fused_where_deepspeed_runs_on_cuda(monkeypatch):
    cfg = load_config(ROOT / "configs" / "tiny.json", world_size=1)
    params = lambda **kw: deepspeed_config(cfg, 1, **kw)["optimizer"]["params"]  # noqa: E731
    assert params(fused_adam=True)["fused"] is True and params(fused_adam=True)["torch_adam"] is True
    assert "fused" not in params(fused_adam=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert params()["fused"] is True  # a GPU, and DeepSpeed left to find it
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert "fused" not in params()  # DeepSpeed told to run on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("DS_ACCELERATOR")
    assert "fused" not in params()
    offload = load_config(ROOT / "configs" / "tiny.json", ["deepspeed.zero_optimization.offload_optimizer.device=cpu"],
                          world_size=1)
    assert "fused" not in deepspeed_config(offload, 1, fused_adam=True)["optimizer"]["params"]  # DeepSpeed's CPU Adam


ENGINE = """
import json, deepspeed, torch
from megatok.config import load_config
from megatok.dsconfig import deepspeed_config
from megatok.model import build_model
from megatok.train import dist
from megatok.train.engine import param_groups

dist.init(60)
cfg = load_config("configs/tiny.json", ["model.d_model=32", "model.n_heads=2", "train.micro_batch_size=2",
                                        "train.global_batch_size=2"], world_size=1)
out = {}
for fused in (False, True):
    torch.manual_seed(0)
    model = build_model(cfg)
    out["init"] = [float(p.double().sum()) for p in model.parameters()]
    engine, *_ = deepspeed.initialize(model=model, config=deepspeed_config(cfg, 1, fused_adam=fused),
                                      model_parameters=param_groups(model, 0.1))
    x = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(1))
    for step in range(2):
        torch.manual_seed(step)
        loss = engine(x[:, :-1], x[:, 1:]).loss
        engine.backward(loss)
        engine.step()
    out[fused] = {"fused": [g.get("fused") for g in engine.optimizer.optimizer.param_groups],
                  "weights": [float(p.double().sum()) for p in engine.module.parameters()]}
print(json.dumps(out))
dist.finish()
"""


def test_deepspeed_builds_the_fused_adamw_and_it_updates_as_the_plain_one():
    env = {k: v for k, v in TOOL_ENV.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    r = subprocess.run([sys.executable, "-c", ENGINE], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["true"]["fused"] == [True] * 4 and not any(out["false"]["fused"])  # 4: the policy's own groups
    a, b, init = out["false"]["weights"], out["true"]["weights"], out["init"]
    assert len(a) == len(b) == len(init)
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5 < max(abs(x - y) for x, y in zip(a, init))
