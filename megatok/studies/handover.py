"""The prose hand-over with its placebo arms, and the cpu-small comparison from scratch, answered from the
studies' results: one row per (arm, source, seed) with its held-out bits per byte, and paired comparisons
with Holm's correction and the smallest difference each could have detected.

    python -m megatok.studies.handover docs/replication/prose-handover/from-whitespace \\
        docs/replication/prose-handover/from-uniform docs/replication/prose-handover/scratch \\
        --out docs/replication/prose-handover
    python -m megatok.studies.handover docs/replication/cpu-small --family scratch --out docs/replication/cpu-small/paired

Each argument is a ``megatok-replicate --out`` directory: a ``--handover SOURCE:STEPS`` study (its arms'
source is SOURCE) or one without (source ``none``: the arms trained from scratch). Written: results.json
(``rows``: arm, source, seed, heldout_bpb, ...; ``comparisons``), results.md and handover_pairs.png.

A comparison pairs two arms by seed (the same seed: the same source run's weights, data order and boundary
draws for every arm of a study) and tests the mean of (bpb of B) - (bpb of A) against 0 with a two-sided
paired t-test; the family's p-values are corrected with Holm's step-down method. The detectable difference is
the smallest true mean difference that test finds with probability ``--power`` at Holm's strictest level
(alpha / the number of comparisons), given the differences' measured spread: a comparison whose difference
is below it says "no difference found", not "no difference".
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from megatok.cli import command_parser
from megatok.config import ConfigError

#: (arm A, arm B, what the comparison asks), each arm as (method, source); B - A > 0 means A is better.
#: The hand-over's family (its studies: from a whitespace run, from a uniform run, uniform from scratch):
COMPARISONS = [
    (("policy", "whitespace"), ("uniform", "whitespace"), "the policy against uniform chunks, same handed-over model"),
    (("policy", "whitespace"), ("fixed", "whitespace"), "the policy against fixed chunks, same handed-over model"),
    (("policy", "whitespace"), ("whitespace", "whitespace"), "the policy against whitespace chunks continued"),
    (("policy", "whitespace"), ("policy", "uniform"), "the policy handed a whitespace-trained model or a uniform-trained one"),
    (("uniform", "whitespace"), ("uniform", "none"), "placebo: uniform chunks after the whitespace run, or from scratch"),
    (("policy", "uniform"), ("uniform", "none"), "the policy after a uniform run, or uniform from scratch (the "
     "policy and the hand-over together)"),
]
#: The family of a study from scratch (the cpu-small comparison: every arm trained from its first step)
SCRATCH = [(("policy", "none"), (other, "none"), f"the policy against {what}, from scratch")
           for other, what in (("uniform", "uniform chunks"), ("fixed", "fixed chunks"),
                                ("whitespace", "whitespace chunks"), ("policy-published", "the published estimator"))]
FAMILIES = {"handover": COMPARISONS, "scratch": SCRATCH}


def rows_of(study: Path) -> list[dict]:
    """The finished runs of one replicate study as rows (arm, source, seed, heldout_bpb, ...)."""
    path = study / "results.json"
    if not path.is_file():
        raise ConfigError(f"{study}: no results.json (a megatok-replicate --out directory is expected)")
    data = json.loads(path.read_text())
    handover = data.get("handover") or {}
    source, before = handover.get("source", "none"), int(handover.get("steps", 0))
    rows = []
    for r in data.get("runs", []):
        prose = r.get("prose-sample") or {}
        if prose.get("bpb") is None:
            continue
        rows.append({"arm": r["method"], "source": source, "seed": int(r["seed"]), "heldout_bpb": prose["bpb"],
                     "steps": before + int(r["steps"]), "steps_after_source": int(r["steps"]) if before else None,
                     "wfb_boundary_fraction": prose.get("wfb_boundary_fraction"),
                     "bytes_per_chunk": prose.get("bytes_per_chunk"), "study": study.name})
    return rows


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order (NaN stays NaN and is not counted)."""
    order = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    adjusted, running = [math.nan] * len(pvalues), 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * p))
        adjusted[i] = running
    return adjusted


