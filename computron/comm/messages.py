"""Typed messages between the master (Engine) and the workers.

Commands go from the master to every worker at once, in one total order that
all workers see; replies go from a worker back to the master. Every command
carries a ``seq`` so replies can be matched to it, and each has one reply type
(``Load`` -> ``Loaded``, ``Offload`` -> ``Offloaded``, ``Drop`` -> ``Dropped``,
``RunBatch`` -> ``BatchDone``, ``Step`` -> ``StepDone``, ``AddModel`` ->
``ModelAdded``, ``RemoveModel`` -> ``ModelRemoved``, ``AddAdapter`` and
``RemoveAdapter`` -> ``AdapterDone``, ``QueryStats`` -> ``Stats``, ``SetHostModels`` ->
``HostModelsSet``),
or ``CommandFailed`` from any of them. The worker dispatches on the command's type.
The replies that complete a model's command are ``CommandDone``s (command, rank,
start and end); ``StepDone`` and ``Offloaded`` also carry what the runner
returned (``StepResult``, ``ParkResult``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from .results import GENERATION_FIELDS, BatchingDefaults, GrammarBlob, ParkResult, StepResult  # noqa: F401


@dataclass(frozen=True)
class Load:
    seq: int
    model_id: str


@dataclass(frozen=True)
class Offload:
    """Release the model's weights from the device. Its running sequences (a preemption) are parked:
    their KV caches go to host memory, except those in ``recompute``, which are dropped (a later
    prefill of prompt + generated tokens rebuilds them)."""
    seq: int
    model_id: str
    recompute: Tuple[int, ...] = ()


@dataclass(frozen=True)
class Drop:
    """Forget these sequences of a model, parked or running, without running anything."""
    seq: int
    model_id: str
    sids: Tuple[int, ...]


@dataclass(frozen=True)
class RunBatch:
    seq: int
    model_id: str
    batch: Any


@dataclass(frozen=True)
class SeqSpec:
    """A sequence joining a model's running batch: everything the workers need to generate it."""
    sid: int
    prompt: Tuple[int, ...]
    max_tokens: int
    eos: Tuple[int, ...] = ()
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    gen_state: Optional[bytes] = None
    """A resumed sampled sequence's random generator state (instead of ``seed``)."""
    adapter: Optional[str] = None
    """The LoRA adapter this sequence runs with (None: the bare model)."""
    # ---- sampling controls (``models.sampling``; all off by default) ----
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Tuple[Tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Tuple[int, ...] = ()
    logprobs: Optional[int] = None
    """Return each generated token's raw logprob and this many top alternatives (0: the token's alone)."""
    prompt_logprobs: Optional[int] = None
    """Score the prompt's tokens in the prefill (with this many alternatives each)."""
    grammar: Optional["GrammarBlob"] = None
    """A compiled grammar the generated tokens must follow (xgrammar, serialized by the master)."""
    generated: int = 0
    """A resumed sequence: how many of ``prompt``'s last tokens were generated before it was paused (the
    penalties count them as generated, the grammar has accepted them, ``min_tokens`` counts them)."""
    chunk: int = 0
    """Chunked prefill (paged KV): prefill only the prompt's first ``chunk`` tokens in the joining step, the
    rest in later steps' ``Step.fill``; 0: the whole prompt now."""

    @property
    def has_controls(self) -> bool:
        """Anything beyond temperature/top-k/top-p sampling is asked of the sampling rank."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_p or self.min_tokens or self.grammar is not None)


@dataclass(frozen=True)
class Step:
    """One generation step of a model's running batch, executed by every rank.

    Every rank first drops ``drop`` (finished on the master's side: cancelled, timed
    out, a stop string), then runs the prefill of ``admit`` and one decode step of
    the sequences already running. The output rank answers with one token per
    sequence; every rank drops the sequences that ended (EOS, max_tokens) itself.
    ``prefill_apart``: run that as two forwards, a decode of the running sequences and
    a prefill of ``admit``, not one that pads the running rows to the longest prompt
    (``policies.prefill_apart``, the master's choice, so that every rank makes the same).
    """
    seq: int
    model_id: str
    admit: Tuple[SeqSpec, ...] = ()
    drop: Tuple[int, ...] = ()
    prefill_apart: bool = False
    fill: Tuple[Tuple[int, int], ...] = ()
    """Chunked prefill: ``(sid, tokens)`` of sequences part-way through their prompt that prefill their next
    ``tokens`` prompt tokens in this step (none of them is sampled until its prompt is complete)."""
    ahead: bool = False
    """Sent while the model's step before it was in flight (``EngineConfig.step_ahead``): where that one
    failed on any rank, every rank fails this one without running it (``p2p.any_rank``), since the ranks'
    batches may differ until the master's realigning drop, which comes behind it."""


@dataclass(frozen=True)
class AddModel:
    """Build this rank's shard of a model while serving. The build runs beside the command loop (other
    models keep stepping); the reply comes when the shard is ready, and no command names the model before
    every rank has answered. ``config`` is a ``ModelConfig.for_workers()``."""
    seq: int
    config: Any

    @property
    def model_id(self) -> str:
        return self.config.model_id


@dataclass(frozen=True)
class RemoveModel:
    """Forget a model: its weights leave the device if they are there, its host buffers and KV caches
    (running or parked) are freed. A rank that does not hold it (its build failed) answers all the same."""
    seq: int
    model_id: str


@dataclass(frozen=True)
class AddAdapter:
    """Read a LoRA adapter of a served model into host memory (``lora.weights``): this rank's layers
    and TP slices. It takes a device slot when a step first uses it."""
    seq: int
    model_id: str
    adapter_id: str
    info: Any
    """The master's ``lora.adapter.AdapterInfo``."""


@dataclass(frozen=True)
class RemoveAdapter:
    """Forget a LoRA adapter of a model: its device slot and host copy."""
    seq: int
    model_id: str
    adapter_id: str


@dataclass(frozen=True)
class SetHostModels:
    """The models this rank keeps in host memory by plan (``Engine.set_host_models``), replacing the previous
    set: the last to leave host memory for disk, and read from disk ahead of their next load, in this order,
    while ``host_budget`` has room (on a thread beside the command loop). The reply comes once the reads are
    done."""
    seq: int
    model_ids: Tuple[str, ...]


@dataclass(frozen=True)
class QueryStats:
    """Ask every worker for its device memory accounting (tests, benchmarks)."""
    seq: int


@dataclass(frozen=True)
class Shutdown:
    seq: int = -1


@dataclass(frozen=True)
class Keepalive:
    """Broadcast by the master while it has no command to send: workers that hear nothing at all (this,
    commands, their heartbeats taken) for ``EngineConfig.master_timeout_s`` know their master is gone."""
    seq: int = -1


# ---- what runners return: ``results`` (imported above, kept importable from here) ---------


# ---- worker -> master -------------------------------------------------------


@dataclass(frozen=True)
class WorkerReady:
    rank: int
    pid: int
    host: str
    device: str
    host_bytes: Dict[str, int] = field(default_factory=dict)  # model_id -> shard bytes
    device_memory: int = 0
    """Total memory of this rank's device (host RAM for CPU workers), for fractional device budgets."""
    host_resident: Optional[Tuple[str, ...]] = None
    """Models whose shard this rank keeps in host memory after start-up (None: all of them)."""
    batching: Dict[str, BatchingDefaults] = field(default_factory=dict)
    """model_id -> what a CausalLMBatchManager needs (pad/eos ids, vocabulary, positions), for causal LMs."""
    weight_formats: Dict[str, str] = field(default_factory=dict)
    """model_id -> how its weights are held: ``gguf:Q4_1``, ``int4-g32``, ``int8``, ``float32``..."""
    device_need: Dict[str, int] = field(default_factory=dict)
    """model_id -> device bytes a load takes where more than its shard (a quantized model's expansion)."""


@dataclass(frozen=True, kw_only=True)
class CommandDone:
    """What every reply that completes a model's command carries: the command, the rank, and when
    (``time.perf_counter`` of that rank) it ran."""
    seq: int
    rank: int
    model_id: str
    start: float
    end: float


@dataclass(frozen=True)
class WorkerStartFailed:
    rank: int
    error: str


@dataclass(frozen=True, kw_only=True)
class Loaded(CommandDone):
    nbytes: int
    device_bytes: int
    tier: str = "host"
    """Where this rank found the shard: "host" (host memory) or "disk" (read from its checkpoint first)."""
    read_s: float = 0.0
    """Seconds this load spent reading from disk (the read overlaps the copy; 0 from host)."""
    read_bytes: int = 0
    """Bytes this load read from disk (this rank's shard; 0 from host)."""
    host_resident: Optional[Tuple[str, ...]] = None
    """The models whose shard this rank holds in host memory after this load (None: not reported)."""
    model_device_bytes: int = 0
    """This model's bytes on the device after the load (its shard, and what quantized Linears made of it)."""


@dataclass(frozen=True, kw_only=True)
class ModelAdded(CommandDone):
    """The answer to ``AddModel``: this rank's shard is built (and read into host memory if its budget
    allowed)."""
    host_bytes: int
    """This rank's shard bytes (the device budget's unit)."""
    batching: Optional[BatchingDefaults] = None
    """A generative model's token ids (what ``WorkerReady.batching`` says of start-up models)."""
    host_resident: Tuple[str, ...] = ()
    """The models whose shard this rank holds in host memory now."""
    weight_format: str = ""
    """How its weights are held (``WorkerReady.weight_formats``)."""
    device_need: int = 0
    """Device bytes a load takes when more than ``host_bytes`` (``WorkerReady.device_need``), else 0."""


@dataclass(frozen=True, kw_only=True)
class AdapterDone(CommandDone):
    """The answer to ``AddAdapter`` and ``RemoveAdapter``: the adapters' bytes this rank holds now."""
    adapter_id: str
    host_bytes: int = 0
    device_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class HostModelsSet:
    """The answer to ``SetHostModels``, once this rank has read ahead what it had room for."""
    seq: int
    rank: int
    start: float
    end: float
    host_resident: Tuple[str, ...] = ()
    """The models whose shard this rank holds in host memory now."""
    read: Tuple[str, ...] = ()
    """Planned models read from disk ahead of their load."""
    no_room: Tuple[str, ...] = ()
    """Planned models left on disk: only models on the device, loading, or planned held the room they need."""
    failed: Dict[str, str] = field(default_factory=dict)
    """Planned models whose read failed -> why (they are read again on their next load)."""


@dataclass(frozen=True, kw_only=True)
class ModelRemoved(CommandDone):
    """The answer to ``RemoveModel``: what this rank holds after the model left."""
    device_bytes: int
    host_bytes: int
    host_resident: Tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Offloaded(ParkResult, CommandDone):
    """Sent by every rank: the weights left the device, and its running sequences were parked."""
    device_bytes: int


@dataclass(frozen=True, kw_only=True)
class Dropped(CommandDone):
    """The answer to ``Drop``, from every rank."""
    kv_bytes: int = 0
    """KV caches of the model left on this rank's device."""


@dataclass(frozen=True, kw_only=True)
class BatchDone(CommandDone):
    """Sent by every rank; only the output rank carries ``output``."""
    output: Any = None
    has_output: bool = False


@dataclass(frozen=True, kw_only=True)
class StepDone(StepResult, CommandDone):
    """Sent by every rank; only the output rank carries ``sids``, ``tokens`` and ``ended``."""
    kv_bytes: int = 0


@dataclass(frozen=True)
class Heartbeat:
    """Sent by a thread of every worker, independent of its command loop.

    ``busy_seq`` is the command the loop is executing (None when idle) and
    ``busy_s`` for how long, so the master can tell a hung command from a slow one.
    """
    rank: int
    sent: float
    busy_seq: Optional[int] = None
    busy_s: float = 0.0


@dataclass(frozen=True)
class CommandFailed:
    """A command raised on a worker; the worker keeps serving."""
    seq: int
    rank: int
    model_id: Optional[str]
    error: str
    """``"<exception type>: <message>"``, for people."""
    fatal: bool = False
    """The worker cannot go on (a data-plane timeout or a closed connection): the engine must die."""
    exc_type: str = ""
    """The exception's class name."""
    upstream: bool = False
    """Only a consequence: an earlier pipeline stage failed (``p2p.UpstreamFailed``), and that rank's
    own failure is the root cause."""


@dataclass(frozen=True)
class Bye:
    """A worker's last message after SHUTDOWN: the master stops listening for it."""
    rank: int


@dataclass(frozen=True)
class Stats:
    seq: int
    rank: int
    device_bytes: int
    device_reserved_bytes: int
    host_bytes: int
    resident: tuple
    kv_bytes: int = 0
    """KV caches on the device (all models)."""
    host_kv_bytes: int = 0
    """KV caches of paused sequences parked in host memory."""
    host_resident: tuple = ()
    """Models whose shard this rank holds in host memory (the others wait on disk: disk tier)."""
    host_kept: tuple = ()
    """The models this rank keeps in host memory by plan (``SetHostModels``)."""
    lora_fills: int = 0
    """LoRA adapters brought into a device slot so far (all models), and the seconds those copies took."""
    lora_fill_s: float = 0.0
