"""handover.png from the files in this directory and ../prose-trend/heldout.json: left, the fraction of
words' first bytes (after a space) that start a chunk in each training row, for every hand-over arm and
seed; right, each arm's held-out bits per byte at each scored step minus its uniform twin's (same seed,
same checkpoint step: the same starting model and data order), seed by seed; third, the lag-1 policy's
words' first bytes handed over at the whitespace run's step 100 (metrics-ho100-*) against step 200.

    python docs/replication/prose-handover/plot.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
ARMS = {"lag1": ("policy, lag 1", "C0"), "lag0": ("policy, lag 0 (published)", "C1"),
        "ws": ("whitespace (continued)", "C2"), "hnet": ("hnet", "C3"), "fixed": ("fixed", "C5"),
        "uniform": ("uniform", "C7")}
MARKERS = {"2": "s", "3": "o", "4": "^"}


def rows(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("split") == "train"]


def main() -> None:
    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(16, 4.2), gridspec_kw={"width_ratios": [3, 2, 2]})
    for path in sorted(HERE.glob("metrics-ho-*.jsonl")):
        arm, seed = path.stem.removeprefix("metrics-ho-").rsplit("-seed", 1)
        label, color = ARMS[arm]
        r = rows(path)
        ax.plot([x["step"] for x in r], [x["wfb_boundary_fraction"] for x in r], color=color,
                alpha=0.8, lw=1.2, label=label if seed == "3" else None, ls="-" if seed == "3" else "--")
    ax.set(xlabel="steps after the hand-over (16 x 1024 bytes each)", ylabel="words' first bytes that start a chunk",
           ylim=(0, 1.02), title="cpu-small from a whitespace run's step 200 (solid: seed 3; dashed: others)")
    ax.legend(loc="center right", fontsize=8)
    held = json.loads((HERE.parent / "prose-trend" / "heldout.json").read_text())["runs"]
    arms = [a for a in ARMS if a != "uniform"]
    for i, arm in enumerate(arms):
        for seed, marker in MARKERS.items():
            base = held.get(f"ho-uniform-seed{seed}", {})
            for tag, scored in held.get(f"ho-{arm}-seed{seed}", {}).items():
                if tag in base:
                    x = i + (0.15 if tag == "step00000400" else -0.15)
                    bx.scatter(x, scored["bpb"] - base[tag]["bpb"], color=ARMS[arm][1], marker=marker,
                               facecolors="none" if tag == "step00000400" else ARMS[arm][1])
    bx.axhline(0, color="gray", lw=0.8)
    bx.set_xticks(range(len(arms)), [ARMS[a][0].replace(" (", "\n(") for a in arms], fontsize=7)
    bx.set(ylabel="held-out bpb minus uniform's (same seed)",
           title="filled: 200 steps after; hollow: 400. square/circle/triangle: seed 2/3/4")
    bx.title.set_fontsize(8)
    bx.grid(alpha=0.3, axis="y")
    for start, pattern, color in (("200", "metrics-ho-lag1-seed*.jsonl", "C0"), ("100", "metrics-ho100-lag1-seed*.jsonl", "C9")):
        for path in sorted(HERE.glob(pattern)):
            seed = path.stem.rsplit("-seed", 1)[1]
            r = [x for x in rows(path) if x["step"] <= 200]
            cx.plot([x["step"] for x in r], [x["wfb_boundary_fraction"] for x in r], color=color, lw=1.2,
                    ls="-" if seed == "3" else "--", label=f"from step {start}" if seed == "3" else None)
    cx.set(xlabel="steps after the hand-over", ylim=(0, 1.02),
           title="policy, lag 1, handed over at the whitespace run's step 100 or 200")
    cx.title.set_fontsize(8)
    cx.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "handover.png", dpi=110)


if __name__ == "__main__":
    main()
