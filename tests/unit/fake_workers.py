"""Fake workers for in-process engine tests: no process, no torch.distributed, no model.

``FakeChannel`` stands where the transport does: the engine calls ``send(cmd)`` under
its lock, and the channel only records the command. ``FakeWorkers`` answers the
recorded commands when a test says so, by calling ``engine.on_reply`` from the
test's own thread, exactly as the transport's receiver thread would: one reply
per rank, of the type ``computron.worker`` sends for that command
(``Load`` -> ``Loaded``, ``Offload`` -> ``Offloaded``, ``Drop`` -> ``Dropped``,
``Step`` -> ``StepDone``, ``RunBatch`` -> ``BatchDone``, ``AddModel`` -> ``ModelAdded``,
``RemoveModel`` -> ``ModelRemoved``, ``AddAdapter``/``RemoveAdapter`` -> ``AdapterDone``,
``SetHostModels`` -> ``HostModelsSet``, ``QueryStats`` -> ``Stats``), or ``CommandFailed``
through ``fail``. A model added while serving is a causal LM unless its id is in
``request_level``.

The fake keeps what real workers keep between commands: each model's running
sequences (admitted by a ``Step``, dropped by ``drop``/``Drop``, ended by EOS or
``max_tokens``, dropped for recompute by a preemption ``Offload``, parked
otherwise). Every command's outcome is computed once, when its first successful
reply is made, so all ranks agree. Tokens follow a deterministic rule of the
sequence id and its position (prompt + generated tokens so far): a sequence
rebuilt by prefill after a preemption continues exactly where it stopped.

``build_engine`` makes an ``Engine`` over such workers, with the ready messages a
launcher would have collected (``batching`` for the causal LMs).
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from computron.comm import messages as msg
from computron.config import EngineConfig, ModelConfig
from computron.engine import Engine
from computron.comm.topology import Layout

EOS = 2
"""The causal LMs' EOS id by default; the default rule never produces it (its tokens are 3..52)."""
KV_BYTES_PER_SEQ = 10
"""What one running sequence's KV cache weighs on one rank, in the fake's accounting."""


def model_fn():
    """A ModelConfig needs a model builder; the fake workers never call it."""
    raise AssertionError("fake workers build no model")


def token_rule(sid: int, position: int) -> int:
    """The token a sequence gets at ``position`` (its context length before the token)."""
    return (sid * 7 + position) % 50 + 3


def expected_tokens(sid: int, prompt_len: int, max_tokens: int, eos: Iterable[int] = (EOS,),
                    rule: Callable[[int, int], int] = token_rule) -> List[int]:
    """What a sequence generates under ``rule``: up to ``max_tokens``, cut after its first EOS."""
    eos = set(eos)
    out = []
    for i in range(max_tokens):
        out.append(rule(sid, prompt_len + i))
        if out[-1] in eos:
            break
    return out


def double(batch: Any) -> Any:
    """The default request-level 'model': every number doubled."""
    if isinstance(batch, (list, tuple)):
        return [double(x) for x in batch]
    return batch * 2


@dataclass
class _Seq:
    spec: msg.SeqSpec
    position: int
    generated: int = 0


class FakeChannel:
    """Records what the engine sends. Never answers from inside ``send`` (the engine holds its lock)."""

    def __init__(self):
        self.sent: List[Any] = []
        self._cond = threading.Condition()

    def send(self, cmd: Any) -> None:
        with self._cond:
            self.sent.append(cmd)
            self._cond.notify_all()

    def of_type(self, cls, model_id: Optional[str] = None) -> List[Any]:
        with self._cond:
            return [c for c in self.sent if isinstance(c, cls)
                    and (model_id is None or getattr(c, "model_id", None) == model_id)]

    def kinds(self) -> List[tuple]:
        """``[(type name, model id), ...]`` of everything sent, in order: the command log at a glance."""
        with self._cond:
            return [(type(c).__name__, getattr(c, "model_id", None)) for c in self.sent]

    def wait_for(self, pred: Callable[[Any], bool], timeout: float = 5.0) -> Any:
        """The first command matching ``pred``, waiting (on a condition, not a timer) for another thread
        to send it; AssertionError after ``timeout`` seconds."""
        with self._cond:
            found = self._cond.wait_for(lambda: next((c for c in self.sent if pred(c)), None), timeout)
        assert found is not None, f"no matching command was sent within {timeout}s: {self.kinds()}"
        return found


