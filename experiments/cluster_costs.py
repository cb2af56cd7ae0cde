"""Cost profiles of one engine group for ``cluster_sim.py``: built in, read from JSON, or measured here.

A profile (``Costs``) holds what the simulated group pays: a decode step ``step_s + (b - 1) * step_per_seq_s``
for ``b`` running sequences, plus ``prefill_per_token_s`` per prompt token admitted in that step; a load from
host memory (``load_host_s``) or from disk (``load_disk_s``); device slots (``max_loaded``) and host room
(``host_models``) in models; the TTFT objective; and ``mux_load_s``, what a Ray Serve multiplexing replica
pays on a miss (its own loader). ``source`` says, per figure, where it came from.

Built-in profiles (``PROFILES``):

- ``h200-opt-6.7b`` / ``h200-opt-1.3b``: the README's H200 figures where there are any: opt-6.7b fp16
  (13.3 GB) loads from host in 0.246 s (measured, 54.1 GB/s); opt-1.3b's load is its bytes over that same
  measured rate (derived). Ray mux's miss: the README's paper-mode load of opt-6.7b on that H200, 1.92 s
  (pageable ``.to()`` copies, which is what a ``load_state_dict`` loader does) plus the disk read, and the
  same scaled by bytes for 1.3b. **Not measured on a GPU** (no figure in the README; assumptions, labelled
  so in ``source``): decode step times (a transformers eager forward at batch 1: 22 ms for 6.7b, 12 ms for
  1.3b, +0.4 / +0.2 ms per extra sequence, prefill at 0.03 / 0.01 ms per token) and disk reads at 2 GB/s.
- ``cpu-opt-125m``: one ``cluster_sim.py --measure`` run on this 2-core CPU (2026-12-01, opt-125m fp32, TP=1),
  taken while other jobs loaded the machine (load average ~13), so its times are inflated; re-measure on a
  quiet machine for figures to trust (``--measure OUT.json``, then ``--costs OUT.json``).

``measure(model, ...)`` runs one engine group on this CPU (``LaunchEngine``, zoo models with random weights)
and fits the profile from its own step and swap records; ``cluster_sim.py --measure OUT.json`` saves it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List

import numpy as np


@dataclass(frozen=True)
class Costs:
    name: str
    step_s: float
    """Seconds of a decode step of one running sequence."""
    step_per_seq_s: float
    """Seconds each further sequence in the step adds."""
    prefill_per_token_s: float
    """Seconds per prompt token admitted in a step (its prefill runs in that step's forward)."""
    load_host_s: float
    """Seconds to load a model from host memory onto the group's devices."""
    load_disk_s: float
    """Seconds to load a model that is not in host memory (disk read, then the copy)."""
    model_bytes: int
    max_loaded: int = 4
    """Models resident on a group's devices at once."""
    host_models: int = 16
    """Models a group's host memory holds (its host budget over ``model_bytes``)."""
    max_batch: int = 8
    ttft_slo_s: float = 1.0
    mux_load_s: float = 0.0
    """A Ray Serve multiplexing replica's load on a miss (0: ``load_disk_s``)."""
    offload_s: float = 0.0
    source: Dict[str, str] = field(default_factory=dict, compare=False)

    def step(self, running: int, prefill_tokens: int = 0) -> float:
        """Seconds of one step of ``running`` sequences that admits ``prefill_tokens`` prompt tokens."""
        return self.step_s + max(0, running - 1) * self.step_per_seq_s + prefill_tokens * self.prefill_per_token_s

    @property
    def mux_load(self) -> float:
        return self.mux_load_s or self.load_disk_s

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> "Costs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(doc) - names)
        if unknown:
            raise ValueError(f"costs: unknown fields {unknown} (known: {sorted(names)})")
        return cls(**doc)

    def with_(self, **kw) -> "Costs":
        return dataclasses.replace(self, **{k: v for k, v in kw.items() if v is not None})


GB = 1e9
H200_LINK = 54.1e9  # README: opt-6.7b fp16 loaded at 54.1 GB/s on one H200 (PCIe 5, pinned), measured
DISK = 2e9  # assumed NVMe read rate on a GPU host (no figure in the README)
_ASSUMED = "assumption (no GPU figure in the README)"


def _h200(name: str, nbytes: float, step: float, per_seq: float, prefill: float, load: float,
          how: str) -> Costs:
    pageable = 1.92 * nbytes / 13.3e9  # README: paper-mode (pageable .to()) load of opt-6.7b on that H200
    return Costs(name, step, per_seq, prefill, load, nbytes / DISK + load, int(nbytes), max_loaded=8,
                 host_models=32, ttft_slo_s=1.0, mux_load_s=nbytes / DISK + pageable, offload_s=0.0006,
                 source={"load_host_s": how, "offload_s": "README, measured (opt-6.7b, 0.6 ms)",
                         "load_disk_s": "bytes at 2 GB/s (assumed) + load_host_s",
                         "mux_load_s": "bytes at 2 GB/s (assumed) + README paper-mode load (pageable), by bytes",
                         "step_s": _ASSUMED, "step_per_seq_s": _ASSUMED, "prefill_per_token_s": _ASSUMED,
                         "max_loaded": "8 models of 13.3 GB + KV in 141 GB (assumed)" if "6.7" in name else
                         "8 (assumed, as for 6.7b)", "host_models": "32 per group (assumed)"})


PROFILES: Dict[str, Costs] = {
    "h200-opt-6.7b": _h200("h200-opt-6.7b", 13.3e9, 0.022, 0.0004, 0.00003, 0.246, "README, measured"),
    "h200-opt-1.3b": _h200("h200-opt-1.3b", 2.63e9, 0.012, 0.0002, 0.00001, 2.63e9 / H200_LINK,
                           "bytes over the README's measured 54.1 GB/s (derived)"),
    "cpu-opt-125m": Costs("cpu-opt-125m", step_s=0.1277, step_per_seq_s=0.0557, prefill_per_token_s=0.0194,
                          load_host_s=0.274, load_disk_s=0.759, model_bytes=500_957_184, max_loaded=2,
                          host_models=8, ttft_slo_s=2.0, offload_s=0.0,
                          source={"*": "cluster_sim.py --measure on this 2-core CPU, 2026-12-01, opt-125m fp32, TP=1, "
                                       "while other jobs ran (load average ~13): every time is inflated by that",
                                  "load_disk_s": "load_host_s + bytes at 1.034 GB/s (the disk rate of "
                                                 "benchmarks/data/tiers_cpu_opt-125m_2026-11-30.json)",
                                  "offload_s": "0: an offload copies nothing back (off the critical path)"}),
}


def load_costs(spec: str) -> Costs:
    """A built-in profile's name, or a JSON file (``Costs`` fields, or a document with a ``costs`` key)."""
    if spec in PROFILES:
        return PROFILES[spec]
    try:
        with open(spec) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"--costs {spec!r}: neither a built-in profile ({', '.join(PROFILES)}) nor a file") from None
    return Costs.from_json(doc.get("costs", doc))


