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
import shutil
from pathlib import Path

import psutil
import torch

from ..network.offload import DiskStore, host_store

#: The Hugging Face Hub repository of the released checkpoints (tabicl's).
HF_REPO = "jingang/TabICL"
#: The released TabICLv2 checkpoints, by task: the versions this model reads (v1 checkpoints
#: are another architecture).
CHECKPOINT_VERSIONS = {
    "clf": ("tabicl-classifier-v2-20260212.ckpt",),
    "reg": ("tabicl-regressor-v2-20260212.ckpt",),
}
#: tabicl's ``offload_mode`` values that keep the column stage's output on the device while it
#: fits (:func:`offload_target`); "cpu" / True keep it in host memory and "disk" in a file under
#: ``disk_offload_dir`` (:mod:`..network.offload`).
ON_DEVICE_OFFLOAD_MODES = ("auto", "gpu", False)
OFFLOAD_MODES = (*ON_DEVICE_OFFLOAD_MODES, "cpu", True, "disk")
#: tabicl's rule for where a call on a GPU keeps the column stage's output (:func:`offload_target`):
#: on the device while it takes at most this share of the device's free memory ("auto"; "gpu" /
#: False: all of it), in host memory while it takes at most :data:`HOST_SHARE` of the host's
#: available memory, on disk while it takes at most :data:`DISK_SHARE` of the free space past
#: :data:`DISK_RESERVE` bytes under ``disk_offload_dir``.
DEVICE_SHARE = {"auto": 0.5, "gpu": 1.0}
HOST_SHARE = 0.85
DISK_SHARE = 0.95
DISK_RESERVE = 1 << 30
AUTO_FLAGS = (True, False, "auto")

logger = logging.getLogger("tabserve")


def offload_store(estimator, output_bytes: int):
    """A context giving the store of one call whose column stage's output takes
    ``output_bytes`` (:mod:`..network.offload`), or None where it stays on the device."""
    offload, device, folder = estimator.offload_mode, estimator.device_, estimator.disk_offload_dir
    mode = _mode_name(offload)
    asked = "device" if mode in DEVICE_SHARE else mode
    target = asked  # on the CPU the device is the host: only a store asked for is used
    if device.type == "cuda":
        disk_free = None if folder is None else shutil.disk_usage(_existing(Path(folder))).free
        target = offload_target(
            mode, output_bytes, device_free_bytes(device), psutil.virtual_memory().available,
            disk_free,
        )  # fmt: skip
        if target != asked:
            logger.info(
                "offload_mode=%r: the column stage's output (%.1f GiB) is kept on %s",
                offload, output_bytes / 2**30, target,
            )  # fmt: skip
    if target == "cpu":
        return contextlib.nullcontext(host_store(device))
    if target == "disk":
        return DiskStore(folder)
    return contextlib.nullcontext(None)


def _mode_name(offload) -> str:
    """``"auto"``, ``"gpu"``, ``"cpu"`` or ``"disk"`` (False is "gpu", True is "cpu")."""
    return "gpu" if offload is False else "cpu" if offload is True else offload


def _existing(folder: Path) -> Path:
    """``folder``, or its nearest existing parent (the disk it will be made on)."""
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return folder


def offload_target(
    mode: str, output_bytes: int, device_free: int, host_free: int, disk_free: int | None
) -> str:
    """Where a call on a GPU keeps its column stage's output of ``output_bytes``: ``"device"``,
    ``"cpu"`` (host memory) or ``"disk"``, by tabicl's rule: the ``mode`` asked for where the
    output fits there (:data:`DEVICE_SHARE`, :data:`HOST_SHARE`, :data:`DISK_SHARE`), else the
    next of host memory and disk where it fits, else host memory (swap as the last resort).
    ``disk_free``: the free bytes under ``disk_offload_dir`` (None: no folder)."""
    if mode == "disk" and disk_free is None:
        raise ValueError("offload_mode='disk' needs disk_offload_dir, the folder of its files")
    fits = {
        "device": mode in DEVICE_SHARE and output_bytes <= DEVICE_SHARE[mode] * device_free,
        "cpu": mode != "disk" and output_bytes <= HOST_SHARE * host_free,
        "disk": disk_free is not None
        and output_bytes <= DISK_SHARE * max(0, disk_free - DISK_RESERVE),
    }
    return next((where for where in ("device", "cpu", "disk") if fits[where]), "cpu")


