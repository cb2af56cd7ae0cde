"""Serve several MLPs (nn.Sequential), each split over TP x PP workers, and check the answers.

    python examples/mlp/serve_mlp.py --tp 2 --pp 1
    torchrun --nproc_per_node 2 examples/mlp/serve_mlp.py --tp 1 --pp 2

(from the repository root with the venv active: ``source .venv/bin/activate``, or ``.venv/bin/python``.)
"""
import argparse
import asyncio
import time

import torch

from computron import EngineConfig, LaunchEngine, ModelConfig, report, zoo


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=int, default=3)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4, help="Linear layers per model")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--max-loaded", type=int, default=1)
    p.add_argument("--requests", type=int, default=12)
    args = p.parse_args()
    sizes = (args.width,) * (args.depth + 1)
    configs = [ModelConfig(f"mlp{i}", zoo.mlp, {"sizes": sizes, "seed": i}) for i in range(args.models)]
    engine = LaunchEngine(EngineConfig(max_loaded=args.max_loaded), configs, args.tp, args.pp)
    if engine is None:
        return

    async def run():
        async with engine:
            x = torch.randn(4, args.width)
            refs = {i: zoo.mlp(sizes, seed=i)(x) for i in range(args.models)}
            for k in range(args.requests):
                i = k % args.models
                t0 = time.perf_counter()
                out = await engine.submit(f"mlp{i}", x)
                err = (out - refs[i]).abs().max().item()
                print(f"[{k:3d}] mlp{i}: max |sharded - unsharded| = {err:.2e}  "
                      f"({(time.perf_counter() - t0) * 1e3:.1f} ms)")
            print(report.swap_table(engine.metrics()))
            print(report.summary(engine.metrics()))
    asyncio.run(run())


if __name__ == "__main__":
    main()
