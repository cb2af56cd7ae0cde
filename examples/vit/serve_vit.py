"""Serve ViT image classifiers split over TP x PP workers: PNG bytes or pixel values in, top-k labels out.

    .venv/bin/python examples/vit/serve_vit.py --tp 2 --pp 1               # spawns 2 workers
    .venv/bin/python examples/vit/serve_vit.py --models 2 --tp 2 --pp 2 --max-loaded 1
    .venv/bin/torchrun --nproc_per_node 2 examples/vit/serve_vit.py --pp 2

Each model is a seeded random ViT with an image classification head and a
label set, written with ``save_pretrained`` (and its image processor config)
to ``--ckpt-dir`` and loaded back from there like a real checkpoint. Requests
send encoded PNG images (as base64 text, the way a JSON client would) or
already preprocessed ``pixel_values``; the batch manager decodes the images
with PIL, preprocesses them with the checkpoint's ``ViTImageProcessor`` and
answers with the top-k labels and their scores. With ``--check`` every answer
is compared with the unsharded transformers model.
"""
import argparse
import asyncio
import base64
import io
import os
import tempfile
import time

import torch

from computron import EngineConfig, ImageClassificationBatchManager, LaunchEngine, ModelConfig, report
from computron import zoo_understanding as zu

LABELS = ["objects", "digits"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny", choices=sorted(zu.ENCODER_SHAPES))
    p.add_argument("--image-size", type=int, default=zu.IMAGE_SIZE)
    p.add_argument("--patch-size", type=int, default=zu.PATCH_SIZE)
    p.add_argument("--models", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--max-loaded", type=int, default=1)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--ckpt-dir", default=os.path.join(tempfile.gettempdir(), "computron-vit"))
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare every answer with the unsharded model (float32 only)")
    return p.parse_args()


def png(seed: int, size=(48, 40)) -> bytes:
    """A random RGB picture, PNG-encoded (resized by the image processor to the model's size)."""
    from PIL import Image
    g = torch.Generator().manual_seed(seed)
    arr = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def reference(path, bm, data):
    from collections import deque

    from computron import SubmitEntry
    task, _ = bm.make_batch(deque([SubmitEntry(0, data)]))
    with torch.inference_mode():
        return zu.load_encoder(path)(**task.batch).logits[0]


async def client(engine, args, paths, bms):
    print(f"serving {engine.model_ids} (vit-{args.shape}, {args.image_size}px) over TP={args.tp} x "
          f"PP={args.pp}, max_loaded={args.max_loaded}; weights are random, so labels are arbitrary\n")
    ids = engine.model_ids
    worst = 0.0
    for k in range(args.requests):
        mid = ids[k % len(ids)]
        if k % 3 == 2:
            g = torch.Generator().manual_seed(k)
            data = {"pixel_values": torch.randn(3, args.image_size, args.image_size, generator=g).tolist()}
            what = "pixel_values"
        else:
            data = {"image": base64.b64encode(png(k)).decode()}
            what = "PNG (base64)"
        data["top_k"] = args.top_k
        t0 = time.perf_counter()
        out = await engine.submit(mid, data)
        dt = (time.perf_counter() - t0) * 1e3
        shown = ", ".join(f"{x['label']} {x['score']:.3f}" for x in out["labels"])
        line = f"[{k:3d}] {mid:6s} {what:13s} -> {shown}  ({dt:.1f} ms)"
        if args.check:
            err = (torch.tensor(out["logits"]) - reference(paths[mid], bms[mid], data).float()).abs().max().item()
            worst = max(worst, err)
            line += f"  |sharded - unsharded| {err:.1e}"
        print(line)
    if args.check:
        print(f"\nlargest difference from the unsharded models: {worst:.2e}")
    print("\n" + report.swap_table(engine.metrics()))
    print("\n" + report.summary(engine.metrics()))


def main():
    args = parse_args()
    if args.dtype != "float32":
        args.check = False
    paths, bms = {}, {}
    for i in range(args.models):
        labels = LABELS[i % len(LABELS)]
        name = f"vit-{labels}{i // len(LABELS) or ''}"
        path = os.path.join(args.ckpt_dir, f"vit-{args.shape}-{args.image_size}-{name}")
        zu.save_random_encoder("vit", path, "image", seed=200 + i, labels=zu.LABEL_SETS[labels], shape=args.shape,
                               image_size=args.image_size, patch_size=args.patch_size)
        paths[name] = path
        bms[name] = ImageClassificationBatchManager.for_checkpoint(path)
    configs = [ModelConfig(name, zu.load_encoder, {"path": paths[name], "dtype": args.dtype}, batch_manager=bm)
               for name, bm in bms.items()]
    engine = LaunchEngine(EngineConfig(max_loaded=args.max_loaded), configs, args.tp, args.pp)
    if engine is None:  # a worker rank under torchrun: it served until the master shut down
        return

    async def run():
        async with engine:
            await client(engine, args, paths, bms)
    asyncio.run(run())


if __name__ == "__main__":
    main()
