"""What multiprocessing's fork server imports before it forks any worker (``worker_start.worker_context``).

Importing this module imports ``WORKER_IMPORTS``, about three quarters of a worker's start-up on a CPU, so
that every worker forked from the server starts with them done. Inside the fork server it also makes the
server leave at once when the master exits: it holds nothing to flush or close, and the interpreter's
teardown of torch and transformers takes about two seconds here, which would outlive a master that was
told to stop within a bound.
"""
from __future__ import annotations

import atexit
import importlib
import os

from .worker_start import in_fork_server

WORKER_IMPORTS = ("computron.runtime.launch", "computron.loading", "computron.models.causal_lm",
                  "torch.distributed.tensor", "transformers.models.opt.modeling_opt",
                  "transformers.models.llama.modeling_llama")


for _name in WORKER_IMPORTS:
    importlib.import_module(_name)

if in_fork_server():
    atexit.register(os._exit, 0)
