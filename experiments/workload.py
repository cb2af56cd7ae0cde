"""Shared helpers of the experiments: Gamma-process arrivals, the paper's workload table, CPU knobs.

Arrivals
--------
``gamma_arrivals(rate, cv, duration, rng)`` draws a Gamma renewal process, the
arrival model of AlpaServe that the paper's ``sim.py`` used: inter-arrival
times are i.i.d. Gamma with shape ``k = 1 / cv**2`` and scale
``theta = cv**2 / rate``, so their mean is ``k * theta = 1 / rate`` and their
coefficient of variation is ``1 / sqrt(k) = cv``. CV 1 is a Poisson process,
CV < 1 is more regular, CV > 1 burstier. Arrival times are the cumulative sums
of the gaps, starting from 0, kept while ``< duration``.

Configurations (``sim.py -c INDEX``)
------------------------------------
The paper's simulated workloads (its ``experiments/sim.py``): one Gamma client
per model, the rate of model ``i`` in requests/s, the same CV for all models.
``paper max_loaded`` is the residency limit the paper ran each row with; our
``sim.py`` uses ``--max-loaded`` (default 1) unless given ``--max-loaded paper``.

======  ========================  =====  ==================
index   rates (req/s per model)   CV     paper max_loaded
======  ========================  =====  ==================
0       (1, 1, 1)                 0.25   2
1       (1, 1, 1)                 1      2
2       (1, 1, 1)                 4      2
3       (10, 1, 1)                0.25   2
4       (10, 1, 1)                1      2
5       (10, 1, 1)                4      2
6       (10, 10, 1)               0.25   2
7       (10, 10, 1)               1      2
8       (10, 10, 1)               4      2
9       (1, 1, 1, 1, 1, 1)        0.25   4
10      (1, 1, 1, 1, 1, 1)        1      4
11      (1, 1, 1, 1, 1, 1)        4      4
12      (10, 10, 1, 1, 1, 1)      0.25   4
13      (10, 10, 1, 1, 1, 1)      1      4
14      (10, 10, 1, 1, 1, 1)      4      4
15      (10, 10, 10, 10, 1, 1)    0.25   4
16      (10, 10, 10, 10, 1, 1)    1      4
17      (10, 10, 10, 10, 1, 1)    4      4
18      (2, 2)                    1      1     (smoke test for CI, not in the paper)
======  ========================  =====  ==================

Worker threads on CPU
---------------------
Both scripts take ``--threads`` (default 1), passed on as
``EngineConfig.worker_threads``: on a small shared CPU machine, more OpenMP
threads than free cores made an opt-tiny forward 40-600x slower.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

@dataclass(frozen=True)
class SimConfig:
    rates: Tuple[float, ...]
    cv: float
    paper_max_loaded: int

    @property
    def n_models(self) -> int:
        return len(self.rates)

    def label(self) -> str:
        return f"rates={tuple(_num(r) for r in self.rates)} cv={_num(self.cv)}"


def _num(x: float):
    return int(x) if float(x).is_integer() else x


def _paper_configs() -> List[SimConfig]:
    out = []
    for rates, max_loaded in (((1, 1, 1), 2), ((10, 1, 1), 2), ((10, 10, 1), 2),
                              ((1, 1, 1, 1, 1, 1), 4), ((10, 10, 1, 1, 1, 1), 4), ((10, 10, 10, 10, 1, 1), 4)):
        for cv in (0.25, 1, 4):
            out.append(SimConfig(tuple(rates), cv, max_loaded))
    out.append(SimConfig((2, 2), 1, 1))  # 18: smoke configuration for CI
    return out


CONFIGS: List[SimConfig] = _paper_configs()
SMOKE_CONFIG = 18


def gamma_arrivals(rate: float, cv: float, duration: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times in ``[0, duration)`` of a Gamma renewal process with mean rate ``rate`` and CV ``cv``."""
    if rate <= 0:
        raise ValueError(f"rate={rate!r}: must be > 0")
    if cv <= 0:
        raise ValueError(f"cv={cv!r}: must be > 0")
    if duration < 0:
        raise ValueError(f"duration={duration!r}: must be >= 0")
    shape, scale = 1.0 / cv ** 2, cv ** 2 / rate
    chunk = max(16, int(rate * duration * 1.2) + 16)
    times: List[np.ndarray] = []
    t = 0.0
    while True:
        gaps = rng.gamma(shape, scale, size=chunk)
        cum = t + np.cumsum(gaps)
        keep = cum[cum < duration]
        times.append(keep)
        if len(keep) < len(cum):
            break
        t = float(cum[-1])
    return np.concatenate(times)