class FakeWorkers:
    def __init__(self, n_workers: int = 1, output_rank: int = 0,
                 rule: Callable[[int, int], int] = token_rule, batch_fn: Callable[[Any], Any] = double,
                 nbytes: int = 1000):
        self.n_workers = n_workers
        self.output_rank = output_rank
        self.rule = rule
        self.batch_fn = batch_fn
        self.nbytes = nbytes
        self.channel = FakeChannel()
        self.engine: Optional[Engine] = None
        self.replied: Dict[int, set] = defaultdict(set)
        """seq -> ranks that answered it (successfully or not)."""
        self.delivered: List[Any] = []
        """Every reply handed to the engine, in order."""
        self.sequences: Dict[str, Dict[int, _Seq]] = defaultdict(dict)
        """model -> sid -> the sequences the workers hold (running or parked)."""
        self.parked: Dict[str, set] = defaultdict(set)
        self.resident: set = set()
        self.request_level: set = set()
        """Ids of models added while serving that the fake reports as not generative."""
        self.removed: List[str] = []
        """Models freed by ``RemoveModel``, in order."""
        self._outcomes: Dict[int, dict] = {}

    # ---- what is there to answer ---------------------------------------------
    def pending(self) -> List[Any]:
        """Commands some rank has not answered yet, oldest first."""
        return [c for c in self.channel.sent
                if not isinstance(c, msg.Shutdown) and len(self.replied[c.seq]) < self.n_workers]

    def oldest(self, cls=None, model_id: Optional[str] = None) -> Any:
        """The oldest unanswered command (of type ``cls`` and model ``model_id`` if given)."""
        for c in self.pending():
            if (cls is None or isinstance(c, cls)) and (model_id is None or c.model_id == model_id):
                return c
        raise AssertionError(f"no pending {getattr(cls, '__name__', 'command')} for {model_id}: {self.pending()}")

    # ---- answering -----------------------------------------------------------
    def deliver(self, reply: Any) -> None:
        """Hand one reply to the engine, as the transport's receiver thread does."""
        if hasattr(reply, "seq") and hasattr(reply, "rank"):
            self.replied[reply.seq].add(reply.rank)
        self.delivered.append(reply)
        self.engine.on_reply(reply)

    def answer(self, cmd: Any = None, ranks: Optional[Sequence[int]] = None) -> Any:
        """Answer ``cmd`` (default: the oldest pending command) on ``ranks`` (default: every rank that has
        not answered it), with the reply each rank's worker would send. Returns the command."""
        cmd = cmd if cmd is not None else self.oldest()
        for r in (ranks if ranks is not None else range(self.n_workers)):
            if r not in self.replied[cmd.seq]:
                self.deliver(self.reply(cmd, r))
        return cmd

    def answer_all(self, limit: int = 1000) -> int:
        """Answer pending commands in order, including those the answers cause, until none is left.
        Returns how many were answered."""
        n = 0
        while self.pending():
            assert n < limit, f"still answering after {limit} commands: {self.channel.kinds()[-10:]}"
            self.answer()
            n += 1
        return n

    def answer_until(self, done: Callable[[], bool], limit: int = 1000) -> int:
        """Answer pending commands in order until ``done()`` holds (checked before each answer)."""
        n = 0
        while not done():
            assert self.pending(), f"nothing left to answer and the condition does not hold: {self.channel.kinds()}"
            assert n < limit, f"condition not met after {limit} commands"
            self.answer()
            n += 1
        return n

    def fail(self, cmd: Any, rank: int, error: str = "RuntimeError: boom", upstream: bool = False,
             fatal: bool = False) -> msg.CommandFailed:
        """Deliver ``rank``'s CommandFailed for ``cmd`` (``error`` is ``"<type>: <message>"``)."""
        failure = msg.CommandFailed(seq=cmd.seq, rank=rank, model_id=getattr(cmd, "model_id", None), error=error,
                                    fatal=fatal, exc_type=error.split(":", 1)[0], upstream=upstream)
        self.deliver(failure)
        return failure

    # ---- what a worker would reply -------------------------------------------
    def reply(self, cmd: Any, rank: int) -> Any:
        out = self._outcome(cmd)
        now = time.perf_counter()
        done = dict(seq=cmd.seq, rank=rank, start=now, end=now)
        mine = rank == self.output_rank
        if isinstance(cmd, msg.Load):
            return msg.Loaded(**done, model_id=cmd.model_id, nbytes=self.nbytes, device_bytes=self.nbytes)
        if isinstance(cmd, msg.Offload):
            return msg.Offloaded(**done, model_id=cmd.model_id, device_bytes=0,
                                 kv_parked_bytes=out["parked_bytes"],
                                 gen_states=out["gen_states"] if mine else {})
        if isinstance(cmd, msg.Drop):
            return msg.Dropped(**done, model_id=cmd.model_id, kv_bytes=out["kv_bytes"])
        if isinstance(cmd, msg.Step):
            tokens = dict(sids=out["sids"], tokens=out["tokens"], ended=out["ended"]) if mine else {}
            return msg.StepDone(**done, model_id=cmd.model_id, running=out["running"], kv_bytes=out["kv_bytes"],
                                kv_restored_bytes=out["restored"], **tokens)
        if isinstance(cmd, msg.RunBatch):
            return msg.BatchDone(**done, model_id=cmd.model_id, output=out["output"] if mine else None,
                                 has_output=mine)
        if isinstance(cmd, msg.AddModel):
            lm = cmd.model_id.split("@v")[0] not in self.request_level
            return msg.ModelAdded(**done, model_id=cmd.model_id, host_bytes=self.nbytes,
                                  batching=msg.BatchingDefaults(pad_token_id=1, eos_token_id=EOS, vocab_size=100,
                                                                max_positions=64) if lm else None)
        if isinstance(cmd, msg.RemoveModel):
            return msg.ModelRemoved(**done, model_id=cmd.model_id, device_bytes=0, host_bytes=0)
        if isinstance(cmd, (msg.AddAdapter, msg.RemoveAdapter)):
            return msg.AdapterDone(**done, model_id=cmd.model_id, adapter_id=cmd.adapter_id)
        if isinstance(cmd, msg.SetHostModels):  # every planned shard read ahead
            return msg.HostModelsSet(**done, host_resident=tuple(cmd.model_ids), read=tuple(cmd.model_ids))
        if isinstance(cmd, msg.QueryStats):
            return msg.Stats(seq=cmd.seq, rank=rank, device_bytes=self.nbytes * len(self.resident),
                             device_reserved_bytes=0, host_bytes=self.nbytes, resident=tuple(sorted(self.resident)))
        raise AssertionError(f"the fake workers cannot answer {cmd!r}")

    def _outcome(self, cmd: Any) -> dict:
        """What the command did on the workers, computed once (every rank agrees)."""
        if cmd.seq not in self._outcomes:
            self._outcomes[cmd.seq] = self._run(cmd)
        return self._outcomes[cmd.seq]

    def _kv(self, model_id: str) -> int:
        return KV_BYTES_PER_SEQ * len(self.sequences[model_id])

    def _run(self, cmd: Any) -> dict:
        if isinstance(cmd, msg.Load):
            self.resident.add(cmd.model_id)
            return {}
        if isinstance(cmd, msg.Offload):
            seqs = self.sequences[cmd.model_id]
            gen_states = {}
            for sid in cmd.recompute:
                s = seqs.pop(sid, None)
                if s is not None and s.spec.temperature > 0:
                    gen_states[sid] = b"gen-state-%d" % sid
            self.parked[cmd.model_id] = set(seqs)
            self.resident.discard(cmd.model_id)
            return {"parked_bytes": self._kv(cmd.model_id), "gen_states": gen_states}
        if isinstance(cmd, msg.Drop):
            for sid in cmd.sids:
                self.sequences[cmd.model_id].pop(sid, None)
                self.parked[cmd.model_id].discard(sid)
            return {"kv_bytes": self._kv(cmd.model_id)}
        if isinstance(cmd, msg.Step):
            return self._step(cmd)
        if isinstance(cmd, msg.RunBatch):
            return {"output": self.batch_fn(cmd.batch)}
        if isinstance(cmd, msg.RemoveModel):
            self.sequences.pop(cmd.model_id, None)
            self.parked.pop(cmd.model_id, None)
            self.resident.discard(cmd.model_id)
            self.removed.append(cmd.model_id)
        return {}

    def _step(self, cmd: msg.Step) -> dict:
        seqs = self.sequences[cmd.model_id]
        restored = KV_BYTES_PER_SEQ * len(self.parked[cmd.model_id] & set(seqs))
        self.parked[cmd.model_id].clear()
        for sid in cmd.drop:
            seqs.pop(sid, None)
        for spec in cmd.admit:
            assert spec.sid not in seqs, f"sequence {spec.sid} admitted twice"
            seqs[spec.sid] = _Seq(spec, position=len(spec.prompt))
        sids, tokens, ended = [], [], []
        for sid, s in list(seqs.items()):
            token = self.rule(sid, s.position)
            s.position += 1
            s.generated += 1
            sids.append(sid)
            tokens.append(token)
            if token in s.spec.eos or s.generated >= s.spec.max_tokens:
                ended.append(sid)
                del seqs[sid]
        return {"sids": tuple(sids), "tokens": tuple(tokens), "ended": tuple(ended), "running": len(seqs),
                "kv_bytes": self._kv(cmd.model_id), "restored": restored}


