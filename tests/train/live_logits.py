"""Helper for test_reliability: logits of a live DeepSpeed engine that has loaded a run's checkpoint.

    python tests/train/live_logits.py RUN_DIR OUT.pt

Builds the engine exactly as training does (same config, real deepspeed.initialize, one rank),
loads the latest checkpoint, and saves next-byte logits for a fixed input with deterministic
(threshold) boundaries.
"""

import sys

import deepspeed
import torch
from safetensors.torch import save_file

from megatok.dsconfig import deepspeed_config
from megatok.model.unet import ByteUNet
from megatok.run.checkpoints import latest_tag
from megatok.run.reader import run_config
from megatok.train import checkpointer, dist
from megatok.train.engine import param_groups


def main(run_dir: str, out: str) -> None:
    dist.init(60)
    cfg = run_config(run_dir)
    model = ByteUNet(cfg.model, cfg.boundary)
    engine, *_ = deepspeed.initialize(model=model, config=deepspeed_config(cfg, 1),
                                      model_parameters=param_groups(model, 0.0))
    checkpointer.load(engine, run_dir, latest_tag(run_dir))
    engine.eval()
    engine.module.boundary.eval_mode = "threshold"
    x = torch.tensor([list(b"def main(argv=None):\n    return 0\n" * 2)], dtype=torch.long)
    with torch.no_grad():
        logits = engine(x).logits.float()
    save_file({"x": x, "logits": logits.contiguous()}, out)
    dist.finish()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
