"""Compile-cache artifacts: save what ``torch.compile`` built, load it into a restarted process.

A server that compiles its buckets (``torch.compile`` with Inductor) spends most of its start-up
in code generation and autotuning. :func:`save` writes the process's compile-cache artifacts
(``torch.compiler.save_cache_artifacts``: Inductor's FX-graph cache, AOTAutograd's cache, Triton
kernels and autotuning results) to one file with a header naming where they were made;
:func:`load`, called in a fresh process *before* its first compiled call, puts them back
(``torch.compiler.load_cache_artifacts``), so the compiles of the same functions on the same
shapes hit the cache instead of generating code. Dynamo still traces each function: what the
file saves is everything after tracing.

File layout: the line ``tabserve-compile-cache/1``, one line of JSON (:func:`environment` plus
the caller's ``tags``), then the artifact bytes as torch serialised them.

Security: the artifacts hold generated Python and pickled graphs that run when loaded. Load only
files your own deployment wrote (like a compile-cache directory), never files from elsewhere;
model checkpoints, by contrast, load without executing code (:mod:`tabserve.models.tabicl.network.checkpoint`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

MAGIC = b"tabserve-compile-cache/1\n"


class CompileCacheError(ValueError):
    """The file is not a tabserve compile cache, or was made for another environment."""


def environment() -> dict:
    """What the artifacts depend on: a file made under a different value is refused."""
    import tabserve

    cuda = torch.cuda.is_available()
    return {
        "tabserve": tabserve.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "capability": list(torch.cuda.get_device_capability()) if cuda else None,
    }


def save(path: str | os.PathLike, **tags) -> dict:
    """Writes this process's compile-cache artifacts to ``path`` (atomically: a temporary file
    renamed into place). ``tags`` (JSON values, e.g. the recipe and the bucket grid) are stored
    in the header and returned by :func:`load`.

    Returns the header plus ``bytes`` and ``artifacts`` (counts by kind).

    Raises:
        CompileCacheError: nothing was compiled in this process (no artifacts to save).
    """
    saved = torch.compiler.save_cache_artifacts()
    if saved is None or not saved[0]:
        raise CompileCacheError(
            "save: this process has no compile-cache artifacts (compile and run the functions "
            "first; artifacts are recorded only with Inductor's caches enabled)"
        )
    payload, info = saved
    header = {**environment(), "tags": tags, "artifacts": _counts(info)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as f:
        f.write(MAGIC)
        f.write(json.dumps(header, sort_keys=True).encode() + b"\n")
        f.write(payload)
    os.replace(temporary, path)
    return {**header, "bytes": len(payload)}


def load(path: str | os.PathLike, *, check_environment: bool = True) -> dict:
    """Loads the artifacts of ``path`` into this process's compile caches; call it before the
    first compiled call. Returns the file's header (with its ``tags``).

    Raises:
        FileNotFoundError: no such file.
        CompileCacheError: not a tabserve compile cache, a truncated one, or (with
            ``check_environment``) one made under another torch / tabserve / GPU.
    """
    data = Path(path).read_bytes()
    if not data.startswith(MAGIC):
        raise CompileCacheError(f"load: {path} is not a tabserve compile cache (bad magic line)")
    end = data.find(b"\n", len(MAGIC))
    try:
        header = json.loads(data[len(MAGIC) : end]) if end >= 0 else None
    except ValueError:
        header = None
    if not isinstance(header, dict) or not data[end + 1 :]:
        raise CompileCacheError(f"load: {path} is truncated or its header is not JSON")
    if check_environment:
        here = environment()
        different = {k: (header.get(k), v) for k, v in here.items() if header.get(k) != v}
        if different:
            detail = ", ".join(f"{k}: file {a!r}, here {b!r}" for k, (a, b) in different.items())
            raise CompileCacheError(f"load: {path} was made for another environment ({detail})")
    try:
        info = torch.compiler.load_cache_artifacts(data[end + 1 :])
    except Exception as error:  # noqa: BLE001  (torch's reader raises assorted types)
        raise CompileCacheError(f"load: {path}: torch could not read the artifacts: {error}") from error
    if info is None:  # torch logs the reason (a checksum, an unpickling error) and returns None
        raise CompileCacheError(f"load: {path}: torch could not read the artifacts (corrupted)")
    return header


def _counts(info) -> dict:
    """Artifact counts by kind from torch's CacheInfo (its fields vary between versions)."""
    kinds = getattr(info, "artifacts", None)
    if isinstance(kinds, dict):
        return {str(k): len(v) for k, v in kinds.items() if len(v)}
    return {}
