"""A stage's backbone forward compiled for decode steps (``EngineConfig.compile_decode``).

A decode step (every row one new token: ``[B, 1]``, the dynamic cache's batch or the paged pool's) runs the
same small graph step after step, so its cost is mostly Python and kernel launches; ``torch.compile`` takes
most of that away. On CUDA the mode is "reduce-overhead": inductor's kernels replayed as CUDA graphs, one
per shape it meets, used where those shapes repeat: the paged pool's decode steps, whose gathers are padded to
power-of-two widths (``PagedKV.pow2_width``); with the dynamic cache (keys one wider every step) inductor's
kernels run without graphs. Prefills and ragged paged rows (shapes that change every step) stay eager.

Shapes: the batch size and the keys' width (the dynamic cache's length, the paged gather's width) change
from step to step, so the forward is compiled with ``dynamic=True`` (symbolic sizes, one graph for all of
them) instead of a graph per size.

Compilation is lazy (the first decode step after a load pays for it). If tracing or compiling fails (dynamo's
and inductor's exceptions), the runner falls back to eager for good, with ONE logged warning: a compiler
problem never fails a request. Dynamo applies a graph's side effects on the cache (its new keys) after the
graph ran, so a failure while compiling leaves the cache as it was and the eager retry sees the same state.
An error of the model itself (raised by the compiled code as eager code raises it) fails the step as before.

Limits: dynamo keeps ``torch._dynamo.config.cache_size_limit`` (8) compiled variants per code object, shared
by every model of one class in the process; past that it runs the forward eagerly (dynamo logs it).

Release: when the model leaves the device ``offload()`` drops the compiled forward on CUDA (and the CUDA
graphs' memory with it) and keeps it on a CPU; ``release()`` drops it for good (the model is removed).
Dynamo's code cache and CUDA-graph pools are process-wide (``torch.compiler.reset``), so they are reset when
the last compiled model of the process is released (``_Registry``).
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)

MODES = ("off", "auto", "on")

CPU_WINS = False
"""Whether 'auto' compiles on a CPU too: not while ``benchmarks/decode_step.py --compile on`` measures no
win there (docs/performance.md, "Compiled decode steps")."""


def wants_compile(setting: str, device_type: str) -> bool:
    """Whether ``EngineConfig.compile_decode=setting`` compiles on a device of this type."""
    if setting not in MODES:
        raise ValueError(f"compile_decode must be one of {MODES}, not {setting!r}")
    if setting == "auto":
        return device_type == "cuda" or (device_type == "cpu" and CPU_WINS)
    return setting == "on"


def compile_mode(device_type: str, graphs: bool = True) -> Optional[str]:
    """torch.compile's mode: CUDA graphs on CUDA where the step's shapes repeat (``graphs``), else inductor's
    default. A CUDA graph is recorded per distinct shape; the dynamic cache's keys grow every step (a new
    shape each time, a recording each step), the paged pool's decode gathers come in power-of-two widths."""
    return "reduce-overhead" if device_type == "cuda" and graphs else None


class _Registry:
    """Compiled forwards alive in this process: the process-wide caches go when the last one does."""

    def __init__(self):
        self.live = set()

    def add(self, key: int) -> None:
        self.live.add(key)

    def remove(self, key: int) -> bool:
        """Forget ``key``; True where nothing compiled is left (the caller resets the compiler)."""
        if key not in self.live:
            return False
        self.live.discard(key)
        return not self.live


REGISTRY = _Registry()


class DecodeCompiler:
    """Runs a backbone ``module``: compiled for decode steps where ``enabled``, eager otherwise."""

    def __init__(self, module: torch.nn.Module, setting: str, device: torch.device, graphs: bool = True,
                 eager_first: bool = False):
        self.module = module
        self.eager_first = eager_first
        """A residency's first decode step runs eagerly (it packs the CPU Linears, ``kernels.cpu.linear``, whose packs
        the compiled step then reads)."""
        self.graphs = graphs
        self.device_type = torch.device(device).type
        self.enabled = wants_compile(setting, self.device_type)
        self.failed = False
        """Compilation failed once: eager from then on (warned once)."""
        self.compiled: Optional[Callable] = None
        self.compiles = 0
        """How many times a compiled forward was made (once per residency that decoded on CUDA, once on a CPU)."""
        self.warmed = False
        """This residency ran its first decode step eagerly (``eager_first``)."""

    @property
    def active(self) -> bool:
        return self.compiled is not None

    def __call__(self, decode: bool, **kwargs):
        if not decode or not self.enabled or self.failed:
            return self.module(**kwargs)
        if self.eager_first and not self.warmed:
            self.warmed = True
            return self.module(**kwargs)
        if self.compiled is None:
            self.compiled = torch.compile(self.module, dynamic=True, mode=compile_mode(self.device_type, self.graphs))
            self.compiles += 1
            REGISTRY.add(id(self))
        from torch._dynamo.exc import TorchDynamoException
        try:
            return self.compiled(**kwargs)
        except TorchDynamoException as exc:  # tracing or compiling failed (the model's own errors pass)
            self.failed = True
            log.warning("compile_decode: compiling %s's decode step failed, running it eagerly from now on: "
                        "%s: %s", type(self.module).__name__, type(exc).__name__, exc)
            self.release()
            return self.module(**kwargs)

    def offload(self) -> bool:
        """The model left the device: on CUDA drop the compiled forward (its CUDA graphs hold memory of this
        residency); on a CPU keep it, for it holds code only and the next residency's weights are its inputs
        (a CPU compilation took about a minute here), and run that residency's first decode step eagerly again
        (``eager_first``). True where the compiled forward was dropped."""
        if self.device_type == "cpu":
            self.warmed = False
            return False
        return self.release()

    def release(self) -> bool:
        """Drop the compiled forward (the model left the device for good, or its CUDA graphs' memory must go);
        True where it held one."""
        held = self.compiled is not None
        self.compiled, self.warmed = None, False
        if REGISTRY.remove(id(self)):
            torch.compiler.reset()
        return held


__all__ = ["DecodeCompiler", "MODES", "compile_mode", "wants_compile"]