def device_free_bytes(device: torch.device) -> int:
    """Memory a new tensor can take on CUDA ``device``: the driver's free memory and the
    blocks PyTorch's allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_reference_args(estimator, task: str) -> None:
    """Raises ValueError / TypeError naming the argument for a value tabicl would refuse, or one
    tabserve cannot serve (offloading with a KV cache, ``inference_config``)."""
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
    if _one_of(offload, ("disk",)) and estimator.disk_offload_dir is None:
        raise ValueError("offload_mode='disk' needs disk_offload_dir, the folder of its files")
    if estimator.disk_offload_dir is not None and not isinstance(
        estimator.disk_offload_dir, (str, os.PathLike)
    ):
        raise TypeError(
            f"disk_offload_dir must be None or a path, got {type(estimator.disk_offload_dir).__name__}"
        )
    if not _one_of(offload, ON_DEVICE_OFFLOAD_MODES) and estimator.kv_cache:
        raise ValueError(
            f"offload_mode={offload!r} offloads one-shot predictions; with kv_cache the cache "
            "stays on the device: use one of them"
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
    """The checkpoint to load, as tabicl finds it: ``model_path`` when it is a file; a missing
    ``model_path`` is downloaded there (``version`` from :data:`HF_REPO`); None: the released
    ``version`` from the Hugging Face Hub cache, downloaded into it first where
    ``allow_auto_download``.

    Before downloading, one request without retries asks the Hub for the file, so an offline
    machine (or ``HF_HUB_OFFLINE=1``) gets its answer at once instead of after the Hub
    client's retries (about 24 s), and a failed download leaves no folder behind.

    Raises:
        IsADirectoryError: ``model_path`` is a directory (the message lists its checkpoints).
        FileNotFoundError: nothing to load, and downloading is not allowed or not possible; the
            message names the path, the arguments to change and the Hub's answer.
    """
    target = None if model_path is None else Path(model_path)
    if target is not None and target.is_dir():
        found = sorted(p.name for p in target.iterdir() if p.suffix in (".ckpt", ".safetensors"))
        inside = f"; it holds {', '.join(found)}" if found else ", which holds no .ckpt or .safetensors file"
        raise IsADirectoryError(
            f"model_path {str(target)!r} is a directory{inside}: give the checkpoint file's path"
        )
    if target is not None and target.is_file():
        return target
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = f"{version!r} from the Hugging Face Hub ({HF_REPO})"
    if target is not None:
        if not allow_auto_download:
            raise FileNotFoundError(
                f"checkpoint not found: {target}; give the path of a TabICLv2 checkpoint, or set "
                f"allow_auto_download=True to download {where} there"
            )
        _reach_hub(
            version,
            f"checkpoint not found: {target}, and {where} cannot be downloaded there",
            "check model_path, or give the path of a TabICLv2 checkpoint",
        )
        logger.warning("checkpoint not found at %s: downloading %s there", target, where)
        return _place(Path(hf_hub_download(repo_id=HF_REPO, filename=version)), target)
    try:
        return Path(hf_hub_download(repo_id=HF_REPO, filename=version, local_files_only=True))
    except LocalEntryNotFoundError:
        if not allow_auto_download:
            raise FileNotFoundError(
                f"checkpoint {version!r} is not in the Hugging Face Hub cache and "
                f"allow_auto_download=False; set it to True to download it from {HF_REPO}, or "
                "give model_path"
            ) from None
    _reach_hub(
        version,
        f"checkpoint {version!r} is not in the Hugging Face Hub cache and cannot be downloaded",
        "give model_path (a .ckpt or .safetensors file), or download it where the Hub can be "
        f"reached (hf download {HF_REPO} {version}) and copy the Hub cache here",
    )
    logger.info("downloading %s", where)
    return Path(hf_hub_download(repo_id=HF_REPO, filename=version))


def _reach_hub(version: str, failure: str, advice: str) -> None:
    """Asks the Hub for ``version`` once, without retries; raises FileNotFoundError
    (``failure``: the Hub's answer; ``advice``) when it cannot be had."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url

    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(f"{failure}: the Hub is offline (HF_HUB_OFFLINE=1); {advice}")
    try:
        get_hf_file_metadata(hf_hub_url(HF_REPO, version), timeout=10)
    except Exception as error:  # any failure means the same here: no file to download
        raise FileNotFoundError(
            f"{failure}: the Hub answered {type(error).__name__}: {error}; {advice}"
        ) from None


def _place(downloaded: Path, target: Path) -> Path:
    """``downloaded`` (in the Hub cache) at ``target``: a hard link where the file system allows
    one, else a copy, written under a temporary name and renamed, so ``target`` is whole or
    absent."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    partial.unlink(missing_ok=True)
    try:
        os.link(downloaded.resolve(), partial)
    except OSError:
        shutil.copyfile(downloaded, partial)
    os.replace(partial, target)
    return target


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
