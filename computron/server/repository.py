"""A model repository: a directory whose subdirectories are models, servable by their names.

``computron serve --model-repository DIR`` (YAML ``server.model_repository``): every subdirectory of
DIR holding a ``config.json`` (a transformers checkpoint), or else exactly one ``.gguf`` file (converted on
its first load, once: ``storage/gguf.py``), is the model named as the directory. It is
not loaded at start-up: the first request for it adds it to the engine (``registry.py``), as Ollama
does, and Triton's repository API (``v2/repository.py``) lists, loads and unloads it.

``ModelRepository`` only reads the directory: ``scan`` lists the models, ``rescan`` does it off the
event loop and keeps the result (``known``). It is rescanned at start-up, by ``/v2/repository/index``
and by a load with no config, and every ``repository_poll_s`` seconds in poll mode (the registry's
poll task, which also unloads the models whose directory disappeared). A request for a name the last
scan did not see answers 404: requests never touch the disk.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Dict, Optional

from .config import _ID

log = logging.getLogger("computron.server")


def _one_gguf(directory: str) -> Optional[str]:
    """The ``.gguf`` file of ``directory`` when it holds exactly one, else None."""
    try:
        found = [f for f in os.listdir(directory) if f.lower().endswith(".gguf") and not f.startswith(".")]
    except OSError:
        return None
    return os.path.join(directory, found[0]) if len(found) == 1 else None


class ModelRepository:
    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.known: Dict[str, str] = {}
        """Model name -> checkpoint directory, as of the last scan."""

    def path_of(self, name: str) -> str:
        """Where model ``name`` is (or would be) in this repository."""
        return os.path.join(self.root, name)

    def holds(self, path: Optional[str]) -> bool:
        """Whether ``path`` is a model of this repository, a directory or the ``.gguf`` file in one (a served
        model came from it)."""
        if path is None:
            return False
        parent = os.path.dirname(os.path.abspath(path))
        return parent == self.root or (path.lower().endswith(".gguf") and os.path.dirname(parent) == self.root)

    def scan(self) -> Dict[str, str]:
        """The models in the directory now: subdirectories with a config.json, or else with exactly one
        ``.gguf`` file (then the model's path is that file), whose names are valid model ids (others are
        skipped, with a warning for a bad name). Blocking: file system calls."""
        try:
            names = sorted(os.listdir(self.root))
        except OSError as exc:
            log.warning("model repository %s cannot be read: %s", self.root, exc)
            return {}
        found = {}
        for name in names:
            path = self.path_of(name)
            if name.startswith(".") or not os.path.isdir(path):
                continue
            if not os.path.isfile(os.path.join(path, "config.json")):
                path = _one_gguf(path)
                if path is None:
                    continue
            if not _ID.match(name):
                log.warning("model repository %s: skipping %r: not a valid model name", self.root, name)
                continue
            found[name] = path
        return found

    async def rescan(self) -> Dict[str, str]:
        """``scan`` on a thread; the result becomes ``known`` (new and vanished directories are logged)."""
        found = await asyncio.get_running_loop().run_in_executor(None, self.scan)
        added, gone = sorted(set(found) - set(self.known)), sorted(set(self.known) - set(found))
        if added:
            log.info("model repository %s: servable now: %s", self.root, ", ".join(added))
        if gone:
            log.info("model repository %s: gone: %s", self.root, ", ".join(gone))
        self.known = found
        return found
