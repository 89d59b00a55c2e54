"""tabicl 2.2.0's estimator arguments that tabserve's estimators take with the same meaning:
where the checkpoint comes from (``model_path``, ``allow_auto_download``,
``checkpoint_version``), the precision switches (``use_amp``, ``use_fa3``), memory
(``offload_mode``, ``disk_offload_dir``), CPU threads (``n_jobs``), ``verbose`` and
``inference_config``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

#: The Hugging Face Hub repository of the released checkpoints (tabicl's).
HF_REPO = "jingang/TabICL"
#: The released TabICLv2 checkpoints, by task: the versions this model reads (v1 checkpoints
#: are another architecture).
CHECKPOINT_VERSIONS = {
    "clf": ("tabicl-classifier-v2-20260212.ckpt",),
    "reg": ("tabicl-regressor-v2-20260212.ckpt",),
}
#: tabicl's ``offload_mode`` values that keep the column stage's output on the device, which is
#: what tabserve does; the offloading ones are refused.
ON_DEVICE_OFFLOAD_MODES = ("auto", "gpu", False)
OFFLOAD_MODES = (*ON_DEVICE_OFFLOAD_MODES, "cpu", True, "disk")
AUTO_FLAGS = (True, False, "auto")

logger = logging.getLogger("tabserve")


def check_reference_args(estimator, task: str) -> None:
    """Raises ValueError / TypeError naming the argument for a value tabicl would refuse, or one
    tabserve cannot serve (offloading, ``inference_config``)."""
    for name in ("use_amp", "use_fa3"):
        value = getattr(estimator, name)
        if not _one_of(value, AUTO_FLAGS):
            raise ValueError(f"{name} must be True, False or 'auto', got {value!r}")
    if estimator.checkpoint_version not in CHECKPOINT_VERSIONS[task]:
        raise ValueError(
            f"checkpoint_version {estimator.checkpoint_version!r} is not a TabICLv2 "
            f"{'classifier' if task == 'clf' else 'regressor'} checkpoint; tabserve serves "
            f"{', '.join(CHECKPOINT_VERSIONS[task])}"
        )
    offload = estimator.offload_mode
    if not _one_of(offload, OFFLOAD_MODES):
        raise ValueError(f"offload_mode must be one of {OFFLOAD_MODES}, got {offload!r}")
    if not _one_of(offload, ON_DEVICE_OFFLOAD_MODES):
        raise ValueError(
            f"offload_mode={offload!r}: tabserve keeps the column stage's output on the device "
            f"(offload_mode 'auto', 'gpu' or False); bound memory with batch_size instead"
        )
    if estimator.inference_config is not None:
        raise ValueError(
            "inference_config is tabicl's per-stage configuration; tabserve chooses how the "
            "model runs with recipe= (a preset name such as 'exact' or 'large', or a "
            "tabserve.ServingOptions)"
        )
    n_jobs = estimator.n_jobs
    if n_jobs is not None and (isinstance(n_jobs, bool) or not isinstance(n_jobs, int) or n_jobs == 0):
        raise ValueError(f"n_jobs must be None or a non-zero integer, got {n_jobs!r}")
    if not isinstance(estimator.verbose, (bool, int)):
        raise TypeError(f"verbose must be True or False, got {type(estimator.verbose).__name__}")


def _one_of(value, choices) -> bool:
    """``value`` is one of ``choices``: booleans by identity (1 is not True), strings by value."""
    return any(value is c if isinstance(c, bool) else (isinstance(value, str) and value == c) for c in choices)


def checkpoint_path(model_path, allow_auto_download: bool, version: str) -> Path:
    """The checkpoint to load, as tabicl finds it: ``model_path`` when it exists; a missing
    ``model_path`` is downloaded there; None: the released ``version`` from the Hugging Face Hub
    cache, downloaded into it first where ``allow_auto_download``.

    Raises:
        FileNotFoundError: nothing to load and downloading is not allowed (the message says how).
    """
    if model_path is not None and Path(model_path).exists():
        return Path(model_path)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    if model_path is not None:
        target = Path(model_path)
        if not allow_auto_download:
            raise FileNotFoundError(
                f"checkpoint not found: {target}; give the path of a TabICLv2 checkpoint, or set "
                f"allow_auto_download=True to download {version!r} from {HF_REPO} there"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        downloaded = hf_hub_download(repo_id=HF_REPO, filename=version, local_dir=target.parent)
        Path(downloaded).rename(target)
        return target
    try:
        return Path(hf_hub_download(repo_id=HF_REPO, filename=version, local_files_only=True))
    except LocalEntryNotFoundError:
        if not allow_auto_download:
            raise FileNotFoundError(
                f"checkpoint {version!r} is not in the Hugging Face Hub cache and "
                f"allow_auto_download=False; set it to True to download it from {HF_REPO}, or "
                "give model_path"
            ) from None
    logger.info("downloading %s from the Hugging Face Hub (%s)", version, HF_REPO)
    return Path(hf_hub_download(repo_id=HF_REPO, filename=version))


@contextlib.contextmanager
def torch_threads(n_jobs: int | None):
    """tabicl's ``n_jobs``: PyTorch's CPU threads for the call (None: as they are; negative:
    ``max(1, logical cores + 1 + n_jobs)``), restored afterwards."""
    if n_jobs is None:
        yield
        return
    cores = os.cpu_count() or 1
    threads = min(cores, n_jobs) if n_jobs > 0 else max(1, cores + 1 + n_jobs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def say(estimator, message: str, *args) -> None:
    """A ``verbose`` message: logged at INFO on the ``tabserve`` logger, which prints to stderr
    when nothing else handles it (as tabicl's ``verbose`` prints)."""
    if not estimator.verbose:
        return
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[tabserve] %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.info(message, *args)
