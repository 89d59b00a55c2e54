"""Process-wide cache of served models, shared by every estimator.

A fresh estimator per call (scikit-learn's ``clone``, cross-validation, grid search, one estimator
per request) would otherwise build the network again and, under a compiled or graph-capturing
preset, compile and capture again. Here served models (:class:`~.serving.ServedTabICL`) are kept
by (checkpoint identity: resolved path, size, modification time; device, serving options, bucket
grid), at most :data:`MAX_SERVED_MODELS`, the least recently used dropped first. A served model
keeps its compiled graphs and captured CUDA graphs, so estimators of one configuration pay for
them once per process; a dropped one releases them, frozen graphs included
(:meth:`~.serving.ServedTabICL._own`). The checkpoints themselves are read once per process by
:func:`~.checkpoint.read_checkpoint`.

One lock guards the cache (host threads may fit estimators concurrently); a served model is itself
safe to share between threads (:mod:`.serving`). :func:`clear_model_cache` empties it and the
checkpoints read. The cached models are for inference: a caller that changes a cached model's
weights changes them for every estimator that shares it (load a private copy with
:meth:`~.model.TabICLv2.from_checkpoint` instead).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict

import torch

from ..network.checkpoint import (
    MAX_CHECKPOINTS,
    checkpoint_identity,
    forget_read_checkpoints,
    read_checkpoints,
)
from ..network.model import TabICLv2
from .background import READY_PRESET, CompilingTabICL
from .options import packs_options, resolve_options
from .served import ServedTabICL

#: Served models kept, each with its weights on its device and its graphs.
MAX_SERVED_MODELS = 4

_lock = threading.Lock()
_served: OrderedDict = OrderedDict()


def served_model(path, device, options, grid=None, background: bool = False):
    """The :class:`~.serving.ServedTabICL` of checkpoint ``path`` on ``device`` with
    ``options`` (a :class:`~.options.ServingOptions`) and ``grid``, built once per process and
    shared; raises what loading raises (the cache is left as it was).

    ``background``: for options that compile, on CUDA, a
    :class:`~.background.CompilingTabICL` instead (one entry, two served models: the compiled
    one and the ready one that answers while it compiles), shared like the others so that its
    record of what has compiled outlives each estimator.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    background = background and options.compiled and device.type == "cuda"
    key = (
        checkpoint_identity(path),
        str(device),
        json.dumps(options.to_dict(), sort_keys=True),
        None if grid is None else json.dumps(dataclasses.asdict(grid), sort_keys=True),
        background,
    )
    with _lock:
        if key in _served:
            _served.move_to_end(key)
            return _served[key]

    def build(options):
        return ServedTabICL(TabICLv2.from_checkpoint(path, device=device), options, grid)

    if background:  # the compiled one is built by its first warm-up, in the background
        ready = resolve_options(READY_PRESET)
        served = CompilingTabICL(
            build(ready),
            build_target=lambda: build(options),
            options=options,
            build_packs=lambda: build(packs_options(ready)),
        )
    else:
        served = build(options)
    with _lock:
        # Another thread may have built the same one meanwhile: keep the first.
        if key in _served:
            return _served[key]
        _served[key] = served
        while len(_served) > MAX_SERVED_MODELS:
            _served.popitem(last=False)
    return served


def served_models() -> list:
    """The cached served models, least recently used first."""
    with _lock:
        return list(_served.values())


def clear_model_cache() -> None:
    """Forgets every cached served model and read checkpoint (their memory is freed once no
    estimator holds them)."""
    with _lock:
        _served.clear()
    forget_read_checkpoints()


def cache_info() -> dict:
    """How many checkpoints and served models are cached, and the limits."""
    with _lock:
        served = len(_served)
    return {
        "checkpoints": read_checkpoints(),
        "served_models": served,
        "max_checkpoints": MAX_CHECKPOINTS,
        "max_served_models": MAX_SERVED_MODELS,
    }
