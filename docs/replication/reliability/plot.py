"""mechanism.png from the files in this directory: the published policy on the control (level 1) on a seed
where it aligns (11) and one where it avoids the spaces before words (14), at level 0 where nothing pays
(seed 11), a quarter of the pace alone (lr_scale 0.25, no latch) and megatok's default (that pace and the latch,
which opened at step 240) on seed 14, and uniform chunks (seed 0). Panels: the share of
spaces before words that start a chunk in each training row; the capped logit there minus elsewhere; the
estimator's mean per-decision term at those spaces (u = G (b - p), what moves their logit); and, from
megatok-boundary-value at the runs' checkpoints, what the main network carries across chunks (bits per byte
saved by the run's own chunks over one chunk per window).

    python docs/replication/reliability/plot.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RUNS = {"published-L1-seed11": ("published, level 1, seed 11 (aligns)", "C0", "-"),
        "published-L1-seed14": ("published, level 1, seed 14 (avoids)", "C3", "-"),
        "published-L0-seed11": ("published, level 0, seed 11 (drifts)", "C1", "--"),
        "slow-L1-seed14": ("lr_scale 0.25 alone, level 1, seed 14", "C2", "--"),
        "default-L1-seed14": ("default (lr_scale 0.25 and the latch), level 1, seed 14", "C2", "-"),
        "uniform-L1-seed0": ("uniform chunks, level 1, seed 0", "C7", ":")}


def rows(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("split") == "train"]


def main() -> None:
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    for name, (label, color, ls) in RUNS.items():
        style = {"color": color, "ls": ls, "lw": 1.3, "label": label}
        r = rows(HERE / f"metrics-{name}.jsonl")
        steps = [x["step"] for x in r]
        axes[0].plot(steps, [x["sbw_boundary_fraction"] for x in r], **style)
        if "logit_sbw" in r[0]:
            axes[1].plot(steps, [x["logit_sbw"] - x["logit_other"] for x in r], **style)
            axes[2].plot(steps, [x["u_sbw"] for x in r], **style)
        probe = HERE / f"probe-{name}.json"
        if probe.is_file():
            trend = json.loads(probe.read_text())["trend"]
            axes[3].plot([t["step"] for t in trend], [t["context"] for t in trend], marker="o", ms=3, **style)
    axes[0].set(ylabel="spaces before words that start a chunk", ylim=(0, 1.02))
    axes[1].set(ylabel="logit at those spaces - elsewhere (mean)")
    axes[2].set(ylabel="mean G (b - p) at those spaces", ylim=(-0.05, 0.2))
    axes[3].set(ylabel="main network's context (bits per byte)")
    for ax in axes:
        ax.set_xlabel("step (16 x 256 bytes)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="center right")
    fig.suptitle("The control: what sets the direction (published estimator) and the reliable default", fontsize=10)
    fig.tight_layout()
    fig.savefig(HERE / "mechanism.png", dpi=110)


if __name__ == "__main__":
    main()
