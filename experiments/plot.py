"""Figures from the JSON files of ``sim.py``, ``round_robin.py`` and ``llm_sim.py`` (matplotlib, Agg backend).

- ``sim_cdf.png``: latency CDFs, one panel per rate tuple (and model / TP / PP /
  max_loaded, when files differ in those), one colour per CV, solid = ours,
  dashed = paper mode.
- ``rr_breakdown.png``: the round-robin breakdown, one panel per configuration
  (model, TP, PP, blocking): mean offload, load, model, engine overhead and
  response time per mode, warm-up requests left out (as in the JSON summary).
- ``llm_sim_ttft_cdf.png`` and ``llm_sim_p99_vs_rate.png`` (``plot_llm``, called by ``llm_sim.py``): TTFT
  CDFs per configuration and p99 TTFT against the rate scale, one line per mode.

Usage: ``python experiments/plot.py --sim a.json b.json --rr c.json`` (figures in ``results/figures``;
``--out-dir experiments/figures --publish`` refreshes the tracked ones, as ``run_cpu.sh --publish`` does)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload  # noqa: E402

STYLE = {"ours": "-", "paper": "--"}
CV_COLORS = {0.25: "tab:blue", 1.0: "tab:orange", 4.0: "tab:green"}  # 1 == 1.0 as dict keys
RR_FIELDS = ("offload", "load", "model", "overhead", "response")
MODE_COLORS = {"ours": "tab:blue", "paper": "tab:red"}


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _num(x):
    return int(x) if float(x).is_integer() else round(x, 3)


def _plain(v, _pos=None) -> str:
    return f"{v:g}"


def _plain_minor(v, _pos=None) -> str:
    """Label the 2x, 3x and 5x minor ticks of a log axis in plain numbers, leave the rest blank."""
    if v <= 0:
        return ""
    mant = v / 10 ** np.floor(np.log10(v))
    return f"{v:g}" if int(round(mant)) in (2, 3, 5) else ""


def _grid(n: int, panel_width: float, sharey: bool = False):
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    return plt.subplots(rows, cols, figsize=(panel_width * cols, 4.2 * rows), squeeze=False, sharey=sharey)


def _save(fig, axes, n_used: int, title: str, out_dir: str, name: str) -> str:
    for ax in list(axes.flat)[n_used:]:
        ax.axis("off")
    fig.suptitle(title, fontsize=12)
    return _save_plain(fig, out_dir, name)


def plot_sim(docs: Sequence[dict], out_dir: str) -> str:
    panels: Dict[tuple, List[dict]] = {}
    for d in docs:
        c = d["config"]
        key = (tuple(_num(r) for r in c["rates"]), c["model"], c["tp_world_size"], c["pp_world_size"],
               c["max_loaded"])
        panels.setdefault(key, []).append(d)
    keys = sorted(panels, key=lambda k: (len(k[0]), k[0], k[1:]))
    n = len(keys)
    fig, axes = _grid(n, panel_width=5)
    for ax, key in zip(axes.flat, keys):
        rates, model, tp, pp, ml = key
        for d in sorted(panels[key], key=lambda d: d["config"]["cv"]):
            cv = d["config"]["cv"]
            for mode, recs in d["records"].items():
                lat = np.sort([r["latency"] for r in recs if r["ok"]])
                if not len(lat):
                    continue
                y = np.arange(1, len(lat) + 1) / len(recs)  # unanswered requests keep the curve below 1
                ax.step(lat, y, where="post", linestyle=STYLE.get(mode, ":"), color=CV_COLORS.get(cv, None),
                        label=f"CV {_num(cv)} {mode}")
        ax.set_xscale("log")
        # plain numbers: matplotlib's default minor labels (3x10^-1, 4x10^-1) collide on a narrow log range
        ax.xaxis.set_major_formatter(FuncFormatter(_plain))
        ax.xaxis.set_minor_formatter(FuncFormatter(_plain_minor))
        ax.tick_params(axis="x", which="minor", labelsize=9)
        ax.tick_params(axis="both", which="major", labelsize=10)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("latency (s)", fontsize=10)
        ax.set_ylabel("fraction of requests", fontsize=10)
        ax.set_title(f"rates={rates}\n{model} TP={tp} PP={pp} max_loaded={ml}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, axes, n, "latency CDF: solid = ours, dashed = paper mode", out_dir, "sim_cdf.png")


def plot_rr(docs: Sequence[dict], out_dir: str) -> str:
    n = len(docs)
    fig, axes = _grid(n, panel_width=6, sharey=True)  # one y scale: the panels compare configurations
    for ax, d in zip(axes.flat, docs):
        c, summ = d["config"], d["summary"]
        modes = [m for m in ("ours", "paper") if m in summ]
        x = np.arange(len(RR_FIELDS))
        w = 0.8 / max(1, len(modes))
        for j, mode in enumerate(modes):
            vals = [(summ[mode][f] or 0.0) * 1000 for f in RR_FIELDS]
            bars = ax.bar(x + (j - (len(modes) - 1) / 2) * w, vals, w, label=mode, color=MODE_COLORS.get(mode))
            for b, v in zip(bars, vals):
                ax.annotate(f"{v:.1f}" if v < 100 else f"{v:.0f}", (b.get_x() + b.get_width() / 2, v),
                            ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, ["offload", "load", "model", "engine\noverhead", "response"], fontsize=10)
        ax.tick_params(axis="y", labelsize=10, labelleft=True)
        ax.set_ylabel("mean ms per request", fontsize=10)
        warm = summ[modes[0]]["warmup_dropped"] if modes else 0
        ml = f" max_loaded={c['max_loaded']}" if "max_loaded" in c else ""
        ax.set_title(f"{c['model_name']} x{c['num_models']} TP={c['tp_world_size']} PP={c['pp_world_size']}{ml} "
                     f"{'blocking' if c['blocking'] else 'all at once'}\nmax_tokens={c['max_tokens']}, "
                     f"first {warm} requests dropped", fontsize=10)
        ax.legend(fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, axes, n, "round robin: where a request's time goes (mean per request)", out_dir,
                 "rr_breakdown.png")


def plot_llm_cdf(doc: dict, out_dir: str) -> Optional[str]:
    """TTFT CDFs of ``llm_sim.py``'s runs, a panel per (configuration, max_loaded), a line per mode."""
    keys = sorted({(r["config"], r["max_loaded"]) for r in doc["runs"]})
    if not keys:
        return None
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), sharey=True, squeeze=False)
    for ax, (c, ml) in zip(axes[0], keys):
        for r in doc["runs"]:
            if (r["config"], r["max_loaded"]) == (c, ml) and r["ttfts"]:
                xs = r["ttfts"]
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["mode"])
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"config {c} {doc['labels'][str(c)]}\nmax_loaded={ml}", fontsize=9)
        ax.set_xlabel("TTFT (s)")
        ax.axvline(doc["ttft_slo_s"], color="grey", lw=0.8, ls=":")
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][-1].legend(fontsize=8)
    return _save_plain(fig, out_dir, "llm_sim_ttft_cdf.png")