# ---- measuring one group on this CPU ---------------------------------------------------------

def _fit_steps(steps) -> Dict[str, float]:
    """Least squares of decode-only steps (nothing admitted): duration = a + b * (running - 1)."""
    dec = [(s.running, s.end - s.start) for s in steps if s.admitted == 0 and s.running > 0 and not s.error]
    if len(dec) < 4:
        raise RuntimeError(f"only {len(dec)} decode-only steps recorded: too few to fit")
    x = np.array([r - 1 for r, _ in dec], float)
    y = np.array([d for _, d in dec], float)
    if len(set(x)) > 1:
        b, a = np.polyfit(x, y, 1)
    else:
        a, b = float(np.median(y)), 0.0
    return {"step_s": max(1e-5, float(a)), "step_per_seq_s": max(0.0, float(b)), "decode_steps": len(dec)}


def measure(model: str = "opt-125m", *, batches=(1, 2, 4, 8), new_tokens: int = 12, prompt: int = 48,
            swaps: int = 4, threads: int = 1, tp: int = 1, pp: int = 1) -> Costs:
    """Run one group (2 models of zoo shape ``model``, one resident) and fit a profile from its records:
    for each batch size, that many concurrent requests of ``new_tokens`` on one model (decode steps, and
    the steps that admitted them: prefill); then ``swaps`` requests alternating between the two models
    (loads from host). Disk loads are not measured here (``load_disk_s`` = host load + bytes at the disk
    rate recorded by ``benchmarks/tiers.py`` on this machine, 1.03 GB/s)."""
    from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
    configs = [ModelConfig(f"m{i}", zoo.random_causal_lm, {"name": model, "seed": i, "fast_init": True})
               for i in range(2)]
    cfg = EngineConfig(max_loaded=1, max_batch_size=max(batches), worker_threads=threads)
    print(f"[measure] launching 2 x {model}, TP={tp} PP={pp}", file=sys.stderr, flush=True)
    engine = LaunchEngine(cfg, configs, tp, pp)
    rng = np.random.default_rng(0)
    vocab = zoo.hf_config(model).vocab_size

    def req(n_new: int) -> dict:
        return {"input_ids": [2] + [int(t) for t in rng.integers(4, vocab, size=prompt - 1)], "max_tokens": n_new}

    async def go() -> List:
        async with engine:
            await engine.submit("m0", req(1))  # warm-up
            start = len(engine.metrics())
            for b in batches:
                await asyncio.gather(*[engine.submit("m0", req(new_tokens)) for _ in range(b)])
                print(f"[measure] batch {b} done", file=sys.stderr, flush=True)
            for i in range(swaps):
                await engine.submit(f"m{(i + 1) % 2}", req(1))
            return engine.metrics()[start:]

    records = asyncio.run(go())
    steps = [r for r in records if r.kind == "step"]
    fit = _fit_steps(steps)
    first = [s for s in steps if s.admitted > 0 and not s.error]
    extra = [(s.end - s.start) - (fit["step_s"] + (s.running - 1) * fit["step_per_seq_s"]) for s in first]
    toks = [s.admitted * prompt for s in first]
    prefill = max(0.0, float(np.sum(extra) / np.sum(toks))) if first else 0.0
    loads = [r for r in records if r.kind == "load" and not r.error]
    load_s = float(np.median([r.end - r.start for r in loads])) if loads else 0.0
    nbytes = int(np.median([r.nbytes for r in loads])) if loads else 0
    disk = load_s + nbytes / 1.034e9
    src = (f"cluster_sim.py --measure: {model}, TP={tp} PP={pp}, {len(steps)} steps, {len(loads)} loads, load "
           f"average {os.getloadavg()[0]:.1f} at the end")
    return Costs(f"cpu-{model}-measured", fit["step_s"], fit["step_per_seq_s"], prefill, load_s, disk, nbytes,
                 max_loaded=2, host_models=8, ttft_slo_s=2.0, offload_s=0.0,
                 source={"step_s": f"{src} (fit over {fit['decode_steps']} decode-only steps)",
                         "prefill_per_token_s": src, "load_host_s": src,
                         "load_disk_s": "load_host_s + bytes at 1.034 GB/s (benchmarks/data/tiers_cpu_opt-125m)"})
