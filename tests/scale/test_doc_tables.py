"""The size tables in README.md ("Scaling up") and docs/scaling.md are what the code computes today:
each row is rebuilt from megatok-model-size's summary (the configs, megatok/flops.py, megatok/sizing.py)
and must appear in the file as it is. A change to the formulas or the configs that leaves the published
figures behind fails here (the FLOPs of the up projection once did)."""

from __future__ import annotations


import pytest

from megatok import flops, sizing
from megatok.config import load_config
from tests.conftest import ROOT

SIZES = ["100m", "350m", "1b", "3b", "7b", "13b"]


def _summary_rows(paths: list[str]) -> list[list[str]]:
    from megatok.cli import model_size as tool

    reports = []
    for path in paths:
        report = sizing.size_report(load_config(ROOT / path, world_size=8), gpus=8, nodes=1)
        report["config"] = path
        reports.append(report)
    lines = tool.summary(reports).splitlines()[2:]  # the header and the rule
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


@pytest.fixture(scope="module")
def unet_rows():
    return dict(zip(SIZES, _summary_rows([f"configs/{s}.json" for s in SIZES])))


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def test_the_size_tables_are_the_calculators(unet_rows):
    docs, readme = (ROOT / "docs" / "scaling.md").read_text(), (ROOT / "README.md").read_text()
    for size, cells in unet_rows.items():
        assert _row(cells) in docs, f"docs/scaling.md: the {size} row is not {_row(cells)}"
        # README: no training-FLOPs column; the ZeRO column says where activation checkpointing is on
        name, params, main, fpb, byte_share, stage, batch, gib, n_bytes, _ = cells
        ckpt = load_config(ROOT / "configs" / f"{size}.json", world_size=8).model.activation_checkpointing
        row = _row([size, params, main, fpb, byte_share, stage + (" + ckpt" if ckpt else ""), batch, gib, n_bytes])
        assert row in readme, f"README.md: the {size} row is not {row}"


def test_the_bpe_baseline_tables_are_the_configs(unet_rows):
    docs, readme = (ROOT / "docs" / "scaling.md").read_text(), (ROOT / "README.md").read_text()
    for size in SIZES:
        unet = load_config(ROOT / "configs" / f"{size}.json", world_size=8)
        bpe = load_config(ROOT / "configs" / "bpe" / f"{size}.json", world_size=8)
        m = bpe.model
        ratio = flops.flops_per_byte(bpe)["training"] / flops.flops_per_byte(unet)["training"]
        params = f"{flops.param_counts(bpe)['total'] / 1e6:,.0f}M"
        common = [size, unet_rows[size][1]]
        row = _row(common + [f"{m.d_main} x {m.n_main_layers}", params, f"{ratio:.3f}", str(bpe.data.seq_len)])
        assert row in readme, f"README.md: the {size} BPE row is not {row}"
        row = _row(common + [f"{m.d_main} x {m.n_main_layers} ({m.n_main_heads})", params, f"{ratio:.3f}"])
        assert row in docs, f"docs/scaling.md: the {size} BPE row is not {row}"
