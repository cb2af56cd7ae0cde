"""Models and LoRA adapters added, replaced and removed while the engine serves.

    .venv/bin/python examples/runtime/models_and_adapters.py            # TP=2, opt-small (about a minute on a CPU)
    .venv/bin/python examples/runtime/models_and_adapters.py --tp 1 --shape opt-tiny

Writes random-weight checkpoints and adapters under ``--dir`` (kept), starts an engine with one model, then
while a long generation runs: adds a second model, serves two adapters of the first in one step with its
bare model, replaces the second model by a new version, and removes everything again, printing what each
change cost and what each answer was.
"""
import argparse
import asyncio
import os
import time

from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
from computron.testing.zoo_lora import save_random_lora


def checkpoints(root: str, shape: str):
    path = lambda name: os.path.join(root, name)  # noqa: E731
    models = [zoo.save_random_causal_lm(shape, path(f"{shape}-{i}"), seed=i)
              if not os.path.exists(path(f"{shape}-{i}")) else path(f"{shape}-{i}") for i in range(3)]
    adapters = [save_random_lora(models[0], path(f"{shape}-0-lora{i}"), seed=i, r=8)
                if not os.path.exists(path(f"{shape}-0-lora{i}")) else path(f"{shape}-0-lora{i}") for i in range(2)]
    return models, adapters


async def main(args):
    models, adapters = checkpoints(args.dir, args.shape)
    lm = lambda mid, p: ModelConfig(mid, zoo.load_causal_lm, {"path": p})  # noqa: E731
    engine = await asyncio.to_thread(LaunchEngine, EngineConfig(max_loaded=2), [lm("chat", models[0])], args.tp)
    if engine is None:
        return
    ask = {"input_ids": [2, 100, 200, 300], "max_tokens": 8}
    async with engine:
        long = asyncio.ensure_future(engine.submit("chat", {**ask, "max_tokens": 64}))  # keeps stepping meanwhile

        t0 = time.perf_counter()
        await engine.add_model(lm("code", models[1]))
        print(f"added 'code' in {time.perf_counter() - t0:.2f} s while 'chat' generated; models: {engine.model_ids}")

        for i, path in enumerate(adapters):
            await engine.add_model(ModelConfig(f"chat-ft{i}", base="chat", adapter=path))
        outs = await asyncio.gather(*[engine.submit(m, ask) for m in ("chat", "chat-ft0", "chat-ft1")])
        for m, out in zip(("chat", "chat-ft0", "chat-ft1"), outs):
            print(f"{m:9s} -> {out.tolist()}")  # three answers, one step at a time for all three

        before = (await engine.submit("code", ask)).tolist()
        t0 = time.perf_counter()
        await engine.replace_model("code", lm("code", models[2]))
        after = (await engine.submit("code", ask)).tolist()
        print(f"replaced 'code' in {time.perf_counter() - t0:.2f} s: {before} -> {after} "
              f"(version {engine.snapshot().models['code'].version})")

        await long
        for m in ("chat-ft0", "chat-ft1", "code"):
            await engine.remove_model(m)
        print(f"removed; still served: {engine.model_ids}; loads so far: "
              f"{[(r.model_id, round(r.end - r.start, 3)) for r in engine.metrics('load')]}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--shape", default="opt-small")
    p.add_argument("--dir", default=os.path.join(os.path.expanduser("~"), ".cache", "computron-examples"))
    asyncio.run(main(p.parse_args()))