def build_engine(models: Sequence[Any] = ("a",), *, lms: Optional[Iterable[str]] = None, tp: int = 1, pp: int = 1,
                 eos: Any = EOS, vocab_size: int = 100, max_positions: Optional[int] = 64,
                 on_close: Optional[Callable[[bool], None]] = None, workers: Optional[FakeWorkers] = None,
                 **config) -> tuple:
    """``(engine, workers)``: an Engine over fake workers, not started (no watchdog thread).

    ``models``: model ids or ModelConfigs; ``lms``: the ones reported as causal LMs (token-level
    generation; default all); ``config``: EngineConfig fields (``max_loaded`` defaults to 1; ``step_ahead`` to
    False: these workers answer at once, so every step would go ahead, where the tests count steps)."""
    configs = [m if isinstance(m, ModelConfig) else ModelConfig(m, model_fn) for m in models]
    lms = {mc.model_id for mc in configs} if lms is None else set(lms)
    layout = Layout(tp=tp, pp=pp, master_rank=tp * pp, master_is_worker=False)
    workers = workers or FakeWorkers(layout.n_workers, layout.output_rank)
    batching = {m: msg.BatchingDefaults(pad_token_id=1, eos_token_id=eos, vocab_size=vocab_size,
                                        max_positions=max_positions) for m in lms}
    ready = [msg.WorkerReady(rank=r, pid=0, host="h", device="cpu",
                             host_bytes={mc.model_id: workers.nbytes for mc in configs}, batching=batching)
             for r in range(layout.n_workers)]
    config.setdefault("max_loaded", 1)
    config.setdefault("step_ahead", False)
    engine = Engine(EngineConfig(**config), configs, layout, workers.channel, ready, on_close=on_close)
    workers.engine = engine
    return engine, workers
