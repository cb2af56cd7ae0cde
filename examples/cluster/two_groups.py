"""Two engine groups on a local Ray cluster (pip install -e .[ray]), through the engine's own API.

    .venv/bin/python examples/cluster/two_groups.py      # about a minute on a 2-core CPU, most of it start-up
"""
import asyncio
from computron import EngineConfig, ModelConfig, zoo
from computron.cluster.serve import init_ray, start_cluster

async def main():
    paths = [zoo.save_random_causal_lm("opt-tiny", f"ckpt/tiny{i}", seed=i) for i in range(2)]
    configs = [ModelConfig(f"tiny{i}", zoo.load_causal_lm, {"path": p}) for i, p in enumerate(paths)]
    started = init_ray()                                  # init_ray("auto") joins a running cluster
    cluster = await asyncio.to_thread(start_cluster, EngineConfig(max_loaded=1), configs, n_groups=2)
    try:
        out = await cluster.submit("tiny1", {"input_ids": [2, 100, 200], "max_tokens": 8})   # Engine's API
        print(out.tolist(), {m: s.groups for m, s in cluster.snapshot().models.items()})
    finally:
        cluster.close()
        if started:
            import ray
            ray.shutdown()

if __name__ == "__main__":
    asyncio.run(main())
