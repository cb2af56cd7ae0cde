"""Attach mode with one rank deliberately built last (run under torchrun by tests/e2e/test_launch.py).

``LAST=0``: rank 0 builds its shard only after a heartbeat of rank 1 has reached its master channel,
so that heartbeat arrives before the engine exists. ``LAST=1``: rank 1 builds only after rank 0's own
worker has sent a heartbeat, which likewise comes before the engine. Either way the engine must
then answer correctly and hear every rank's heartbeats. The waits are events (a threading.Event on
rank 0, a FIFO between the ranks), never sleeps; ``HANDOFF`` names the FIFO.
"""
import asyncio
import os
import sys
import threading

import torch

from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
from computron.comm import transport
from computron.comm import messages as msg

SIZES = (16, 32, 32, 16)
LAST = int(os.environ["LAST"])
RANK = int(os.environ["RANK"])
WAIT_S = 120
_seen = {}  # rank -> Event: a heartbeat from that rank reached rank 0's master channel before the engine


def _seen_event(rank: int) -> threading.Event:
    return _seen.setdefault(rank, threading.Event())


def _watch_start_up_heartbeats() -> None:
    """Every heartbeat rank 0's master channel hands over sets its rank's event (the first ones come
    while rank 0 is still building, before any engine exists)."""
    init = transport.MasterChannel.__init__

    def watching(self, groups, on_reply, *args, **kwargs):
        def route(reply):
            if isinstance(reply, msg.Heartbeat):
                _seen_event(reply.rank).set()
            on_reply(reply)
        init(self, groups, route, *args, **kwargs)
    transport.MasterChannel.__init__ = watching


def _release_rank1_after_own_heartbeat() -> None:
    def release():
        if not _seen_event(0).wait(WAIT_S):
            sys.stderr.write("rank 0 never sent a start-up heartbeat\n")
            os._exit(3)
        with open(os.environ["HANDOFF"], "w") as fifo:  # blocks until rank 1 opens it
            fifo.write("go")
    threading.Thread(target=release, daemon=True).start()


def model_fn(seed: int):
    if seed == 0 and RANK == 0 and LAST == 0 and not _seen_event(1).wait(WAIT_S):
        raise RuntimeError("rank 1 sent no heartbeat while rank 0 was building")
    if seed == 0 and RANK == 1 and LAST == 1:
        with open(os.environ["HANDOFF"]) as fifo:  # blocks until rank 0 has beaten once
            assert fifo.read() == "go"
    return zoo.mlp(SIZES, seed=seed)


async def serve(engine) -> None:
    beats = {r: threading.Event() for r in range(2)}

    def heard(reply):
        if isinstance(reply, msg.Heartbeat):
            beats[reply.rank].set()
    engine.add_reply_observer(heard)
    async with engine:
        x = torch.randn(3, SIZES[0])
        for seed in (0, 1, 0):
            out = await engine.submit(f"mlp{seed}", x)
            torch.testing.assert_close(out, zoo.mlp(SIZES, seed=seed)(x))
        loop = asyncio.get_running_loop()
        for rank, beat in beats.items():
            if not await loop.run_in_executor(None, beat.wait, WAIT_S):
                raise AssertionError(f"no heartbeat of rank {rank} reached the engine")
        assert engine.is_alive, engine.dead_reason
    sys.stdout.write("ATTACH RACE OK\n")
    sys.stdout.flush()


if __name__ == "__main__":
    if RANK == 0:
        _watch_start_up_heartbeats()
        if LAST == 1:
            _release_rank1_after_own_heartbeat()
    configs = [ModelConfig(f"mlp{i}", model_fn, {"seed": i}) for i in range(2)]
    engine = LaunchEngine(EngineConfig(max_loaded=1, heartbeat_timeout_s=8.0, start_timeout_s=WAIT_S),
                          configs, 1, 2)
    if engine is not None:
        asyncio.run(serve(engine))
