"""The engine's own overhead: a model that returns its input, no weights to swap.

    python examples/echo/serve_echo.py --requests 200
    python examples/echo/serve_echo.py --serve     # serve until SIGINT/SIGTERM (prints READY)

(from the repository root with the venv active: ``source .venv/bin/activate``, or ``.venv/bin/python``.)
"""
import argparse
import asyncio
import statistics
import time

import torch

from computron import EngineConfig, LaunchEngine, ModelConfig, zoo


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--serve", action="store_true", help="block serving until a signal arrives")
    args = p.parse_args()
    configs = [ModelConfig(f"echo{i}", zoo.echo) for i in range(args.models)]
    engine = LaunchEngine(EngineConfig(max_loaded=args.models), configs, args.tp, args.pp)
    if engine is None:
        return
    if args.serve:
        print("READY", flush=True)
        engine.run()  # returns once the engine is shut down (SIGTERM, or Ctrl-C below)
        return

    async def run():
        async with engine:
            x = torch.arange(8)
            lat = []
            for k in range(args.requests):
                t0 = time.perf_counter()
                out = await engine.submit(f"echo{k % args.models}", x)
                lat.append(time.perf_counter() - t0)
                assert torch.equal(out, x)
            lat.sort()
            print(f"{args.requests} echo requests: median {statistics.median(lat) * 1e3:.3f} ms, "
                  f"p99 {lat[int(0.99 * (len(lat) - 1))] * 1e3:.3f} ms")
    asyncio.run(run())


if __name__ == "__main__":
    main()
