"""Models churned while clients generate: 8 clients send greedy requests while another issues 500 random
add / replace / remove / pin / priority operations. Every answer must equal the unsharded model of a
version its id named while the request was out (exact versions are not visible to a client; versions are
different checkpoints, whose answers differ), every failure must be an UnknownModelError for an id that
was not served at some moment of that request, nothing may hang, and once everything is removed each
rank holds the bytes it held at the start."""
import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import pytest
from helpers import greedy_reference

from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
from computron.errors import UnknownModelError

IDS = ["m0", "m1", "m2", "m3"]
PROMPTS = [[5, 6, 7, 8], [30, 31]]
N = 4
OPS = 500
CLIENTS = 8


def lm(model_id, path):
    return ModelConfig(model_id, zoo.load_causal_lm, {"path": path})


@dataclass
class History:
    """When each id named which checkpoint, and when it named none, on the test's clock. An interval
    starts when its change was asked for and ends when the change that closed it returned."""
    served: Dict[str, List[list]] = field(default_factory=lambda: {m: [] for m in IDS})
    """id -> [[checkpoint, start, end or None], ...]"""
    unserved: Dict[str, List[list]] = field(default_factory=lambda: {m: [[0.0, None]] for m in IDS})

    def candidates(self, m: str, t0: float, t1: float) -> set:
        return {c for c, s, e in self.served[m] if s <= t1 and (e is None or e >= t0)}

    def gap(self, m: str, t0: float, t1: float) -> bool:
        return any(s <= t1 and (e is None or e >= t0) for s, e in self.unserved[m])


@pytest.mark.timeout(600)
def test_500_random_model_changes_under_8_greedy_clients(checkpoints):
    names = ["opt0", "opt1", "opt2", "llama0"]
    refs = {(c, i): greedy_reference(checkpoints[c], p, N).tolist() for c in names for i, p in enumerate(PROMPTS)}
    for i in range(len(PROMPTS)):
        answers = [refs[(c, i)] for c in names]
        assert len({tuple(a) for a in answers}) == len(names), "the checkpoints must answer differently"
    rng = random.Random(0)
    history = History()
    counts = {"ok": 0, "unknown": 0, "ops": {}}

    async def client(engine, stop: asyncio.Event, k: int):
        crng = random.Random(k)
        while not stop.is_set():
            m, i = crng.choice(IDS), crng.randrange(len(PROMPTS))
            t0 = time.perf_counter()
            try:
                out = await engine.submit(m, {"input_ids": PROMPTS[i], "max_tokens": N}, timeout=120)
            except UnknownModelError:
                assert history.gap(m, t0, time.perf_counter()), f"{m} was served all along"
                counts["unknown"] += 1
                await asyncio.sleep(0)  # a yield point, so that refusals cannot starve the loop
                continue
            t1 = time.perf_counter()
            allowed = {tuple(refs[(c, i)]) for c in history.candidates(m, t0, t1)}
            assert tuple(out.tolist()) in allowed, (m, i, out.tolist(), allowed)
            counts["ok"] += 1

    async def operator(engine):
        current: Dict[str, Optional[str]] = {m: None for m in IDS}
        for _ in range(OPS):
            m = rng.choice(IDS)
            now = time.perf_counter()
            if current[m] is None:
                op, c = "add", rng.choice(names)
                history.served[m].append([c, now, None])
                await engine.add_model(lm(m, checkpoints[c]))
                history.unserved[m][-1][1] = time.perf_counter()
                current[m] = c
            else:
                op = rng.choice(["replace", "remove", "pin", "priority"])
                if op == "replace":
                    c = rng.choice([x for x in names if x != current[m]])
                    history.served[m].append([c, now, None])
                    await engine.replace_model(m, lm(m, checkpoints[c]))
                    history.served[m][-2][2] = time.perf_counter()
                    current[m] = c
                elif op == "remove":
                    history.unserved[m].append([now, None])
                    await engine.remove_model(m, drain=True)
                    history.served[m][-1][2] = time.perf_counter()
                    current[m] = None
                elif op == "pin":
                    engine.set_pinned(m, rng.random() < 0.5)
                else:
                    engine.set_priority(m, rng.randrange(-2, 3))
            counts["ops"][op] = counts["ops"].get(op, 0) + 1
        for m in IDS:
            if current[m] is not None:
                history.unserved[m].append([time.perf_counter(), None])
                await engine.remove_model(m)

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=2), [lm("base", checkpoints["opt0"])], 1, 1)
        async with engine:
            start = await engine.stats_async()
            stop = asyncio.Event()
            clients = [asyncio.ensure_future(client(engine, stop, k)) for k in range(CLIENTS)]
            try:
                await operator(engine)
            finally:
                stop.set()
                await asyncio.gather(*clients)
            assert engine.model_ids == ["base"]
            assert engine.snapshot().models["base"].draining_versions == 0
            end = await engine.stats_async()
            return start, end
    start, end = asyncio.run(go())
    assert counts["ok"] > OPS // 5 and counts["unknown"] > 0, counts
    assert set(counts["ops"]) == {"add", "replace", "remove", "pin", "priority"}, counts
    for r, s in start.items():
        e = end[r]
        assert abs(e.host_bytes - s.host_bytes) <= 0.05 * s.host_bytes, (r, s, e)
        assert e.device_bytes <= s.device_bytes * 1.05 and e.kv_bytes == 0 and e.host_kv_bytes == 0, (r, s, e)
