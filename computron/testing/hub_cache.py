"""A Hugging Face hub cache written without the network, in huggingface_hub's own layout, so that hub ids
(``computron/hub.py``) can be served from it offline (tests, the docs' example).

``write_repo(cache, "org/name", source)`` puts the files of the directory ``source`` into ``cache`` as
huggingface_hub would have downloaded them::

    models--org--name/blobs/<sha256 of the content>
    models--org--name/refs/main                      (the commit, no newline)
    models--org--name/snapshots/<commit>/<file>      -> ../../blobs/<sha256> (relative symbolic links)

``refs`` names the branches and tags that point at the commit; the commit is a hash of the files, or the one
given. ``huggingface_hub.scan_cache_dir`` reads such a cache without a warning.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from typing import Optional, Sequence

__all__ = ["repo_folder", "write_repo"]


def repo_folder(cache: str, repo_id: str) -> str:
    """Where ``repo_id`` (a model repository) lives in the cache ``cache``."""
    return os.path.join(cache, "models--" + repo_id.replace("/", "--"))


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_repo(cache: str, repo_id: str, source: str, refs: Sequence[str] = ("main",),
               commit: Optional[str] = None) -> str:
    """The snapshot directory of ``repo_id`` at ``commit`` (default: a hash of the files) in the cache
    ``cache``, holding every file under the directory ``source`` (blobs named by their sha256, snapshot
    entries linked to them, ``refs`` each naming the commit). Another commit of the same repository may be
    written beside it: blobs are shared, a ref is moved to the commit written last."""
    files = sorted(os.path.relpath(os.path.join(root, n), source)
                   for root, _dirs, names in os.walk(source) for n in names)
    if not files:
        raise ValueError(f"write_repo: {source!r} holds no files")
    hashes = {rel: _sha256(os.path.join(source, rel)) for rel in files}
    if commit is None:
        commit = hashlib.sha1("".join(f"{rel}\0{hashes[rel]}\0" for rel in files).encode()).hexdigest()
    folder = repo_folder(cache, repo_id)
    os.makedirs(os.path.join(folder, "blobs"), exist_ok=True)
    snapshot = os.path.join(folder, "snapshots", commit)
    for rel in files:
        blob = os.path.join(folder, "blobs", hashes[rel])
        if not os.path.exists(blob):
            shutil.copyfile(os.path.join(source, rel), blob)
        link = os.path.join(snapshot, rel)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    for ref in refs:
        ref_path = os.path.join(folder, "refs", ref)
        os.makedirs(os.path.dirname(ref_path), exist_ok=True)
        with open(ref_path, "w") as f:
            f.write(commit)
    return snapshot
