"""The size tables in docs/scaling.md are what the code computes today: each row of the configs table
is rebuilt from megatok-model-size's summary (the configs, megatok/flops.py, megatok/sizing.py), each
row of the shapes table and of the BPE baselines table from the configs, and must appear in the file
as it is. A change to the formulas or the configs that leaves the published figures behind fails here."""

from __future__ import annotations


import pytest

from megatok import flops, size_report, sizing
from megatok.config import load_config
from tests.conftest import ROOT

SIZES = ["100m", "350m", "1b", "3b", "7b", "13b"]


def _summary_rows(paths: list[str]) -> list[list[str]]:
    reports = []
    for path in paths:
        report = sizing.size_report(load_config(ROOT / path, world_size=8), gpus=8, nodes=1)
        report["config"] = path
        reports.append(report)
    lines = size_report.summary_table(reports).splitlines()[2:]  # the header and the rule
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


@pytest.fixture(scope="module")
def unet_rows():
    return dict(zip(SIZES, _summary_rows([f"configs/{s}.json" for s in SIZES])))


@pytest.fixture(scope="module")
def scaling_md() -> str:
    return (ROOT / "docs" / "scaling.md").read_text()


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def _lr(lr: float) -> str:
    """1.5e-3 as written in the table (0.0015 -> "1.5e-3", 0.0005 -> "5e-4")."""
    mantissa, exponent = f"{lr:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def test_the_size_table_is_the_calculators(unet_rows, scaling_md):
    for size, cells in unet_rows.items():
        assert _row(cells) in scaling_md, f"docs/scaling.md: the {size} row is not {_row(cells)}"


def test_the_shapes_table_is_the_configs(scaling_md):
    for size in SIZES:
        cfg = load_config(ROOT / "configs" / f"{size}.json", world_size=8)
        m, t = cfg.model, cfg.train
        d_main, main_heads = m.d_main or m.d_model, m.n_main_heads or m.n_heads
        batch_mib = t.global_batch_size * cfg.data.seq_len / 2**20
        row = _row([size, f"{m.d_model} / {m.n_heads}", f"{m.n_encoder_layers} + {m.n_decoder_layers}",
                    f"{d_main} / {main_heads}", str(m.n_main_layers), _lr(t.lr),
                    f"{t.global_batch_size} ({batch_mib:g} MiB)", "yes" if m.activation_checkpointing else "no"])
        assert row in scaling_md, f"docs/scaling.md: the {size} shape row is not {row}"


def test_the_bpe_baseline_table_is_the_configs(unet_rows, scaling_md):
    for size in SIZES:
        unet = load_config(ROOT / "configs" / f"{size}.json", world_size=8)
        bpe = load_config(ROOT / "configs" / "bpe" / f"{size}.json", world_size=8)
        m = bpe.model
        ratio = flops.flops_per_byte(bpe)["training"] / flops.flops_per_byte(unet)["training"]
        params = f"{flops.param_counts(bpe)['total'] / 1e6:,.0f}M"
        row = _row([size, unet_rows[size][1], f"{m.d_main} x {m.n_main_layers} ({m.n_main_heads})", params,
                    f"{ratio:.3f}", str(bpe.data.seq_len)])
        assert row in scaling_md, f"docs/scaling.md: the {size} BPE row is not {row}"
