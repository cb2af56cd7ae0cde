"""Errors a caller of the engine can see.

Two tiers: per-request errors (the engine keeps serving) derive from
``RequestError``; ``EngineDeadError`` means the engine cannot serve anything
any more. ``LaunchError`` is raised by ``LaunchEngine`` when a worker fails to
start.
"""
from typing import Optional


class ComputronError(Exception):
    """Base class of every error raised by computron."""


class RequestError(ComputronError):
    """One request failed; the engine keeps serving the others."""


class UnknownModelError(RequestError, KeyError):
    def __init__(self, model_id, known):
        self.model_id = model_id
        super().__init__(f"unknown model id {model_id!r}; served models: {sorted(known)}")

    def __str__(self):  # KeyError would quote the message
        return self.args[0]


class PayloadError(RequestError, ValueError):
    """The batch manager rejected a request's data.

    ``param`` names the request field at fault (``"max_tokens"``; None when no single field is), and
    ``reason`` is the message without the engine's ``model 'x': malformed request:`` prefix: an HTTP
    front answers with both. Batch managers raise it (it is a ValueError) for a bad field.
    """

    def __init__(self, message: str, param: Optional[str] = None, reason: Optional[str] = None,
                 row: Optional[int] = None):
        super().__init__(message)
        self.param = param
        self.reason = message if reason is None else reason
        self.row = row
        """Which row of a multi-row HTTP request (v2 infer, embeddings) it was, when one was."""

    def __reduce__(self):  # keep param, reason and row through pickling
        return type(self), (str(self), self.param, self.reason, self.row)


class QueueFullError(RequestError):
    """The request was refused before any work on it: its model's queue already holds ``queue_size``
    requests (``reason`` ``queue_full``), or its predicted time to first token is over the model's limit
    (``ttft_late``: ``EngineConfig.ttft_refusal_factor``). ``retry_after_s``: whole seconds, at least 1, until
    the requests ahead are expected to be answered (``sched/admission.py``)."""

    def __init__(self, message: str, reason: str = "queue_full", retry_after_s: int = 1):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # keep reason and retry_after_s through pickling (engine groups on Ray)
        return type(self), (str(self), self.reason, self.retry_after_s)


class RequestTimeoutError(RequestError, TimeoutError):
    """The request did not complete within the time the caller allowed."""


class WorkerError(RequestError):
    """A worker raised while running this request's batch; carries the worker's message."""


class EngineDeadError(ComputronError):
    """A worker died or the engine was shut down: no request can be served."""


def worker_exit_reason(rank: int, exitcode: Optional[int]) -> str:
    """A worker's death as the engine words it, whichever path notices first (the process's sentinel, or the
    connection it broke), so the reason a caller sees does not depend on that race."""
    return f"worker rank {rank} exited unexpectedly (exit code {exitcode})"


class ModelConflictError(ComputronError, ValueError):
    """A change to the served models that collides with another: adding an id that is served, or changing
    one whose add, replace or removal is still under way."""


class ModelChangeError(ComputronError):
    """Adding (or replacing) a model failed on the workers (its build raised on some rank, or it cannot
    fit the device budget); the engine keeps serving the other models. The message names the rank."""


class LaunchError(ComputronError):
    """A worker failed to start; the message holds its traceback."""


class HubError(ComputronError, ValueError):
    """A Hugging Face hub id (``org/name``, ``org/name@rev``, ``org/name:FILE.gguf``) that cannot be resolved to
    a local path: not in the cache with ``HF_HUB_OFFLINE`` set or the hub unreachable, no such repository,
    revision or file, a snapshot that is no checkpoint (``hub.py``). One line naming the id and the cache
    directory; the engine raises it as a ``PreflightError``, ``computron serve`` as a configuration error,
    before any worker starts."""


class GGUFError(ComputronError, ValueError):
    """A ``.gguf`` file that cannot be served (not GGUF, truncated, an architecture transformers cannot read,
    a quantization the gguf package cannot dequantize) or whose converted checkpoint cannot be written to
    the cache (``storage/gguf.py``). One line naming the file and the problem; the engine raises it as a
    ``PreflightError``, ``computron serve`` as a configuration error, before any worker starts."""

