"""Device byte budgets: what each model needs per rank and what the budget allows (inputs of the pure
scheduler, computed from the workers' ready messages), and the engine's scheduler built with them."""
from __future__ import annotations

from typing import Dict, List, Optional

from ..comm import messages as msg
from ..config import EngineConfig, ModelConfig
from ..errors import LaunchError
from ..sched.scheduler import Scheduler


def model_sizes(config: EngineConfig, workers: List[msg.WorkerReady]) -> Dict[str, int]:
    """Device bytes per rank each model needs: its largest shard (with what a quantized model expands on
    arrival) plus the KV reserve."""
    ids = {m for w in workers for m in w.host_bytes}
    return {m: int(max(max(w.host_bytes.get(m, 0), w.device_need.get(m, 0)) for w in workers)
                   * (1 + config.kv_reserve)) for m in ids}


def device_budget(config: EngineConfig, workers: List[msg.WorkerReady]) -> Optional[int]:
    """``EngineConfig.device_budget`` in bytes per rank (a fraction is of the smallest device)."""
    b = config.device_budget
    if b is None or (isinstance(b, int) and not isinstance(b, bool)):
        return b
    memory = min((w.device_memory for w in workers if w.device_memory), default=0)
    if not memory:
        raise ValueError(f"EngineConfig.device_budget={b}: a fraction needs the device's memory size, "
                         "which the workers could not tell; give a byte count")
    return int(b * memory)


def check_memory(config: EngineConfig, workers: List[msg.WorkerReady]) -> None:
    """Refuse, before serving, models that can never fit the device budget (``LaunchError`` with names and
    numbers; also when the budget itself cannot be resolved)."""
    try:
        budget = device_budget(config, workers)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    if budget is None:
        return
    sizes = model_sizes(config, workers)
    too_big = {m: b for m, b in sizes.items() if b > budget}
    if too_big:
        raise LaunchError(f"EngineConfig.device_budget={budget} bytes per rank cannot hold "
                         + ", ".join(f"model {m!r} ({b} bytes per rank: shard + {config.kv_reserve:g} KV reserve)"
                                     for m, b in sorted(too_big.items())))


def make_scheduler(config: EngineConfig, model_configs: List[ModelConfig],
                   workers: List[msg.WorkerReady]) -> Scheduler:
    """The engine's scheduler for these models, with their sizes and the device budget. One batch (or step)
    in flight per model: workers run commands in order anyway, and a second batch sent early would only
    split a burst into smaller batches. (A token-level step may have its next sent ahead: ``step_ahead``.)"""
    paper = config.paper_mode
    return Scheduler([mc.model_id for mc in model_configs], config.max_loaded,
                     prefetch=config.prefetch and not paper, overlap=config.overlap and not paper,
                     max_inflight=1, policy="run_to_completion" if paper else config.policy,
                     quantum_s=config.quantum_ms / 1e3, ttft_slo_s=config.ttft_slo_s,
                     sizes=model_sizes(config, workers), device_budget=device_budget(config, workers),
                     pinned=[mc.model_id for mc in model_configs if mc.pinned],
                     priority={mc.model_id: mc.priority for mc in model_configs}, eviction=config.eviction)
