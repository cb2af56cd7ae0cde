"""LoRA adapters served on resident causal LMs, sequences of different adapters in one step.

- ``adapter`` (master and worker; no torch at import): ``check_adapter`` validates a PEFT LoRA directory
  against its base's config.json from the files alone, before anything reaches a worker, and returns the
  ``AdapterInfo`` the workers load from;
- ``weights`` (worker): ``load_rank_adapter`` reads this rank's layers and TP slices into host memory;
- ``slots`` (worker): ``LoraSlots`` keeps up to ``max_loras`` adapters of one runner in device slots and
  adds every row's adapter to the target Linear outputs with one gathered matmul pair per module.

Only ``adapter`` is imported here: the worker-side modules import torch.
"""
from .adapter import AdapterError, AdapterInfo, check_adapter

__all__ = ["AdapterError", "AdapterInfo", "check_adapter"]