def plot_llm_rates(doc: dict, out_dir: str) -> Optional[str]:
    """p99 TTFT of ``llm_sim.py``'s bisection probes against the rate scale, a line per mode."""
    if not doc.get("bisect"):
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for mode, b in doc["bisect"]["modes"].items():
        pts = sorted((p["scale"], p["ttft_p99"]) for p in b["probes"] if p["ttft_p99"] is not None)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    ax.axhline(doc["ttft_slo_s"], color="grey", lw=0.8, ls=":")
    ax.set_yscale("log")
    ax.set_xlabel(f"rate scale (config {doc['bisect']['config']})")
    ax.set_ylabel("p99 TTFT (s)")
    ax.legend(fontsize=8)
    return _save_plain(fig, out_dir, "llm_sim_p99_vs_rate.png")


def _save_plain(fig, out_dir: str, name: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_llm(doc: dict, out_dir: str) -> List[str]:
    """The figures of one ``llm_sim.py`` document (those it has data for)."""
    return [p for p in (plot_llm_cdf(doc, out_dir), plot_llm_rates(doc, out_dir)) if p]


def main(argv=None) -> List[str]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sim", nargs="*", default=[], help="JSON files written by sim.py --out")
    ap.add_argument("--rr", nargs="*", default=[], help="JSON files written by round_robin.py --out")
    ap.add_argument("--out-dir", default=workload.results_path("figures"),
                    help="where the PNGs go (default: results/figures; experiments/figures needs --publish)")
    workload.add_publish_arg(ap)
    args = ap.parse_args(argv)
    if not args.sim and not args.rr:
        ap.error("give --sim and/or --rr JSON files")
    workload.check_outputs(ap, args.publish, args.out_dir)
    os.makedirs(args.out_dir, exist_ok=True)
    written = []
    if args.sim:
        written.append(plot_sim([_load(p) for p in args.sim], args.out_dir))
    if args.rr:
        written.append(plot_rr([_load(p) for p in args.rr], args.out_dir))
    for p in written:
        print(f"wrote {p}", file=sys.stderr)
    return written


if __name__ == "__main__":
    main()