def make_trace(rates: Sequence[float], cv: float, duration: float, seed: int,
               model_ids: Optional[Sequence[str]] = None) -> List[Tuple[float, str]]:
    """One merged, time-sorted trace of ``(arrival_time, model_id)`` for every model's Gamma client.

    Model ``i`` draws from its own stream ``SeedSequence(seed).spawn(n)[i]``, so
    its arrivals do not depend on the other models' rates.
    """
    model_ids = list(model_ids) if model_ids is not None else [f"m{i}" for i in range(len(rates))]
    streams = np.random.SeedSequence(seed).spawn(len(rates))
    trace = []
    for mid, rate, ss in zip(model_ids, rates, streams):
        for t in gamma_arrivals(rate, cv, duration, np.random.default_rng(ss)):
            trace.append((float(t), mid))
    trace.sort()
    return trace


# ---- small statistics helpers ----------------------------------------------------

def percentile(xs: Sequence[float], q: float) -> Optional[float]:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else None


def mean(xs: Sequence[float]) -> Optional[float]:
    return float(np.mean(np.asarray(xs, dtype=float))) if len(xs) else None


def machine_info() -> dict:
    import platform
    import torch
    return {"host": platform.node(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


# ---- engines of the experiments ----------------------------------------------------

def default_dtype() -> str:
    import torch
    return "float16" if torch.cuda.is_available() else "float32"


def opt_model_configs(model_name: str, n_models: int, max_batch_size: int, dtype: str = "float32"):
    """``n_models`` OPT models ``m0..m{n-1}`` of zoo shape ``model_name`` with seeded random weights."""
    from computron import CausalLMBatchManager, ModelConfig, zoo
    hf = zoo.hf_config(model_name)
    return [ModelConfig(f"m{i}", zoo.random_causal_lm,
                        {"name": model_name, "seed": i, "dtype": dtype, "fast_init": True},
                        batch_manager=CausalLMBatchManager.for_config(hf, max_batch_size=max_batch_size))
            for i in range(n_models)]


def make_prompt(model_name: str, length: int = 8, seed: int = 0) -> List[int]:
    """A fixed prompt of ``length`` token ids (BOS first), the same for every request of a run."""
    from computron import zoo
    vocab = zoo.hf_config(model_name).vocab_size
    rng = np.random.default_rng(seed)
    return [2] + [int(x) for x in rng.integers(4, vocab, size=length - 1)]


PACK_CHOICES = {"pinned": "pinned", "true": True, "false": False}
"""``--pack-cpu-linears`` of the scripts that have it, as ``EngineConfig.pack_cpu_linears``."""


def engine_config(mode: str, max_loaded: int, **kw):
    from computron import EngineConfig
    if mode not in ("ours", "paper"):
        raise ValueError(f"mode {mode!r}: must be 'ours' or 'paper'")
    return EngineConfig(max_loaded=max_loaded, paper_mode=(mode == "paper"), **kw)


def launch_opt(mode: str, model_name: str, n_models: int, max_loaded: int, args):
    """``n_models`` OPT models in ``mode`` ('ours' or 'paper') with the scripts' shared options (``batch_size``,
    ``dtype``, ``threads``, ``no_overlap``, ``no_prefetch``, ``tp_world_size``, ``pp_world_size``): the engine
    and its start-up seconds. Call it outside the event loop: LaunchEngine blocks for the whole start-up."""
    from computron import LaunchEngine
    mcs = opt_model_configs(model_name, n_models, args.batch_size, args.dtype)
    cfg = engine_config(mode, max_loaded, worker_threads=args.threads, overlap=not args.no_overlap,
                        prefetch=not args.no_prefetch,
                        pack_cpu_linears=PACK_CHOICES[getattr(args, "pack_cpu_linears", "pinned")])
    t0 = time.perf_counter()
    engine = LaunchEngine(cfg, mcs, tp_world_size=args.tp_world_size, pp_world_size=args.pp_world_size)
    return engine, time.perf_counter() - t0


def parse_modes(s: str) -> List[str]:
    modes = [m.strip() for m in s.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("ours", "paper")]
    if not modes or bad:
        raise ValueError(f"--modes {s!r}: a comma-separated list of 'ours' and 'paper'")
    return modes


def write_json(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}", file=sys.stderr)


# ---- where results go --------------------------------------------------------------------

EXPERIMENTS_DIR = os.path.dirname(os.path.abspath(__file__))
PUBLISHED_DIRS = ("data", "figures")
"""The tracked results under ``experiments/``: written only with ``--publish`` (``run_cpu.sh --publish``)."""


def results_path(*parts: str) -> str:
    """A default output: ``results/<parts...>`` under the current directory (git-ignored)."""
    return os.path.join("results", *parts)


def add_publish_arg(ap) -> None:
    ap.add_argument("--publish", action="store_true",
                    help="allow writing into the tracked experiments/data and experiments/figures "
                         "(experiments/run_cpu.sh --publish refreshes them)")


def _published(path: str) -> bool:
    real = os.path.realpath(path)
    for d in PUBLISHED_DIRS:
        top = os.path.realpath(os.path.join(EXPERIMENTS_DIR, d))
        if os.path.commonpath([real, top]) == top:
            return True
    return False


def check_outputs(ap, publish: bool, *paths: Optional[str]) -> None:
    """Refuse (``ap.error``: exit 2, before anything runs) to overwrite the tracked results without ``--publish``."""
    tracked = [p for p in paths if p and _published(p)]
    if tracked and not publish:
        ap.error(f"{', '.join(tracked)}: inside the tracked experiments/{{{','.join(PUBLISHED_DIRS)}}}; add "
                 "--publish to refresh the published results on purpose, or leave the output option out to "
                 "write under results/ (git-ignored)")


def check_trace(ap, trace: Sequence, label: str, rates: Sequence[float], duration: float,
                knobs: Tuple[str, str] = ("--duration", "--rate-scale")) -> None:
    """Refuse (``ap.error``: exit 2, before any engine starts) a trace without a single request."""
    if trace:
        return
    ap.error(f"{label}: the trace drew 0 requests ({duration:g} s of arrivals at "
             f"{tuple(_num(round(r, 6)) for r in rates)} req/s, {sum(rates) * duration:.2g} expected); raise "
             f"{knobs[0]} or {knobs[1]} until rate x duration is several requests per model")


# ---- engine records as JSON -------------------------------------------------------------

PERF_FIELDS = ("start", "end", "at", "submitted", "finished", "first_token")
"""Fields of the records in ``computron.metrics`` that hold master ``perf_counter`` times."""


def record_json(rec, t0: float = 0.0) -> dict:
    """Any engine record (swap, batch, step, request, kv_offload/kv_restore, preemption) as JSON: its
    fields, master times (and per-rank times) relative to ``t0``; the per-rank device bytes left out."""
    d = dataclasses.asdict(rec)
    d.pop("device_bytes", None)
    for k in PERF_FIELDS:
        if d.get(k) is not None:
            d[k] -= t0
    if "rank_times" in d:
        d["rank_times"] = {str(r): [a - t0, b - t0] for r, (a, b) in d["rank_times"].items()}
    return d


class Progress:
    """A line on stderr every ``every`` answers (and at the last): count, elapsed time, throughput."""

    def __init__(self, mode: str, total: int, every: int):
        self._clock = time.perf_counter
        self.mode, self.total, self.every = mode, total, every
        self.done = 0
        self.start = self._clock()

    def tick(self) -> None:
        self.done += 1
        if self.every and (self.done % self.every == 0 or self.done == self.total):
            el = self._clock() - self.start
            print(f"[{self.mode}] {self.done}/{self.total} answered, {el:.1f}s elapsed, "
                  f"{self.done / el:.2f} req/s", file=sys.stderr, flush=True)


# ---- LLM-like requests (token-level experiments and the generation benchmark) ----------------

def llm_requests(trace: Sequence[Tuple[float, str]], model_name: str, seed: int, mean_tokens: float = 48.0,
                 max_tokens_cap: int = 256, prompt_range: Tuple[int, int] = (8, 64)) -> List[Tuple[float, str, dict]]:
    """``(arrival, model_id, request)`` for each arrival: a prompt of ``prompt_range`` random tokens and a
    lognormal (sigma 1, mean ``mean_tokens``, capped) number of new tokens, all from ``seed``."""
    from computron import zoo
    rng = np.random.default_rng(seed)
    vocab = zoo.hf_config(model_name).vocab_size
    sigma = 1.0
    mu = np.log(mean_tokens) - sigma ** 2 / 2
    out = []
    for t, mid in trace:
        n_prompt = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        prompt = [2] + [int(x) for x in rng.integers(4, vocab, size=n_prompt - 1)]
        n_new = int(min(max_tokens_cap, max(1, round(rng.lognormal(mu, sigma)))))
        out.append((float(t), mid, {"input_ids": prompt, "max_tokens": n_new}))
    return out


async def replay_stream(submit_stream, requests: Sequence[Tuple[float, str, dict]], label: str = "",
                        progress_every: int = 0) -> List[dict]:
    """Send each request at its arrival time through ``submit_stream(model_id, data)`` (an async iterator
    of tokens, e.g. ``engine.stream``) and record, per request, TTFT, end-to-end time and tokens."""
    import asyncio
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    progress = Progress(label, len(requests), progress_every)
    results: List[dict] = []

    async def one(at, mid, data):
        await asyncio.sleep(max(0.0, t0 + at - loop.time()))  # the load generator's arrival clock
        sent = loop.time()
        rec = {"model": mid, "arrival": at, "sent": sent - t0, "ok": True, "error": None, "tokens": 0}
        first = None
        try:
            async for _ in submit_stream(mid, data):
                rec["tokens"] += 1
                if first is None:
                    first = loop.time()
        except Exception as exc:  # noqa: BLE001 - recorded; the replay goes on
            rec["ok"], rec["error"] = False, f"{type(exc).__name__}: {exc}"
        end = loop.time()
        rec.update(ttft=None if first is None else first - sent, e2e=end - sent, end=end - t0,
                   tpot=(end - first) / (rec["tokens"] - 1) if first is not None and rec["tokens"] > 1 else None)
        results.append(rec)
        progress.tick()

    await asyncio.gather(*[one(*r) for r in requests])
    return results


def summarize_llm(results: Sequence[dict], ttft_slo: Optional[float] = None) -> dict:
    """TTFT / time per output token / end-to-end (mean, p50, p99), tokens/s, SLO attainment."""
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    e2e = [r["e2e"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    span = max((r["end"] for r in results), default=0.0)
    out = {"requests": len(results), "errors": len(results) - len(ok), "output_tokens": tokens, "span_s": span,
           "ttft_mean": mean(ttft), "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
           "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
           "e2e_mean": mean(e2e), "e2e_p50": percentile(e2e, 50), "e2e_p99": percentile(e2e, 99),
           "tokens_per_s": tokens / span if span else None}
    if ttft_slo is not None:
        out["ttft_slo_s"] = ttft_slo
        out["slo_attainment"] = (sum(1 for r in ok if r["ttft"] is not None and r["ttft"] <= ttft_slo)
                                 / len(results)) if results else None
    return out
