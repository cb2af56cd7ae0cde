"""Where a served model is: one vocabulary for the status page, ``/v1/models`` and Prometheus.

The engine reports each model's scheduler state (offloaded, loading, loaded, offloading) and, apart,
the tier its shards are on (disk, host, device). The server names the pair once, here:

    disk        offloaded, its shards on disk (read again on its next load)
    host        offloaded, its shards in host memory
    loading     being copied to the devices
    resident    on the devices, serving
    offloading  leaving the devices

The status page and ``computron_model_state{state}`` show these names; ``computron_model_resident``
is 1 for ``resident``. OpenAI's model object (``/v1/models``) carries ``openai_state``, the same
state in the three words its clients have always seen: resident, loading, or offloaded for the rest.
"""
from __future__ import annotations

import enum
from typing import Any, Optional

from ..sched.scheduler import ModelState as EngineState


class Residency(str, enum.Enum):
    DISK = "disk"
    HOST = "host"
    LOADING = "loading"
    RESIDENT = "resident"
    OFFLOADING = "offloading"

    @classmethod
    def of(cls, snapshot: Optional[Any]) -> "Residency":
        """The residency of a model from its ``ModelSnapshot`` (None, a model the engine does not report,
        counts as offloaded to host memory)."""
        state = getattr(snapshot, "state", None)
        if state == EngineState.LOADED.value:
            return cls.RESIDENT
        if state == EngineState.LOADING.value:
            return cls.LOADING
        if state == EngineState.OFFLOADING.value:
            return cls.OFFLOADING
        return cls.DISK if getattr(snapshot, "tier", None) == "disk" else cls.HOST

    @property
    def openai_state(self) -> str:
        """The ``state`` of OpenAI's model object: resident, loading or offloaded."""
        return self.value if self in (Residency.RESIDENT, Residency.LOADING) else "offloaded"
