"""The master's reply receiving cannot be blocked by one stuck peer (real gloo, three processes).

Rank 0 sends the first frame of a message larger than a frame and then stops there (as a rank stopped or cut
off halfway through a reply would); rank 1 keeps sending heartbeats. The master hears every one of rank 1's
heartbeats meanwhile, then rank 0's message once it sends the rest, and both ranks' goodbyes.
"""
import multiprocessing as mp
import queue
from datetime import timedelta

import pytest

pytestmark = pytest.mark.timeout(240)
WAIT_S = 120.0


def _join(path, rank):
    import torch.distributed as dist

    from computron.comm.topology import Groups, Layout
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=3,
                            timeout=timedelta(seconds=WAIT_S))
    return Groups(Layout(tp=2, pp=1, master_rank=2, master_is_worker=False), rank, "gloo",
                  timedelta(seconds=WAIT_S))


def _rank(path, rank, frame_sent, go_on):
    import torch.distributed as dist

    from computron.comm import messages as msg
    from computron.comm import transport
    groups = _join(path, rank)
    channel = transport.WorkerChannel(groups)
    if rank == 0:
        frame, rest = transport._frames(msg.WorkerStartFailed(0, "x" * 3 * transport.FRAME))
        dist.send(frame, dst=2, group=groups.res)
        frame_sent.set()
        go_on.wait(WAIT_S)
        dist.send(rest, dst=2, group=groups.res)
    else:
        frame_sent.wait(WAIT_S)
        for _ in range(3):
            channel.reply(msg.Heartbeat(rank=1, sent=0.0))
    while not isinstance(channel.recv(), msg.Shutdown):
        pass
    channel.reply(msg.Bye(rank))
    dist.destroy_process_group()


def test_one_stuck_peer_does_not_block_the_others_replies(tmp_path):
    import torch.distributed as dist

    from computron.comm import messages as msg
    from computron.comm.transport import MasterChannel
    ctx = mp.get_context("spawn")
    frame_sent, go_on = ctx.Event(), ctx.Event()
    path = str(tmp_path / "store")
    procs = [ctx.Process(target=_rank, args=(path, r, frame_sent, go_on), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    got = queue.Queue()
    try:
        groups = _join(path, 2)
        channel = MasterChannel(groups, on_reply=got.put, on_transport_error=got.put,
                                on_handler_error=lambda exc, reply: got.put(exc), keepalive_s=0.5)
        channel.start()
        beats = [got.get(timeout=WAIT_S) for _ in range(3)]  # rank 0 is stuck halfway through its message
        assert beats == [msg.Heartbeat(rank=1, sent=0.0)] * 3
        go_on.set()
        assert got.get(timeout=WAIT_S) == msg.WorkerStartFailed(0, "x" * 3 * 16384)
        channel.send(msg.Shutdown())
        assert channel.close(timeout=WAIT_S)
        dist.destroy_process_group()
        for p in procs:
            p.join(WAIT_S)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        go_on.set()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
