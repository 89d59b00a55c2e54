"""Checkpoint I/O: reference ``.ckpt`` files and tabserve's safetensors export.

* Reference files (``torch.save({"config": ..., "state_dict": ...})``, a ZIP container) are read
  with ``torch.load(weights_only=True)``: plain tensors and containers only, never arbitrary code.
* ``save_safetensors`` writes one ``.safetensors`` file whose header metadata carries the config as
  JSON (key ``tabserve.config``); no pickle at all.

Both are returned as ``(TabICLv2Config, state_dict)``; the format is detected from the file's
first bytes, not its name.
"""

from __future__ import annotations

import json
import os
import pickle
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from .config import ConfigError, TabICLv2Config

#: safetensors metadata key holding the JSON config.
CONFIG_METADATA_KEY = "tabserve.config"
#: safetensors metadata key naming the format.
FORMAT_METADATA_KEY = "tabserve.format"
FORMAT_NAME = "tabiclv2"

PathLike = str | os.PathLike
StateDict = dict[str, Tensor]


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read or does not hold a TabICLv2 model."""


def load_checkpoint(path: PathLike) -> tuple[TabICLv2Config, StateDict]:
    """Read a reference ``.ckpt`` or a tabserve ``.safetensors`` file.

    Returns the validated config and the raw state_dict (CPU tensors).

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: unreadable (corrupted, truncated, not a checkpoint) or missing entries.
        ConfigError: the config is missing keys, contradictory, or not TabICLv2.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic.startswith(b"PK"):
        return _load_reference(path)
    return _load_safetensors(path)


