"""The learnability map (``megatok-replicate --preset control``): which estimators learn to start chunks where
a start pays, and how much a start must be worth before they do.

Each run trains on the positive control (megatok/data/control.py) at one ``level``; a run *aligns* when at
least ALIGNED of the spaces before words start a chunk on held-out text (sampled boundaries, seed 0): its
``aligned_fraction``. Its ``steps_to_align`` is the first logged training step where ALIGNED of them did.
Per level, ``megatok-boundary-value`` on the level's uniform run measures what a start at each class of
positions is worth (nats of discounted loss saved) and the noise of the estimator's return: their ratio is
the x axis the map is read against ("aligns reliably once a start is worth X of the return's noise").
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

#: The control's levels by default (megatok-replicate --level).
LEVELS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: A run aligns when this fraction of the spaces before words start a chunk.
ALIGNED = 0.9
#: A method aligns reliably at a level when this share of its seeds do (4 of 5).
RELIABLE = 0.8


#: A run that has not aligned is still climbing at its end when its fraction rose by this much over its last
#: CLIMB_STEPS steps (the map's runs must be long enough that none is).
CLIMB, CLIMB_STEPS = 0.1, 100


def run_figures(summary: dict, key: str = "sbw_boundary_fraction") -> dict:
    """``aligned_fraction`` (held-out, sampled), ``steps_to_align`` (training rows), the run's last step and
    whether it is ``climbing`` at its end (not aligned, and its training fraction rose by CLIMB or more over
    the last CLIMB_STEPS steps). ``key``: the figure that says which share of the paying positions start a
    chunk (the harder control's: space_boundary_fraction)."""
    held = summary.get("prose-sample", {}).get(key)
    curve = [{**r, "sbw_boundary_fraction": r.get(key)} for r in summary.get("curve", []) if r.get(key) is not None]
    step = next((r["step"] for r in curve if r["sbw_boundary_fraction"] >= ALIGNED), None)
    last = curve[-1]["step"] if curve else None
    climbing = False
    if curve and (held is None or held < ALIGNED):
        earlier = [r for r in curve if r["step"] <= last - CLIMB_STEPS]
        climbing = bool(earlier) and curve[-1]["sbw_boundary_fraction"] - earlier[-1]["sbw_boundary_fraction"] >= CLIMB
    return {"aligned_fraction": held, "steps_to_align": step, "last_step": last, "climbing": climbing}


def fit_alignment(points: list[tuple[float, bool]], floor: float) -> dict | None:
    """P(align | r) = floor + (1 - floor) sigmoid(s (r - r50)) over runs (r: the value-to-noise ratio of the
    run's level, aligned or not; ``floor``: the share aligned at level 0, where nothing pays), on a grid: r50
    uniform over [0, 2 max r], the slope s log-uniform over [0.1, 1000]. Returns the posterior mode of r50 and
    s, and for r50 and r90 (the ratio where P is 0.9) the median and the 95% central interval of the
    posterior (None where it lies beyond the largest ratio tested: the map cannot place it). A map whose
    aligned and unaligned runs are separated by r leaves r50 anywhere in the gap, and its interval says so.
    None with fewer than two distinct ratios, or a floor of 1 (every seed aligned where nothing pays: P does
    not depend on the ratio, as for the control's oracle)."""
    import numpy as np
    from scipy.special import expit, logsumexp

    if len({r for r, _ in points}) < 2 or floor >= 1:
        return None
    r = np.array([x for x, _ in points], dtype=float)
    y = np.array([float(v) for _, v in points])
    top = 2 * r.max()
    r50 = np.linspace(0, top, 801)[:, None, None]
    slope = np.geomspace(0.1, 1000, 241)[None, :, None]
    p = np.clip(floor + (1 - floor) * expit(slope * (r[None, None, :] - r50)), 1e-12, 1 - 1e-12)
    logpost = (y * np.log(p) + (1 - y) * np.log(1 - p)).sum(-1)
    w = np.exp(logpost - logsumexp(logpost))
    mode = np.unravel_index(np.argmax(logpost), logpost.shape)
    q = (0.9 - floor) / (1 - floor)
    r90 = r50 + (np.log(q / (1 - q)) / slope if 0 < q < 1 else np.inf)
    result = {"r50_mode": float(r50[mode[0], 0, 0]), "slope_mode": float(slope[0, mode[1], 0]), "floor": floor,
              "n": len(points)}
    for name, grid in (("r50", np.broadcast_to(r50[..., 0], w.shape)), ("r90", r90[..., 0])):
        order = np.argsort(grid, axis=None)
        values, cum = grid.flat[order], np.cumsum(w.flat[order])
        lo, med, hi = (values[min(np.searchsorted(cum, c), len(values) - 1)] for c in (0.025, 0.5, 0.975))
        result[name] = None if med > r.max() else float(med)  # beyond the ratios tested: the map cannot say
        result[f"{name}_ci"] = [float(lo), None if hi > r.max() else float(hi)]
    return result


def survival(runs: list[dict]) -> dict | None:
    """Kaplan-Meier estimate of the share of runs aligned by each step (``steps_to_align``; a run that never
    aligned is censored at its last step): {"steps": [...], "aligned": [...]} and the median step, None when
    no run has a last step."""
    from scipy import stats

    done = [r["steps_to_align"] for r in runs if r.get("steps_to_align") is not None]
    censored = [r["last_step"] for r in runs if r.get("steps_to_align") is None and r.get("last_step") is not None]
    if not done and not censored:
        return None
    if not done:
        return {"steps": [max(censored)], "aligned": [0.0], "median": None}
    sf = stats.ecdf(stats.CensoredData(uncensored=done, right=censored)).sf
    steps, alive = sf.quantiles.tolist(), sf.probabilities.tolist()
    median = next((s for s, p in zip(steps, alive) if p <= 0.5), None)
    return {"steps": steps, "aligned": [1 - p for p in alive], "median": median}


def read_probes(out: Path) -> dict[float, dict]:
    """{level: the boundary-value result} from OUT/boundary_value-level<L>.json."""
    probes = {}
    for f in sorted(out.glob("boundary_value-level*.json")):
        try:
            probes[float(f.stem.removeprefix("boundary_value-level"))] = json.loads(f.read_text())
        except (ValueError, OSError):
            continue
    return probes


def probe_figures(probe: dict) -> dict:
    """The value of a start at a space before a word (nats, with its standard error), the largest other
    class's, the return noise and the value-to-noise ratio."""
    classes = probe["classes"]
    sbw = classes["space_before_word"]
    others = {c: v for c, v in classes.items() if c != "space_before_word" and v["n"] > 1
              and v.get("stderr") not in (None, 0) and math.isfinite(v["value"])}
    best = max(others, key=lambda c: others[c]["value"]) if others else None
    noise = probe.get("return_std")
    return {"value": sbw["value"], "stderr": sbw["stderr"], "z": sbw["value"] / sbw["stderr"] if sbw["stderr"] else None,
            "best_other": best, "best_other_value": others[best]["value"] if best else None,
            "best_other_stderr": others[best]["stderr"] if best else None,
            "return_std": noise, "ratio": sbw["value"] / noise if noise else None,
            "chunkings": {k: v["bpb"] for k, v in probe.get("chunkings", {}).items()}}


def aggregate(summaries: list[dict], probes: dict[float, dict]) -> dict:
    """{"levels": [...], "methods": {method: {level: figures over seeds}}, "probes": {level: ...},
    "thresholds": {method: ...}, "fits": {method: map_fit}, "survival": {method: {level: survival}}}."""
    levels = sorted({s["level"] for s in summaries if s.get("level") is not None} | set(probes))
    methods: dict[str, dict] = {}
    for s in summaries:
        if s.get("level") is None:
            continue
        figures = ({k: s.get(k) for k in ("aligned_fraction", "steps_to_align", "last_step", "climbing")}
                   if "aligned_fraction" in s else run_figures(s))  # (the report's, by its preset's figure)
        fig = {**figures, "seed": s["seed"], "bpb": s.get("prose-sample", {}).get("bpb"),
               "rate": s.get("realised_rate"), "wall_s": s.get("wall_s")}
        methods.setdefault(s["method"], {}).setdefault(s["level"], []).append(fig)
    table = {}
    for m, by_level in methods.items():
        table[m] = {}
        for level, runs in sorted(by_level.items()):
            fractions = [r["aligned_fraction"] for r in runs if r["aligned_fraction"] is not None]
            steps = [r["steps_to_align"] for r in runs]
            bpbs = [r["bpb"] for r in runs if r["bpb"] is not None]
            table[m][f"{level:g}"] = {
                "seeds": [r["seed"] for r in runs], "n": len(runs),
                "aligned": sum(f >= ALIGNED for f in fractions),
                "aligned_fraction": [round(f, 4) for f in fractions],
                "steps_to_align": steps,
                "climbing": sum(bool(r["climbing"]) for r in runs),
                "median_steps": statistics.median([x for x in steps if x is not None]) if any(x is not None for x in steps)
                else None,
                "bpb": {"mean": statistics.fmean(bpbs), "min": min(bpbs), "max": max(bpbs)} if bpbs else None,
                "wall_s": statistics.fmean([r["wall_s"] for r in runs if r["wall_s"]]) if any(r["wall_s"] for r in runs)
                else None}
    probe_table = {f"{level:g}": probe_figures(p) for level, p in sorted(probes.items())}
    return {"levels": [f"{v:g}" for v in levels], "methods": table, "probes": probe_table,
            "thresholds": {m: threshold(table[m], probe_table) for m in table},
            "fits": {m: map_fit(table[m], probe_table) for m in table},
            "survival": {m: {f"{lv:g}": survival(rs) for lv, rs in sorted(by_level.items())}
                         for m, by_level in methods.items()}}


def map_fit(by_level: dict, probes: dict) -> dict | None:
    """fit_alignment over a method's runs at the levels with a probe (their value-to-noise ratio), its floor
    the share of its seeds aligned at level 0 (0 where level 0 was not run)."""
    points = []
    for lv, cell in by_level.items():
        ratio = (probes.get(lv) or {}).get("ratio")
        if ratio is not None:
            points += [(max(0.0, ratio), f >= ALIGNED) for f in cell["aligned_fraction"]]
    zero = by_level.get("0")
    floor = zero["aligned"] / zero["n"] if zero and zero["n"] else 0.0
    return fit_alignment(points, floor) if points else None


def threshold(by_level: dict, probes: dict) -> dict:
    """The lowest level from which on (every higher level tested too) at least RELIABLE of the seeds align,
    with the probe's value-to-noise ratio there; None when no level qualifies."""
    levels = sorted(by_level, key=float)
    reliable = [lv for lv in levels if by_level[lv]["n"] and by_level[lv]["aligned"] / by_level[lv]["n"] >= RELIABLE]
    lowest = None
    for lv in reversed(levels):
        if lv not in reliable:
            break
        lowest = lv
    below = [lv for lv in levels if lowest is not None and float(lv) < float(lowest)]
    return {"level": lowest, "ratio": (probes.get(lowest) or {}).get("ratio") if lowest else None,
            "highest_unreliable": below[-1] if below else None,
            "ratio_below": (probes.get(below[-1]) or {}).get("ratio") if below else None}


def _num(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def markdown(agg: dict, header: str) -> str:
    levels = agg["levels"]
    lines = [header, "",
             f"A run aligns when at least {ALIGNED:g} of the spaces before words start a chunk on held-out control "
             f"text (sampled boundaries, seed 0); steps: the first logged training step where they did.", "",
             "## The map: seeds aligned, by level", "",
             "Each cell: seeds aligned / seeds run (median steps to align; aligned fractions per seed).", "",
             "| method | " + " | ".join(f"level {lv}" for lv in levels) + " |", "|---|" + "---|" * len(levels)]
    for m, by_level in agg["methods"].items():
        cells = []
        for lv in levels:
            c = by_level.get(lv)
            cells.append("" if c is None else f"{c['aligned']}/{c['n']} ({_num(c['median_steps'], 'g')}; "
                                              f"{', '.join(f'{f:.2f}' for f in c['aligned_fraction'])})")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    if agg["probes"]:
        lines += ["", "## What a chunk start is worth, by level", "",
                  "megatok-boundary-value on the level's uniform run (first seed, held-out text, 16 added starts per "
                  "sequence and class, gamma 0.99): the discounted loss one added start saves at a space before a word "
                  "(nats, standard error, z = value / standard error), the largest other class, the standard "
                  "deviation of the estimator's return on the same batch, and their ratio.", "",
                  "| level | space before word | z | largest other class | return noise | value / noise |",
                  "|---|---|---|---|---|---|"]
        for lv, p in agg["probes"].items():
            other = "n/a" if p["best_other"] is None else (f"{p['best_other']} {p['best_other_value']:.4f} "
                                                           f"+- {p['best_other_stderr']:.4f}")
            lines.append(f"| {lv} | {p['value']:.4f} +- {p['stderr']:.4f} | {_num(p['z'], '.1f')} | {other} | "
                         f"{_num(p['return_std'], '.3f')} | {_num(p['ratio'], '.4f')} |")
    lines += ["", "## Thresholds", "",
              f"The lowest level from which every level tested has at least {RELIABLE:.0%} of a method's seeds "
              "aligned, and the value-to-noise ratio there.", ""]
    for m, t in agg["thresholds"].items():
        if t["level"] is None:
            lines.append(f"- {m}: aligns reliably at no level tested.")
        else:
            below = "" if t["highest_unreliable"] is None else (
                f" (not at level {t['highest_unreliable']}, ratio {_num(t['ratio_below'], '.4f')})")
            lines.append(f"- {m}: from level {t['level']} on, where a start at a space before a word is worth "
                         f"{_num(t['ratio'], '.4f')} of the return's noise{below}.")
    fits = {m: f for m, f in agg.get("fits", {}).items() if f}
    if fits:
        lines += ["", "## P(align) against the value-to-noise ratio", "",
                  "P = floor + (1 - floor) sigmoid(s (r - r50)) fitted to every run at a level with a probe (r: "
                  "that level's value / noise; floor: the share of seeds aligned at level 0, where nothing pays); "
                  "r50 and r90: the ratios where P is halfway from the floor to 1 and where it is 0.9, posterior "
                  "median and 95% interval on a grid (flat in r50, log-flat in s; inf / n/a: beyond the ratios tested).", "",
                  "| method | runs | floor | r50 (95% interval) | r90 (95% interval) |", "|---|---|---|---|---|"]
        for m, f in fits.items():
            def cell(k):
                lo, hi = f[f"{k}_ci"]
                return f"{_num(f[k], '.3f')} ({lo:.3f}-{'inf' if hi is None else format(hi, '.3f')})"

            lines.append(f"| {m} | {f['n']} | {f['floor']:.2f} | {cell('r50')} | {cell('r90')} |")
    surv = agg.get("survival", {})
    if surv:
        lines += ["", "## Time to align", "",
                  "Kaplan-Meier median of the first logged step at which the run's training fraction reached "
                  f"{ALIGNED:g} (runs that never did censored at their last step; n/a: fewer than half aligned), and "
                  f"the runs not aligned whose fraction still rose by {CLIMB:g} or more over their last {CLIMB_STEPS} "
                  "steps (still climbing at the end).", "",
                  "| method | " + " | ".join(f"level {lv}" for lv in levels) + " |", "|---|" + "---|" * len(levels)]
        for m, by_level in agg["methods"].items():
            cells = []
            for lv in levels:
                c, k = by_level.get(lv), (surv.get(m) or {}).get(lv)
                cells.append("" if c is None else f"{_num((k or {}).get('median'), 'g')}; climbing {c['climbing']}")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "## Held-out bits per byte", "", "Mean (min-max) over seeds.", "",
              "| method | " + " | ".join(f"level {lv}" for lv in levels) + " |", "|---|" + "---|" * len(levels)]
    for m, by_level in agg["methods"].items():
        cells = []
        for lv in levels:
            b = (by_level.get(lv) or {}).get("bpb")
            cells.append("" if b is None else f"{b['mean']:.4f} ({b['min']:.4f}-{b['max']:.4f})")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plots(summaries: list[dict], agg: dict, out: Path, key: str = "sbw_boundary_fraction") -> list[str]:
    """map.png: the share of seeds that align against the level (and against the probe's value-to-noise
    ratio, where measured), one line per method; alignment.png: every policy run's fraction of spaces
    before words that start a chunk over training, a panel per level; survival.png: the Kaplan-Meier
    share of runs aligned by each step, a panel per level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _map_png(plt, agg, out)
    written = ["map.png"]
    levels = agg["levels"]
    curves = [s for s in summaries if s.get("curve") and s.get("level") is not None and s["method"].startswith("policy")]
    if curves and levels:
        axes = _level_panels(plt, levels)
        methods = sorted({s["method"] for s in curves})
        for s in curves:
            first = s["seed"] == min(x["seed"] for x in curves if x["method"] == s["method"])
            axes[levels.index(f"{s['level']:g}")].plot(
                [r["step"] for r in s["curve"]], [r.get(key) for r in s["curve"]],
                color=f"C{methods.index(s['method']) % 10}", alpha=0.7, lw=1, label=s["method"] if first else None)
        for ax in axes:
            ax.axhline(ALIGNED, ls="--", color="gray", lw=0.8)
        axes[0].set_ylabel({"sbw_boundary_fraction": "spaces before words starting a chunk"}.get(
            key, f"{key.replace('_', ' ')}"))
        written.append(_save_panels(plt, axes, out / "alignment.png"))
    surv = agg.get("survival", {})
    if any(k for by_level in surv.values() for k in by_level.values()) and levels:
        axes = _level_panels(plt, levels)
        for i, (m, by_level) in enumerate(surv.items()):
            for lv, k in by_level.items():
                if k and lv in levels:
                    axes[levels.index(lv)].step([0, *k["steps"]], [0, *k["aligned"]], where="post",
                                                color=f"C{i % 10}", label=m)
        for ax in axes:
            ax.set_ylim(-0.05, 1.05)
        axes[0].set_ylabel(f"share of runs aligned (>= {ALIGNED:g}), Kaplan-Meier")
        written.append(_save_panels(plt, axes, out / "survival.png"))
    return written


#: The methods map.png draws bold (the estimators the map is about); the others thin.
MAP_MAIN = ("policy", "policy-published", "policy-disarm", "oracle", "uniform")


def _map_png(plt, agg: dict, out: Path) -> None:
    """map.png (see :func:`plots`): left, the share of seeds aligned by level, the main estimators bold and
    the methods screened on fewer seeds thin; right (where probes were measured), the main estimators'
    shares against the value-to-noise ratio (marker area: seeds) with their fitted P(align) curves."""
    import numpy as np
    from scipy.special import expit

    ratios = {lv: p["ratio"] for lv, p in agg["probes"].items() if p.get("ratio") is not None}
    fig, axes = plt.subplots(1, 2 if ratios else 1, figsize=(12 if ratios else 6, 4.5), squeeze=False)
    others = [m for m in agg["methods"] if m not in MAP_MAIN]
    cmap = plt.get_cmap("tab20")
    for m, by_level in agg["methods"].items():
        lvs = sorted(by_level, key=float)
        share = [by_level[lv]["aligned"] / by_level[lv]["n"] for lv in lvs]
        main = m in MAP_MAIN
        style = ({"color": f"C{MAP_MAIN.index(m)}", "lw": 2.2, "marker": "o", "zorder": 3} if main else
                 {"color": cmap((others.index(m) * 2 + 1) % 20), "lw": 0.9, "marker": ".", "alpha": 0.7, "ls": "--"})
        axes[0][0].plot([float(lv) for lv in lvs], share, label=m, **style)
        if main and ratios:
            pts = sorted((ratios[lv], s, by_level[lv]["n"]) for lv, s in zip(lvs, share) if lv in ratios)
            if pts:
                axes[0][1].scatter([p[0] for p in pts], [p[1] for p in pts], s=[12 * p[2] for p in pts],
                                   color=style["color"], alpha=0.6, label=m)
            fit = agg.get("fits", {}).get(m)
            if fit:
                r = np.linspace(min(ratios.values()), max(ratios.values()), 200)
                p = fit["floor"] + (1 - fit["floor"]) * expit(fit["slope_mode"] * (r - fit["r50_mode"]))
                axes[0][1].plot(r, p, color=style["color"], lw=1.5)
    axes[0][0].set_xlabel("control level")
    if ratios:
        axes[0][1].set_xlabel("value of a start at a space / return noise (level's probe)")
        axes[0][1].set_title("bold estimators: seeds aligned (area: seeds) and fitted P(align)", fontsize=9)
        axes[0][1].legend(fontsize=7, loc="lower right")
    for ax in axes[0]:
        ax.set_ylabel(f"share of seeds aligned (>= {ALIGNED:g})")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6.5, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "map.png", dpi=110)
    plt.close(fig)


def _level_panels(plt, levels: list[str]) -> list:
    """A row of panels sharing the y axis, one per control level, titled, over training steps."""
    _, axes = plt.subplots(1, len(levels), figsize=(3.2 * len(levels), 3.2), squeeze=False, sharey=True)
    for lv, ax in zip(levels, axes[0]):
        ax.set_title(f"level {lv}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return list(axes[0])


def _save_panels(plt, axes: list, path: Path) -> str:
    """One legend (each label once) on the last panel; write the figure to ``path``; its file name."""
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    axes[-1].legend(handles, labels, fontsize=7)
    fig = axes[0].figure
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
