"""``EngineConfig``: the engine's settings, one docstring per field, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..sched.eviction import EVICTIONS
from ..sched.keep_alive import FOREVER, parse_keep_alive
from ..sched.policies import POLICIES
from .fields import _fail

_BACKENDS = ("gloo", "nccl")
_DEVICES = ("cpu", "cuda")


@dataclass
class EngineConfig:
    master_host: str = "127.0.0.1"
    """Address of the master rank's rendezvous (torch.distributed TCP store)."""
    master_port: int = 0
    """Port of the rendezvous; 0 picks a free port (single-node spawn mode only)."""
    max_loaded: Optional[int] = 1
    """How many models may be resident on the devices at once (>= 1)."""
    queue_size: int = 512
    """Per-model bound on waiting requests (being prepared included), 0: none; over it QueueFullError at once
    (429, ``Retry-After``). 512, Ollama's: at an answer a second the last waits under OpenAI clients' 600 s."""
    max_batch_size: int = 0
    """Batch size of the CausalLMBatchManager a causal LM gets when its ModelConfig names none; 0 means 8."""
    backend: Optional[str] = None
    """Data-plane backend: 'gloo' or 'nccl'; None picks nccl where CUDA exists, else gloo."""
    device: Optional[str] = None
    """'cpu' or 'cuda'; None picks cuda where CUDA exists, else cpu."""
    log_dir: Optional[str] = None
    """Where workers write their logs (worker_<rank>.log); None logs to stderr."""
    prefetch: bool = True
    """Queue the next model's load right behind the last batch of the model it replaces."""
    overlap: bool = True
    """Let a batch start on the first layers while later layers are still loading."""
    paper_mode: bool = False
    """Swap exactly as the paper did: per-tensor .to(), copy-back offload, no prefetch/overlap."""
    worker_threads: int = 0
    """torch intra-op threads per worker; 0 picks (cores - 1) // local workers, at least 1.

    On a small shared CPU more threads than free cores make OpenMP spin against
    the master and each other (seen here: 40x slower forwards with 2 threads on 2 cores).
    """
    pin_workers: str = "off"
    """'auto': each worker process spawned on this host runs on cores of its own (``worker_threads`` of them,
    counted from the last core, none another worker of this host holds), the first core left to the master,
    where the cores suffice for that (``runtime/affinity.py``); 'off': the OS places them, but for a CPU worker
    with helper threads (``cpu_helpers``)."""
    pack_cpu_linears: Any = "pinned"
    """Which models' Linears CPU workers run on weights packed once per residency (``kernels/cpu/linear.py``: in
    ``kernels/cpu/gemm.py``'s blocks on one intra-op thread, else for oneDNN), at the cost of the Linear
    weights' bytes once more while the model is resident. 'pinned' (the default): only models pinned when their
    shard is built (``ModelConfig.pinned``), which never leave the device, so no swap pays for a layout (packs
    are dropped at each offload and made again at the first forward after each load: see
    docs/performance.md); True: every model; False: none (``F.linear``, and the weight-first product for a
    few rows)."""
    cpu_decode_attention: bool = True
    """CPU workers run a paged decode step's attention straight from the KV pool (``kernels/cpu/attention.py``,
    one intra-op thread, float32, the families ``attention.DIRECT_FAMILIES`` names) where ``attention_backend``
    is 'auto': no gather, padding or mask; False keeps the model's own SDPA over the gathered keys."""
    attention_backend: str = "auto"
    """How a paged model's attention layers read the KV pool (``models/attention.py``), chosen once per model
    at load: 'paged' (FlexAttention through the block tables, the pool read in place, each query against its
    own sequence's keys only; the same code on CPU and CUDA; the families ``attention.SEAM_FAMILIES`` names),
    'gathered' (the model's own attention over each row's keys gathered out of the pool under a mask),
    'cpu_paged' (decode steps through the CPU C kernel: ``cpu_decode_attention``'s conditions) or 'auto'
    ('paged' on CUDA; on a CPU 'cpu_paged' where it fits, else 'gathered': docs/performance.md)."""
    cpu_helpers: bool = True
    """CPU workers computing on one intra-op thread, where a model runs on packed Linears (``pack_cpu_linears``), share
    those Linears' products with helper threads at idle priority, one per core beyond the workers'
    (``kernels/cpu/gemm.c``; ``runtime/affinity.py`` counts them): whatever else wants a core (the master, a
    client) runs first, an idle core takes chunks of the product. A worker with helpers is pinned as
    ``pin_workers='auto'`` pins, to a core no other worker of the host holds (``runtime/core_claims.py``), and
    its helpers keep off it. Results are the same bit for bit. False: one thread per worker, as vLLM's CPU
    worker."""
    start_method: str = "auto"
    """How spawn mode starts its workers: 'forkserver' (each a fork of multiprocessing's fork server, which
    imported torch and transformers once: later launches in this process skip those imports; spawn where
    the platform has no fork server), 'spawn' (each a fresh interpreter that imports everything itself) or
    'auto' (the fork server for CPU workers, spawn for CUDA ones: see ``worker_start.worker_context``)."""
    prepare_threads: int = 1
    """Threads that prepare requests whose batch manager tokenizes or decodes images (off the event loop
    and the engine's lock), at a lower CPU priority than the master's own threads, so that a burst of
    such requests cannot hold up steps or heartbeats."""
    step_mode: bool = True
    """Token-level generation for causal LMs: the master drives each model one step (one token per
    running sequence) at a time, requests join and leave the running batch between steps, answers
    stream, and models interleave between tokens. False runs each batch's whole generation as one
    command (request level, the paper's unit); paper_mode implies False."""
    max_step_tokens: int = 4096
    """Tokens one step runs at most, so a burst of long prompts cannot stall the running sequences for long.
    With the paged pool it counts the decoding sequences' tokens too, and a prompt over what is left is
    prefilled in chunks over the next steps (chunked prefill, ``engine/chunking.py``); with the dynamic cache
    it counts prompt tokens, and a single longer prompt is admitted alone."""
    step_ahead: bool = True
    """Token-level generation: a model's next decode step is formed and sent shortly before the one running
    is expected to end (``sched/step_ahead.py``), so that the workers start it at once instead of waiting for
    the master to read the last step's tokens, stream them and decide again (1.5-2 ms of a 45 ms step of 8
    on this project's 2-core CPU under HTTP load). A request arriving in that short while joins the step
    after it. Nothing goes ahead of a prefill, of a step shorter than twice the lead (the master would never
    pause), when ``max_tokens`` ends every running sequence with the step in flight, or while another model
    has work (its steps fill the gaps). False: the next step is formed
    once the last one is answered."""
    step_ahead_lead_ms: Optional[float] = None
    """How long before the running step's expected end the next one goes (``step_ahead``); None: twice
    the measured overhead of the last steps beyond the workers' own time, at least 2 ms. A lead as long as a
    step sends each one as soon as the one before it is sent."""
    kv_cache: str = "paged"
    """Where a causal LM keeps its running sequences' keys and values in token-level generation: 'paged'
    (``models/kv_pool.py``: fixed-size blocks of one preallocated pool per layer, a block table per sequence,
    each step one ragged row without padding; prefix caching and chunked prefill need it) or 'dynamic'
    (transformers' DynamicCache, one left-padded row per sequence, grown by a copy each step)."""
    kv_block_size: int = 16
    """Tokens per block of the paged KV pool (``kv_cache='paged'``)."""
    prefix_cache: bool = True
    """Paged pool only: the full blocks of every prompt stay cached under a hash of their tokens (and the
    adapter), and a later prompt that starts with the same tokens (a repeated system prompt, the copies of
    an ``n > 1`` request) uses them instead of computing them again; blocks no sequence holds are evicted,
    least recently used first, when the pool needs room. False prefills every prompt whole."""
    compile_decode: str = "auto"
    """A causal LM's decode steps (every row one new token) through ``torch.compile`` (``models/decode_compile``):
    'on' on any device (on a CPU inductor's C++ kernels around the packed Linears), 'auto' only on CUDA (CUDA
    graphs, mode "reduce-overhead"), 'off' eager. On this project's 2-core CPU a compiled paged decode step took
    0.89-0.90x the eager one's time, but compiling took 12-86 s on first use (once per process and
    architecture, again for the first batch of more than one), so 'auto' does not compile there
    (docs/performance.md).
    Prefills stay eager; a model compiles on its first decode step (on a CPU its second: the first packs the
    Linears), keeps the compiled code across swaps on a CPU and drops it when it leaves a CUDA device; a failed
    compilation logs one warning and runs eagerly."""
    metrics_history: int = 100_000
    """How many records ``Engine.metrics()`` keeps (the oldest go first; about 1 KB each); 0 keeps all.
    ``Engine.counters()`` keeps running totals that never expire."""
    heartbeat_timeout_s: float = 10.0
    """A worker whose heartbeats stop for this long (hung, stopped, its host gone) kills the engine."""
    heartbeat_late_limit_s: float = 300.0
    """A worker silent past heartbeat_timeout_s whose process this host sees running or waiting for a CPU (a
    busy machine starves it) is late, not dead: logged, counted (``late_heartbeats``) and given up to this
    long in all. A stopped, exited or sleeping one, or one on another host, is dead at heartbeat_timeout_s."""
    master_timeout_s: Optional[float] = None
    """A worker that hears nothing from its master for this long (None: twice heartbeat_timeout_s;
    start_timeout_s until the master first speaks) — no command, no keepalive (sent every heartbeat interval
    while the master has no command), none of its own heartbeats taken by the master, also while it executes a
    command — or whose connection to it breaks, leaves saying why: its master is gone (killed, its host down or
    cut off). An engine group on Ray leaves when the front's keepalive pings stop for as long."""
    command_timeout_s: float = 600.0
    """A command that runs longer than this on a rank (a forward stuck forever) kills the engine. A rank
    still silent heartbeat_timeout_s after another rank reported the same command failed does too."""
    shutdown_grace_s: float = 10.0
    """``shutdown()``/SIGTERM: how long the workers get to finish the command in hand and exit before
    they are terminated, then killed. In-flight requests fail at once with 'shutting down'."""
    policy: str = "quantum"
    """Which model's generation runs when more models have work than fit (token-level generation):
    'run_to_completion' (a resident model keeps its slot until its running sequences end: request-level
    switching), 'quantum' (a model's turn ends after ``quantum_ms`` of steps when another model waits for
    its slot; its sequences pause and resume later), 'deadline' (the model whose oldest waiting request is
    closest to missing ``ttft_slo_s`` goes first; a model that has waited ``4 * ttft_slo_s`` goes regardless)."""
    quantum_ms: float = 200.0
    """Turn length of the 'quantum' policy, in milliseconds of steps."""
    ttft_slo_s: float = 1.0
    """Time-to-first-token objective of the 'deadline' policy, in seconds (and of ``ttft_refusal_factor``)."""
    ttft_refusal_factor: Optional[float] = None
    """Refuse (429) a request predicted to get its first token later than this times ttft_slo_s; None: never."""
    kv_swap: str = "auto"
    """What happens to a paused sequence's KV cache when its model must leave the devices: 'offload'
    (copied to host memory, pinned on CUDA, and back on resume), 'recompute' (dropped; a prefill of
    prompt + generated tokens rebuilds it) or 'auto' (per sequence, whichever the estimate says is cheaper)."""
    device_budget: Optional[float] = None
    """Bytes of device memory per rank for model shards and KV caches (an int), or a fraction in (0, 1] of
    the device's memory; None: no byte budget (max_loaded alone bounds residency)."""
    eviction: str = "lru"
    """Which idle resident model leaves first when another must load: 'lru' (the least recently used) or
    'cost' (the one whose eviction is expected to cost least: its reload seconds, measured or estimated from
    its bytes, times its recent request rate; GreedyDual aging, see ``computron/sched/eviction.py``). Pinned models
    never leave and a lower ``ModelConfig.priority`` leaves first under either."""
    keep_alive: Any = FOREVER
    """Seconds or "5m"/"30s" an idle model stays resident; 0: offloaded once done; -1: while memory allows."""
    max_loras: int = 8
    """LoRA adapters a model keeps on the device at once (slots, least recently used leaves first): the
    most distinct adapters one step of that model runs."""
    max_lora_rank: int = 64
    """The largest LoRA rank an adapter may have (the device slots are sized for it)."""
    kv_reserve: float = 0.1
    """Part of a model's device footprint reserved for its KV cache, as a fraction of its shard bytes."""
    host_budget: Optional[int] = None
    """Bytes of host memory per rank for shards kept in host memory; models beyond it stay on disk and are
    read on demand (disk tier). None: every shard stays in host memory."""
    start_timeout_s: float = 300.0
    """How long LaunchEngine waits for every worker to build its models and report ready."""
    rendezvous_timeout_s: float = 120.0
    """How long a rank waits for the others to join the process group at start-up (the rendezvous at
    master_host:master_port, then gloo's connections between the ranks): every node must be started within
    this long of the first; a rank that cannot reach another fails naming the address it waited for."""
    death_timeout_s: float = 600.0
    """Timeout of the data plane's collectives (TP, PP) and of the rendezvous: how long a rank waits
    for a silent peer before it fails. The control plane itself waits indefinitely between requests."""

    def __post_init__(self):
        c = "EngineConfig"
        if not isinstance(self.master_host, str) or not self.master_host:
            _fail(c, "master_host", self.master_host, "must be a non-empty host name")
        if not isinstance(self.master_port, int) or not 0 <= self.master_port <= 65535:
            _fail(c, "master_port", self.master_port, "must be an int in 0..65535")
        if self.max_loaded is None:
            if self.device_budget is None:
                _fail(c, "max_loaded", None, "None (no count cap) needs a device_budget")
        elif not isinstance(self.max_loaded, int) or isinstance(self.max_loaded, bool) or self.max_loaded < 1:
            _fail(c, "max_loaded", self.max_loaded, "must be an int >= 1, or None with a device_budget")
        if not isinstance(self.queue_size, int) or self.queue_size < 0:
            _fail(c, "queue_size", self.queue_size, "must be an int >= 0 (0 = unbounded)")
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 0:
            _fail(c, "max_batch_size", self.max_batch_size, "must be an int >= 0")
        if self.backend is not None and self.backend not in _BACKENDS:
            _fail(c, "backend", self.backend, f"must be one of {_BACKENDS} or None")
        if self.device is not None and self.device not in _DEVICES:
            _fail(c, "device", self.device, f"must be one of {_DEVICES} or None")
        if not isinstance(self.prepare_threads, int) or isinstance(self.prepare_threads, bool) \
                or self.prepare_threads < 1:
            _fail(c, "prepare_threads", self.prepare_threads, "must be an int >= 1")
        if self.start_method not in ("auto", "forkserver", "spawn"):
            _fail(c, "start_method", self.start_method, "must be 'auto', 'forkserver' or 'spawn'")
        if not isinstance(self.worker_threads, int) or self.worker_threads < 0:
            _fail(c, "worker_threads", self.worker_threads, "must be an int >= 0 (0 = automatic)")
        if not isinstance(self.metrics_history, int) or self.metrics_history < 0:
            _fail(c, "metrics_history", self.metrics_history, "must be an int >= 0 (0 = keep all)")
        if self.pin_workers not in ("off", "auto"):
            _fail(c, "pin_workers", self.pin_workers, "must be 'off' or 'auto'")
        if not isinstance(self.cpu_decode_attention, bool):
            _fail(c, "cpu_decode_attention", self.cpu_decode_attention, "must be True or False")
        if self.attention_backend not in ("auto", "paged", "gathered", "cpu_paged"):
            _fail(c, "attention_backend", self.attention_backend, "must be 'auto', 'paged', 'gathered' or 'cpu_paged'")
        if not isinstance(self.cpu_helpers, bool):
            _fail(c, "cpu_helpers", self.cpu_helpers, "must be True or False")
        if not (isinstance(self.pack_cpu_linears, bool) or self.pack_cpu_linears == "pinned"):
            _fail(c, "pack_cpu_linears", self.pack_cpu_linears, "must be True, False or 'pinned'")
        if self.kv_cache not in ("dynamic", "paged"):
            _fail(c, "kv_cache", self.kv_cache, "must be 'dynamic' or 'paged'")
        if self.compile_decode not in ("off", "auto", "on"):
            _fail(c, "compile_decode", self.compile_decode, "must be 'off', 'auto' or 'on'")
        if not isinstance(self.kv_block_size, int) or isinstance(self.kv_block_size, bool) \
                or self.kv_block_size < 1:
            _fail(c, "kv_block_size", self.kv_block_size, "must be an int >= 1")
        if self.step_ahead_lead_ms is not None and (isinstance(self.step_ahead_lead_ms, bool) or not isinstance(
                self.step_ahead_lead_ms, (int, float)) or not self.step_ahead_lead_ms >= 0):
            _fail(c, "step_ahead_lead_ms", self.step_ahead_lead_ms, "must be None or a number >= 0")
        for name in ("step_mode", "step_ahead", "prefix_cache"):
            if not isinstance(getattr(self, name), bool):
                _fail(c, name, getattr(self, name), "must be True or False")
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(c, name, v, "must be an int >= 1")
        if not isinstance(self.max_step_tokens, int) or isinstance(self.max_step_tokens, bool) \
                or self.max_step_tokens < 1:
            _fail(c, "max_step_tokens", self.max_step_tokens, "must be an int >= 1")
        for name in ("start_timeout_s", "death_timeout_s", "heartbeat_timeout_s", "command_timeout_s",
                     "shutdown_grace_s", "heartbeat_late_limit_s", "master_timeout_s", "rendezvous_timeout_s"):
            v = getattr(self, name)
            if v is None and name == "master_timeout_s":
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf"):
                _fail(c, name, v, "must be a positive number of seconds")
        if self.policy not in POLICIES:
            _fail(c, "policy", self.policy, f"must be one of {POLICIES}")
        if self.eviction not in EVICTIONS:
            _fail(c, "eviction", self.eviction, f"must be one of {EVICTIONS}")
        self.keep_alive = parse_keep_alive(self.keep_alive, f"{c}.keep_alive")
        if self.kv_swap not in ("auto", "offload", "recompute"):
            _fail(c, "kv_swap", self.kv_swap, "must be 'auto', 'offload' or 'recompute'")
        for name in ("quantum_ms", "ttft_slo_s") + ("ttft_refusal_factor",) * (self.ttft_refusal_factor is not None):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf"):
                _fail(c, name, v, "must be a positive number")
        if not isinstance(self.kv_reserve, (int, float)) or not 0 <= self.kv_reserve < 10:
            _fail(c, "kv_reserve", self.kv_reserve, "must be a number in [0, 10)")
        d = self.device_budget
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or d <= 0
                              or (isinstance(d, float) and d > 1)):
            _fail(c, "device_budget", d, "must be a byte count (int > 0), a fraction in (0, 1], or None")
        h = self.host_budget
        if h is not None and (isinstance(h, bool) or not isinstance(h, int) or h <= 0):
            _fail(c, "host_budget", h, "must be a byte count (int > 0) or None")
        if self.backend == "nccl" and self.device == "cpu":
            _fail(c, "backend", self.backend, "nccl needs device='cuda'")

    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_master_timeout_s(self) -> float:
        return self.master_timeout_s if self.master_timeout_s is not None else 2 * self.heartbeat_timeout_s

    def resolved_backend(self) -> str:
        if self.backend is not None:
            return self.backend
        return "nccl" if self.resolved_device() == "cuda" else "gloo"