def detectable(sd: float, n: int, alpha: float, power: float) -> float | None:
    """The smallest true mean difference a two-sided paired t-test on n pairs with spread ``sd`` detects with
    probability ``power`` at level ``alpha`` (noncentral t)."""
    if n < 2 or not sd > 0:
        return None
    from scipy import optimize, stats

    df, crit = n - 1, stats.t.ppf(1 - alpha / 2, n - 1)

    def short(delta: float) -> float:
        nc = delta * math.sqrt(n) / sd
        lower = stats.nct.cdf(-crit, df, nc)  # the wrong-sign tail: negligible, NaN far out in scipy
        return stats.nct.sf(crit, df, nc) + (0.0 if math.isnan(lower) else lower) - power

    return float(optimize.brentq(short, 0.0, (crit + 40) * sd / math.sqrt(n)))


def compare(rows: list[dict], alpha: float = 0.05, power: float = 0.8, family: str = "handover") -> list[dict]:
    """Every comparison of ``family`` both of whose arms have rows, paired by seed, Holm-corrected over those
    tested."""
    from scipy import stats

    bpb = {(r["arm"], r["source"], r["seed"]): r["heldout_bpb"] for r in rows}
    found = []
    for a, b, question in FAMILIES[family]:
        seeds = sorted(s for (m, src, s) in bpb if (m, src) == a and (*b, s) in bpb)
        if not seeds:
            continue
        diffs = [bpb[(*b, s)] - bpb[(*a, s)] for s in seeds]
        sd = statistics.stdev(diffs) if len(diffs) > 1 else math.nan
        p = float(stats.ttest_rel([bpb[(*b, s)] for s in seeds], [bpb[(*a, s)] for s in seeds]).pvalue) \
            if len(diffs) > 1 and sd > 0 else math.nan
        found.append({"a": {"arm": a[0], "source": a[1]}, "b": {"arm": b[0], "source": b[1]}, "question": question,
                      "seeds": seeds, "diffs": diffs, "mean_diff": statistics.mean(diffs), "sd_diff": sd,
                      "a_lower": sum(d > 0 for d in diffs), "p": p})
    m = sum(not math.isnan(c["p"]) for c in found)  # the family Holm corrects over: the comparisons tested
    for c, adjusted in zip(found, holm([c["p"] for c in found])):
        c["p_holm"] = adjusted
        c["detectable"] = detectable(c["sd_diff"], len(c["seeds"]), alpha / m, power) if m else None
        c["verdict"] = verdict(c, alpha)
    return found


def verdict(c: dict, alpha: float) -> str:
    a, b = f"{c['a']['arm']} (from {c['a']['source']})", f"{c['b']['arm']} (from {c['b']['source']})"
    if math.isnan(c["p_holm"]):
        if len(c["seeds"]) < 2:
            return f"{len(c['seeds'])} paired seed: too few to test"
        if math.isnan(c["mean_diff"]):
            return "a score is not a number: not tested"
        return f"the same difference on every seed ({c['mean_diff']:+.4f}): no spread to test it against"
    if c["p_holm"] < alpha:
        better, worse = (a, b) if c["mean_diff"] > 0 else (b, a)
        return f"{better} lower than {worse} by {abs(c['mean_diff']):.4f} bits per byte"
    floor = c["detectable"]
    return (f"no difference found (mean {c['mean_diff']:+.4f}); a true difference of "
            f"{floor:.4f} would have been found with the stated power" if floor is not None else "no difference found")


