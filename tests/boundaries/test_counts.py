"""Every strategy answers for itself what megatok counts from the config alone: for every strategy and
option that changes its layers or how often they run, the parameters and the matmul FLOPs per byte that
megatok.flops computes equal the instantiated model's (its parameters; torch's FlopCounterMode over a
training forward and an evaluation forward)."""

import json

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from megatok import flops
from megatok.config import load_config
from megatok.model import build_model
from tests.boundaries.tokenizer import tiny_bpe_model

T = 48
SMALL = ["model.d_model=32", "model.n_heads=2", "model.d_main=64", "model.n_main_heads=2", f"data.seq_len={T}",
         "model.n_encoder_layers=1", "model.n_decoder_layers=2"]
CASES = {
    "policy": {},
    "policy-window3": {"window": 3},
    "policy-value": {"value_baseline": True},
    "policy-window3-value": {"window": 3, "value_baseline": True},
    "policy-lag1-window3": {"lag": 1, "window": 3},
    "policy-samples2": {"samples": 2, "logit_cap": 50.0},  # (cap: see below)
    "policy-samples4": {"samples": 4, "logit_cap": 50.0},
    "policy-disarm": {"estimator": "disarm", "samples": 2, "logit_cap": 50.0},
    "policy-margin-schedule": {"start_margin": 0.1, "gamma_start": 0.5, "gamma_steps": 10},
    "hnet": {}, "hnet-no-smoothing": {"smoothing": False},
    "gumbel": {},
    "bpe": {"model_path": None}, "bpe-exact": {"model_path": None, "rule": "exact"},
    "whitespace": {}, "fixed": {}, "uniform": {},
}


def config(case: str):
    options = {k: tiny_bpe_model() if v is None else v for k, v in CASES[case].items()}
    section = {"strategy": case.split("-")[0], "target_rate": 0.25, **options}
    return load_config("configs/tiny.json", [*SMALL, f"boundary={json.dumps(section)}"], world_size=1)


def matmul_flops(model, x, targets=None):
    """torch's count of the matmuls in the model's own layers (the losses' arithmetic left out), and the
    FLOPs the strategy's biases add, which torch does not count and megatok.flops does (2 per element)."""
    biases = []

    def count(module, inputs, output):
        biases.append(2 * module.bias.numel() * inputs[0].shape[:-1].numel())

    hooks = [m.register_forward_hook(count) for m in model.boundary.modules()
             if isinstance(m, nn.Linear) and m.bias is not None]
    with FlopCounterMode(display=False) as counter:
        out = model(x, targets)
    for h in hooks:
        h.remove()
    per_module = counter.get_flop_counts()
    layers = sum(sum(v.values()) for k, v in per_module.items() if k.count(".") == 1 and k.startswith("ByteUNet."))
    return layers + sum(biases), out


@pytest.mark.parametrize("case", list(CASES))
def test_counts_equal_the_instantiated_models(case):
    cfg = config(case)
    assert flops.param_counts(cfg) == flops.meta_param_counts(flops.build_meta_model(cfg))
    torch.manual_seed(0)
    model = build_model(cfg)
    assert flops.param_counts(cfg) == flops.meta_param_counts(model)  # the real one, with its tokenizer
    if cfg.boundary.options.model_dump().get("samples", 1) > 1:
        # every byte a start in every sample (p = sigmoid(33)): the samples of a sequence then have as many
        # chunks as each other, and the main network computes no pad chunks, which megatok.flops leaves out
        nn.init.zeros_(model.boundary.head.weight)
        nn.init.constant_(model.boundary.head.bias, 40.0)
    x = torch.randint(0, 256, (1, T + 1))
    n_enc, n_dec = cfg.model.n_encoder_layers, cfg.model.n_decoder_layers

    def rate(out):
        return out.boundaries.starts.sum().item() / out.boundaries.starts.numel()

    # evaluation: one pass; attention is left out (on a CPU torch does not count SDPA's kernel)
    with torch.no_grad():
        counted, out = matmul_flops(model.eval(), x[:, :-1])
    f = flops.flops_per_byte(cfg, rate=rate(out))
    assert counted == pytest.approx(T * (f["forward"] - f["byte_attention"] - f["main_attention"]), rel=1e-9)

    # training: with K samples per sequence, everything after the encoder and its early-exit head K times
    counted, out = matmul_flops(model.train(), x[:, :-1], x[:, 1:])
    K = out.boundaries.starts.shape[0]
    f = flops.flops_per_byte(cfg, rate=rate(out))
    attention = f["byte_attention"] * (n_enc + K * n_dec) / (n_enc + n_dec) + K * f["main_attention"]
    assert counted == pytest.approx(T * (f["training"] / 3 - attention), rel=1e-9)
    assert K == cfg.boundary.options.model_dump().get("samples", 1)
