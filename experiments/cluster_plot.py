"""``cluster_sim_attainment.png``: SLO attainment against the total request rate, one line per policy, a panel
per group count (``cluster_sim.py``'s ``curves``)."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(doc: dict, out_dir: str) -> str:
    curves = doc["curves"]
    fig, axes = plt.subplots(1, len(curves), figsize=(6.0 * len(curves), 4.4), squeeze=False)
    need = doc["groups_needed"]
    for ax, curve in zip(axes[0], curves):
        for pol, ys in curve["attainment"].items():
            ax.plot(curve["rates"], ys, marker="o", label=f"{pol} (needs {need.get(pol) or '>' + str(doc['g_max'])})")
        ax.axhline(doc["target"], color="grey", lw=0.8, ls=":")
        ax.axvline(doc["rate"], color="grey", lw=0.8, ls="--")
        ax.set_xlabel("total request rate (req/s)")
        ax.set_ylabel(f"fraction of TTFTs <= {doc['ttft_slo_s']:g} s")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{curve['groups']} groups", fontsize=10)
        ax.legend(fontsize=7, loc="lower left")
    fig.suptitle(f"{doc['models']} models (Zipf {doc['zipf']:g}), {doc['costs']['name']}; groups needed for "
                 f"{doc['target']:.0%} at {doc['rate']:g} req/s in the legend", fontsize=10)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "cluster_sim_attainment.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