def _verify_zip(path: Path) -> None:
    """Check every ZIP entry's CRC32: ``torch.load`` does not, so flipped weight bytes would load."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise CheckpointError(
            f"cannot read checkpoint {path} (corrupted or truncated?): {e}"
        ) from e
    if bad is not None:
        raise CheckpointError(
            f"cannot read checkpoint {path} (corrupted or truncated?): CRC mismatch in {bad}"
        )


def _load_reference(path: Path) -> tuple[TabICLv2Config, StateDict]:
    # The CRC check runs beside torch.load (zlib releases the GIL over the entries' bytes): the
    # two took 89 and 99 ms one after the other of a fresh process's first fit on an H100 host.
    # A file that fails its CRC check raises that, whatever torch.load made of it.
    verdict: list = []

    def verify() -> None:
        try:
            _verify_zip(path)
        except CheckpointError as error:
            verdict.append(error)

    checking = threading.Thread(target=verify, name="tabserve-checkpoint-crc")
    checking.start()
    payload = failure = None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (
        RuntimeError,
        EOFError,
        OSError,
        zipfile.BadZipFile,
        pickle.UnpicklingError,
        ValueError,
    ) as e:
        failure = e
    finally:
        checking.join()
    if verdict:
        raise verdict[0]
    if failure is not None:
        raise CheckpointError(
            f"cannot read checkpoint {path} (corrupted or truncated?): {failure}"
        ) from failure
    if not isinstance(payload, Mapping) or "config" not in payload or "state_dict" not in payload:
        found = sorted(payload) if isinstance(payload, Mapping) else type(payload).__name__
        raise CheckpointError(
            f"{path} is not a TabICL checkpoint: expected 'config' and 'state_dict', found {found}"
        )
    return TabICLv2Config.from_reference_dict(payload["config"]), _tensors(
        payload["state_dict"], path
    )


def _load_safetensors(path: Path) -> tuple[TabICLv2Config, StateDict]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            state_dict = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(
            f"cannot read {path}: neither a reference .ckpt (ZIP) nor a readable safetensors file "
            f"(corrupted or truncated?): {e}"
        ) from e
    if metadata.get(FORMAT_METADATA_KEY) != FORMAT_NAME or CONFIG_METADATA_KEY not in metadata:
        raise CheckpointError(
            f"{path} is a safetensors file without a tabserve TabICLv2 config in its metadata"
        )
    try:
        config = json.loads(metadata[CONFIG_METADATA_KEY])
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: config metadata is not valid JSON: {e}") from e
    return TabICLv2Config.from_reference_dict(config), _tensors(state_dict, path)


def _tensors(state_dict: object, path: Path) -> StateDict:
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(
            f"{path}: 'state_dict' is a {type(state_dict).__name__}, not a mapping"
        )
    bad = [
        k for k, v in state_dict.items() if not isinstance(v, Tensor) or not v.is_floating_point()
    ]
    if bad:
        raise CheckpointError(
            f"{path}: state_dict entries {bad[:5]} are not floating-point tensors"
        )
    # A weight that is NaN or infinite makes its tensor's sum so; a sum of finite weights that
    # overflows (float64 weights near its range) is checked element by element. The sums read
    # the full checkpoint's 27.6 M weights in 9 ms, isfinite(...).all() in 36-67 ms (2-core CPU),
    # a share of every fresh process's first fit.
    suspect = [k for k, v in state_dict.items() if not v.sum(dtype=torch.float64).isfinite()]
    broken = [k for k in suspect if not torch.isfinite(state_dict[k]).all()]
    if broken:
        raise CheckpointError(
            f"{path}: state_dict entries {broken[:5]} contain NaN or infinite weights"
        )
    return dict(state_dict)


def save_safetensors(
    config: TabICLv2Config, state_dict: Mapping[str, Tensor], path: PathLike
) -> Path:
    """Write ``state_dict`` and ``config`` to one safetensors file; returns the path.

    The config is stored as JSON in the header metadata in the reference's key set, so it can be
    fed back to ``tabicl.TabICL(**config)`` as well.
    """
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    metadata = {
        FORMAT_METADATA_KEY: FORMAT_NAME,
        CONFIG_METADATA_KEY: json.dumps(config.to_reference_dict()),
    }
    save_file(tensors, str(path), metadata=metadata)
    return path


#: Checkpoints kept read by :func:`read_checkpoint` (CPU tensors; a full TabICLv2 checkpoint is
#: about 100 MB).
MAX_CHECKPOINTS = 2

_lock = threading.Lock()
_read: OrderedDict = OrderedDict()


def checkpoint_identity(path: PathLike) -> tuple:
    """``(resolved path, size, modification time in ns)`` of a checkpoint file: a file rewritten
    in place is another checkpoint.

    Raises:
        FileNotFoundError: no such file.
    """
    resolved = Path(path).resolve()
    if not resolved.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    stat = resolved.stat()
    return str(resolved), stat.st_size, stat.st_mtime_ns


def read_checkpoint(path: PathLike) -> tuple[TabICLv2Config, StateDict]:
    """:func:`load_checkpoint`, once per process and identity (:func:`checkpoint_identity`):
    the last :data:`MAX_CHECKPOINTS` files read are kept. A fresh estimator per call
    (scikit-learn's ``clone``, cross-validation, one estimator per request) would otherwise
    read and verify its checkpoint again. The state_dict's tensors are shared: copy before
    changing them. Safe to call from several threads."""
    key = checkpoint_identity(path)
    with _lock:
        if key in _read:
            _read.move_to_end(key)
            return _read[key]
    loaded = load_checkpoint(path)  # outside the lock: reading takes seconds
    with _lock:
        _read[key] = loaded
        _read.move_to_end(key)
        while len(_read) > MAX_CHECKPOINTS:
            _read.popitem(last=False)
    return loaded


def forget_read_checkpoints() -> int:
    """Empties :func:`read_checkpoint`'s cache; returns how many checkpoints it held."""
    with _lock:
        count = len(_read)
        _read.clear()
    return count


def read_checkpoints() -> int:
    """How many checkpoints :func:`read_checkpoint` holds."""
    with _lock:
        return len(_read)


__all__ = [
    "CheckpointError",
    "ConfigError",
    "checkpoint_identity",
    "load_checkpoint",
    "read_checkpoint",
    "save_safetensors",
]