def markdown(rows: list[dict], comparisons: list[dict], alpha: float, power: float) -> str:
    arms = sorted({(r["arm"], r["source"]) for r in rows}, key=lambda k: (k[1] != "whitespace", k[1], k[0]))
    seeds = sorted({r["seed"] for r in rows})
    bpb = {(r["arm"], r["source"], r["seed"]): r["heldout_bpb"] for r in rows}
    lines = ["# Paired comparisons on held-out prose", "",
             "Held-out bits per byte (sampled boundaries) by arm, its source and seed; "
             "`python -m megatok.studies.handover` writes this file from the studies' results.json.", "",
             f"| arm | source | {' | '.join(f'seed {s}' for s in seeds)} | mean |",
             f"|---|---|{'---|' * len(seeds)}---|"]
    for arm, src in arms:
        vals = [bpb.get((arm, src, s)) for s in seeds]
        got = [v for v in vals if v is not None]
        lines.append(f"| {arm} | {src} | {' | '.join('-' if v is None else f'{v:.4f}' for v in vals)} | "
                     f"{statistics.mean(got):.4f} |")
    if not comparisons:
        return "\n".join(lines + ["", "No comparison has rows for both of its arms yet."]) + "\n"
    m = sum(not math.isnan(c["p"]) for c in comparisons)
    lines += ["", f"Paired by seed, B - A (positive: A lower); two-sided paired t-test, Holm-corrected over the "
              f"{m} comparisons tested; detectable: the smallest true difference found with probability "
              f"{power:g} at level {alpha:g}/{m}.", "",
              "| A | B | seeds | mean B - A | sd | A lower | p | p (Holm) | detectable | verdict |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        fmt = lambda x, d=4: "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{d}f}"  # noqa: E731
        lines.append(f"| {c['a']['arm']} from {c['a']['source']} | {c['b']['arm']} from {c['b']['source']} | "
                     f"{len(c['seeds'])} | {c['mean_diff']:+.4f} | {fmt(c['sd_diff'])} | {c['a_lower']}/{len(c['seeds'])} | "
                     f"{fmt(c['p'], 3)} | {fmt(c['p_holm'], 3)} | {fmt(c['detectable'])} | {c['verdict']} |")
    return "\n".join(lines) + "\n"


def plot(comparisons: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.55 * max(1, len(comparisons))))
    for y, c in enumerate(comparisons):
        ax.scatter(c["diffs"], [y] * len(c["diffs"]), color="C0", alpha=0.7, zorder=3)
        ax.plot([c["mean_diff"]], [y], marker="|", color="k", markersize=16, zorder=4)
        if c["detectable"]:
            ax.plot([-c["detectable"], c["detectable"]], [y, y], color="C7", lw=6, alpha=0.3, solid_capstyle="butt")
    ax.axvline(0, color="gray", lw=0.8)
    ax.set_yticks(range(len(comparisons)),
                  [f"{c['b']['arm']}/{c['b']['source']} - {c['a']['arm']}/{c['a']['source']}" for c in comparisons])
    ax.set_xlabel("held-out bits per byte, B - A by seed (dots), mean (bar); grey: below the detectable difference")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _finite(x):
    """``x`` with every NaN as None (JSON has no NaN)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


def main(argv: list[str] | None = None) -> int:
    parser = command_parser(prog="python -m megatok.studies.handover", description=__doc__.split("\n\n")[0])
    parser.add_argument("studies", nargs="+", type=Path, help="megatok-replicate --out directories")
    parser.add_argument("--out", type=Path, required=True, help="directory for results.json, results.md, the plot")
    parser.add_argument("--alpha", type=float, default=0.05, help="the family's level")
    parser.add_argument("--power", type=float, default=0.8, help="for the detectable difference")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="handover",
                        help="the comparisons: the hand-over's placebo-armed ones, or the policy against the "
                             "others in a study from scratch (megatok-replicate --preset cpu-small)")
    args = parser.parse_args(argv)
    if not 0 < args.alpha < args.power < 1:
        parser.error(f"--alpha and --power: 0 < alpha < power < 1, not {args.alpha:g} and {args.power:g}")
    try:
        rows = [r for s in args.studies for r in rows_of(s)]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seen = set()
    for r in rows:
        key = (r["arm"], r["source"], r["seed"])
        if key in seen:
            print(f"error: {r['study']}: arm {key[0]} from {key[1]}, seed {key[2]} is in two studies", file=sys.stderr)
            return 2
        seen.add(key)
    rows.sort(key=lambda r: (r["source"], r["arm"], r["seed"]))
    comparisons = compare(rows, args.alpha, args.power, args.family)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(_finite(
        {"studies": [str(s) for s in args.studies], "family": args.family, "alpha": args.alpha, "power": args.power,
         "rows": rows, "comparisons": comparisons}), indent=1, allow_nan=False) + "\n")
    (args.out / "results.md").write_text(markdown(rows, comparisons, args.alpha, args.power))
    if comparisons:
        plot(comparisons, args.out / "handover_pairs.png")
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
