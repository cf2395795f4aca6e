"""handover.png from the metrics rows in this directory: the fraction of words' first bytes (after a space)
that start a chunk in each training row, for every hand-over arm and seed.

    python docs/replication/prose-handover/plot.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
ARMS = {"lag1": ("policy, lag 1", "C0"), "lag0": ("policy, lag 0 (published)", "C1"),
        "ws": ("whitespace (continued)", "C2"), "uniform": ("uniform", "C7")}


def rows(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("split") == "train"]


def main() -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for path in sorted(HERE.glob("metrics-ho-*.jsonl")):
        arm, seed = path.stem.removeprefix("metrics-ho-").rsplit("-seed", 1)
        label, color = ARMS[arm]
        r = rows(path)
        ax.plot([x["step"] for x in r], [x["wfb_boundary_fraction"] for x in r], color=color,
                alpha=0.8, lw=1.2, label=label if seed == "3" else None, ls="-" if seed == "3" else "--")
    ax.set(xlabel="steps after the hand-over (16 x 1024 bytes each)", ylabel="words' first bytes that start a chunk",
           ylim=(0, 1.02), title="cpu-small from a whitespace run's step 200 (solid: seed 3; dashed: others)")
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "handover.png", dpi=110)


if __name__ == "__main__":
    main()
