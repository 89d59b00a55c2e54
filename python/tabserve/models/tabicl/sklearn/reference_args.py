"""tabicl 2.2.0's estimator arguments that tabserve's estimators take with the same meaning:
where the checkpoint comes from (``model_path``, ``allow_auto_download``,
``checkpoint_version``), the precision switches (``use_amp``, ``use_fa3``), memory
(``offload_mode``, ``disk_offload_dir``), CPU threads (``n_jobs``), ``verbose`` and
``inference_config``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from pathlib import Path

import psutil
import torch

from ..network.offload import DiskStore, host_store
from .devices import resolve_devices

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


@dataclasses.dataclass(frozen=True)
class OffloadRule:
    """tabicl's rule for where a call on a GPU keeps the column stage's output
    (:func:`offload_target`), with its defaults: on the device while it takes at most
    ``device_share`` of the device's free memory ("auto"; "gpu" / False: all of it), in host
    memory while it takes at most ``host_share`` of the host's available memory, on disk while it
    takes at most ``disk_share`` of the free space past ``disk_reserve`` bytes under
    ``disk_offload_dir``. ``inference_config``'s column stage sets them (its
    ``auto_offload_threshold``, ``cpu_safety_factor``, ``disk_safety_factor``,
    ``disk_min_free_mb``)."""

    device_share: float = 0.5
    host_share: float = 0.85
    disk_share: float = 0.95
    disk_reserve: int = 1 << 30


AUTO_FLAGS = (True, False, "auto")

logger = logging.getLogger("tabserve")


def offload_store(estimator, output_bytes: int):
    """A context giving the store of one call whose column stage's output takes
    ``output_bytes`` (:mod:`..network.offload`), or None where it stays on the device."""
    settings, device = reference_settings(estimator), estimator.device_
    offload, folder = settings.offload_mode, settings.disk_offload_dir
    mode = _mode_name(offload)
    asked = "device" if mode in ("auto", "gpu") else mode
    target = asked  # on the CPU the device is the host: only a store asked for is used
    if device.type == "cuda":
        disk_free = None if folder is None else shutil.disk_usage(_existing(Path(folder))).free
        target = offload_target(
            mode, output_bytes, device_free_bytes(device), psutil.virtual_memory().available,
            disk_free, settings.offload_rule,
        )  # fmt: skip
        if target != asked:
            logger.info(
                "offload_mode=%r: the column stage's output (%.1f GiB) is kept on %s",
                offload, output_bytes / 2**30, target,
            )  # fmt: skip
    if target == "cpu":
        return contextlib.nullcontext(host_store)
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
    mode: str,
    output_bytes: int,
    device_free: int,
    host_free: int,
    disk_free: int | None,
    rule: OffloadRule = OffloadRule(),
) -> str:
    """Where a call on a GPU keeps its column stage's output of ``output_bytes``: ``"device"``,
    ``"cpu"`` (host memory) or ``"disk"``, by tabicl's ``rule``: the ``mode`` asked for where the
    output fits there, else the next of host memory and disk where it fits, else host memory
    (swap as the last resort). ``disk_free``: the free bytes under ``disk_offload_dir`` (None: no
    folder)."""
    if mode == "disk" and disk_free is None:
        raise ValueError("offload_mode='disk' needs disk_offload_dir, the folder of its files")
    device_share = {"auto": rule.device_share, "gpu": 1.0}
    fits = {
        "device": mode in device_share and output_bytes <= device_share[mode] * device_free,
        "cpu": mode != "disk" and output_bytes <= rule.host_share * host_free,
        "disk": disk_free is not None
        and output_bytes <= rule.disk_share * max(0, disk_free - rule.disk_reserve),
    }
    return next((where for where in ("device", "cpu", "disk") if fits[where]), "cpu")


def device_free_bytes(device: torch.device) -> int:
    """Memory a new tensor can take on CUDA ``device``: the driver's free memory and the
    blocks PyTorch's allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_reference_args(estimator, task: str) -> ReferenceSettings:
    """The estimator's :func:`reference_settings`, once its arguments are checked: raises
    ValueError / TypeError naming the argument for a value tabicl would refuse, or one tabserve
    cannot serve (offloading with a KV cache, a setting of ``inference_config`` that
    :func:`reference_settings` names)."""
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
    if estimator.disk_offload_dir is not None and not isinstance(
        estimator.disk_offload_dir, (str, os.PathLike)
    ):
        raise TypeError(
            f"disk_offload_dir must be None or a path, got {type(estimator.disk_offload_dir).__name__}"
        )
    n_jobs = estimator.n_jobs
    if n_jobs is not None and (isinstance(n_jobs, bool) or not isinstance(n_jobs, int) or n_jobs == 0):
        raise ValueError(f"n_jobs must be None or a non-zero integer, got {n_jobs!r}")
    if not isinstance(estimator.verbose, (bool, int)):
        raise TypeError(f"verbose must be True or False, got {type(estimator.verbose).__name__}")
    settings = reference_settings(estimator)
    offload, source = settings.offload_mode, settings.offload_source
    if _one_of(offload, ("disk",)) and settings.disk_offload_dir is None:
        raise ValueError(f"{source}='disk' needs disk_offload_dir, the folder of its files")
    if not _one_of(offload, ON_DEVICE_OFFLOAD_MODES) and estimator.kv_cache:
        raise ValueError(
            f"{source}={offload!r} offloads one-shot predictions; with kv_cache the cache "
            "stays on the device: use one of them"
        )
    devices = resolve_devices(estimator.device)
    for stage, device in settings.stage_devices:
        if device not in devices:
            raise ValueError(
                f"inference_config[{stage!r}] runs on {device}, but this estimator serves on "
                f"device={estimator.device!r}: tabserve runs every stage where the model is; "
                "leave the stages' device out or name the same one"
            )
    return settings


#: tabicl's ``inference_config``: settings per stage of the network (its ``MgrConfig``).
STAGES = ("COL_CONFIG", "ROW_CONFIG", "ICL_CONFIG")


def _fraction(value) -> bool:
    return 0.0 <= value <= 1.0


def _at_least(bound):
    return lambda value: value >= bound


#: Each stage setting tabicl takes: the types it accepts (TypeError otherwise), the check of
#: its value (ValueError), what it must be. Settings tabserve acts on: ``device``, ``use_amp``,
#: ``verbose``, the row stage's ``offload`` (kept on the device) and the column stage's
#: ``offload``, ``disk_offload_dir`` and the shares of :class:`OffloadRule`. The others tune
#: tabicl's batch-size search, pinned buffers, disk flushes and asynchronous copies, which
#: tabserve does its own way: checked, then unused.
STAGE_SETTINGS = {
    "device": ((type(None), str, torch.device), None, "None, a device name or a torch.device"),
    "use_amp": (bool, None, "True or False"),
    "use_fa3": (bool, None, "True or False"),
    "verbose": (bool, None, "True or False"),
    "min_batch_size": (int, _at_least(1), "an integer >= 1"),
    "safety_factor": (float, _fraction, "a float between 0 and 1"),
    "offload": ((bool, str), lambda v: isinstance(v, bool) or v in ("auto", "gpu", "cpu", "disk"),
                "True, False, 'auto', 'gpu', 'cpu' or 'disk'"),  # fmt: skip
    "auto_offload_threshold": (float, _fraction, "a float between 0 and 1"),
    "cpu_safety_factor": (float, _fraction, "a float between 0 and 1"),
    "max_pinned_memory_mb": ((int, float), _at_least(0), "a number >= 0"),
    "disk_offload_dir": ((type(None), str, os.PathLike), None, "None or a path"),
    "disk_min_free_mb": ((int, float), _at_least(0), "a number >= 0"),
    "disk_flush_mb": ((int, float), _at_least(0), "a number >= 0"),
    "disk_cleanup": (bool, None, "True or False"),
    "disk_file_prefix": (str, None, "a string"),
    "disk_dtype": ((type(None), torch.dtype), None, "None or a torch.dtype"),
    "disk_safety_factor": (float, _fraction, "a float between 0 and 1"),
    "use_async": (bool, None, "True or False"),
    "async_depth": (int, _at_least(1), "an integer >= 1"),
}


#: tabicl's value of each stage setting a stage leaves out; a stage its ``InferenceConfig`` is not
#: given holds all of them, but the row and in-context stages' ``offload`` is False there.
STAGE_DEFAULTS = {
    "device": None, "use_amp": True, "use_fa3": True, "verbose": False, "min_batch_size": 1,
    "safety_factor": 0.8, "offload": "auto", "auto_offload_threshold": OffloadRule.device_share,
    "cpu_safety_factor": OffloadRule.host_share, "max_pinned_memory_mb": 32768.0,
    "disk_offload_dir": None, "disk_min_free_mb": OffloadRule.disk_reserve / 2**20,
    "disk_flush_mb": 8192.0, "disk_cleanup": True, "disk_file_prefix": "", "disk_dtype": None,
    "disk_safety_factor": OffloadRule.disk_share, "use_async": True, "async_depth": 4,
}  # fmt: skip


@dataclasses.dataclass
class InferenceConfig:
    """tabicl's ``InferenceConfig``, for code that imports it with the estimators from tabserve:
    the settings of the network's three stages (``COL_CONFIG``: the column embedding,
    ``ROW_CONFIG``: the row interaction, ``ICL_CONFIG``: in-context learning), each a dict of
    :data:`STAGE_SETTINGS` checked when made, as tabicl checks them (KeyError for a name it does
    not know, TypeError for a type, ValueError for a value); a stage left None holds tabicl's
    defaults (:data:`STAGE_DEFAULTS`). Given as an estimator's ``inference_config`` it replaces
    the estimator's ``device``, ``use_amp``, ``use_fa3``, ``offload_mode``, ``disk_offload_dir``
    and ``verbose``, as tabicl's does (:func:`reference_settings`)."""

    COL_CONFIG: dict | None = None
    ROW_CONFIG: dict | None = None
    ICL_CONFIG: dict | None = None

    def __post_init__(self):
        for stage in STAGES:
            value = getattr(self, stage)
            if value is None:
                value = {**STAGE_DEFAULTS, "offload": "auto" if stage == "COL_CONFIG" else False}
            setattr(self, stage, _stage_settings(stage, value))

    def update_from_dict(self, config: dict) -> None:
        """Sets the settings ``{stage: {name: value}}`` gives, as tabicl's does; a bad one
        raises before any is set."""
        checked = {stage: _stage_settings(stage, value) for stage, value in _stages(config).items()}
        for stage, settings in checked.items():
            getattr(self, stage).update(settings)


def _stages(config: dict) -> dict:
    """``config``, each of whose keys must be a stage's name (KeyError)."""
    for stage in config:
        if stage not in STAGES:
            raise KeyError(f"inference_config: unknown key {stage!r}; it takes {', '.join(STAGES)}")
    return config


@dataclasses.dataclass(frozen=True)
class ReferenceSettings:
    """What tabicl's ``device``, ``use_amp``, ``offload_mode``, ``disk_offload_dir`` and
    ``verbose`` amount to once ``inference_config`` is applied (:func:`reference_settings`).

    ``use_amp``: False where any stage computes in fp32 (tabserve serves one precision for the
    whole network, and fp32 is within reduced precision's tolerance of a mixed one).
    ``offload_source``: the argument that set ``offload_mode``, for messages.
    ``stage_devices``: (stage, device) for each stage's device, None resolved as tabicl does."""

    use_amp: bool | str
    verbose: bool
    offload_mode: bool | str
    offload_source: str
    disk_offload_dir: str | os.PathLike | None
    offload_rule: OffloadRule
    stage_devices: tuple


def reference_settings(estimator) -> ReferenceSettings:
    """The estimator's reference arguments after ``inference_config``, by tabicl's rules: None
    (the default): the arguments alone; a dict keyed by ``"COL_CONFIG"``, ``"ROW_CONFIG"``,
    ``"ICL_CONFIG"``: each stage's settings over the arguments; an :class:`InferenceConfig`
    (tabserve's or tabicl's): its settings alone, the arguments ignored (tabicl's defaults where
    a stage leaves one out).

    Raises KeyError for a name tabicl does not know (as tabicl does), TypeError / ValueError for
    a value tabicl refuses, and ValueError for what tabserve does not do: the row stage's
    output offloaded (tabserve offloads the column stage's, by far the largest), or a
    ``disk_dtype`` (tabserve stores the column stage's output as it computes it). The in-context
    stage's output is the answers, a few values per test row: where it is kept changes nothing."""
    config = estimator.inference_config
    if config is None or isinstance(config, dict):
        config = _stages(config or {})
        given = {stage: _stage_settings(stage, config.get(stage, {})) for stage in STAGES}
        arguments = {
            "use_amp": estimator.use_amp, "verbose": bool(estimator.verbose),
            "device": estimator.device,
        }  # fmt: skip
        column = {"offload": estimator.offload_mode, "disk_offload_dir": estimator.disk_offload_dir}
        settings = {
            stage: {**arguments, **(column if stage == "COL_CONFIG" else {"offload": False}), **given[stage]}
            for stage in STAGES
        }
        from_arguments = "offload" not in given["COL_CONFIG"]
        explicit_devices = {stage: "device" in given[stage] for stage in STAGES}
    elif all(hasattr(config, stage) for stage in STAGES):
        settings = {
            stage: {**STAGE_DEFAULTS, **_stage_settings(stage, getattr(config, stage))}
            for stage in STAGES
        }
        from_arguments = False
        explicit_devices = dict.fromkeys(STAGES, True)
    else:
        raise TypeError(
            "inference_config must be None, a dict of stage settings or an InferenceConfig "
            f"(tabserve's or tabicl's), got {type(config).__name__}"
        )
    offload = settings["ROW_CONFIG"]["offload"]
    if not _one_of(offload, ON_DEVICE_OFFLOAD_MODES):
        raise ValueError(
            f"inference_config['ROW_CONFIG']['offload']={offload!r}: tabserve keeps the row "
            "stage's output on the device and offloads the column stage's (COL_CONFIG, or "
            "offload_mode)"
        )
    column = settings["COL_CONFIG"]
    if column.get("disk_dtype") is not None:
        raise ValueError(
            f"inference_config['COL_CONFIG']['disk_dtype']={column['disk_dtype']}: tabserve "
            "stores the column stage's output in the precision it computes in; leave it out"
        )
    column = {**STAGE_DEFAULTS, **column}
    rule = OffloadRule(
        device_share=column["auto_offload_threshold"],
        host_share=column["cpu_safety_factor"],
        disk_share=column["disk_safety_factor"],
        disk_reserve=int(column["disk_min_free_mb"] * 2**20),
    )
    amp = [settings[stage]["use_amp"] for stage in STAGES]
    return ReferenceSettings(
        use_amp=False if any(a is False for a in amp) else True if any(a is True for a in amp) else "auto",
        verbose=any(bool(settings[stage]["verbose"]) for stage in STAGES),
        offload_mode=column["offload"],
        offload_source="offload_mode" if from_arguments else "inference_config['COL_CONFIG']['offload']",
        disk_offload_dir=column.get("disk_offload_dir"),
        offload_rule=rule,
        stage_devices=tuple(
            (stage, resolve_devices(settings[stage]["device"])[0])
            for stage in STAGES
            if explicit_devices[stage]
        ),
    )


def _stage_settings(stage: str, value) -> dict:
    """One stage's settings (a dict, or tabicl's ``MgrConfig``), each checked as tabicl checks it."""
    if isinstance(value, dict):
        items = dict(value)
    elif hasattr(value, "keys") and hasattr(value, "__getitem__"):
        items = {key: value[key] for key in value.keys()}
    else:
        raise TypeError(
            f"inference_config[{stage!r}] must be a dict of settings, got {type(value).__name__}"
        )
    # tabicl checks the settings its estimator arguments fill first, then the others as given:
    # where several are wrong, the same one is named
    first = ("device", "use_amp", "use_fa3", "verbose")
    first += ("offload", "disk_offload_dir") if stage == "COL_CONFIG" else ()
    order = {key: first.index(key) if key in first else len(first) for key in items}
    for key, setting in sorted(items.items(), key=lambda item: order[item[0]]):
        if key not in STAGE_SETTINGS:
            raise KeyError(
                f"inference_config[{stage!r}]: unknown setting {key!r}; tabicl's are "
                f"{', '.join(sorted(STAGE_SETTINGS))}"
            )
        types, check, what = STAGE_SETTINGS[key]
        if not isinstance(setting, types):
            raise TypeError(
                f"inference_config[{stage!r}][{key!r}] must be {what}, got {type(setting).__name__}"
            )
        if check is not None and not check(setting):
            raise ValueError(f"inference_config[{stage!r}][{key!r}] must be {what}, got {setting!r}")
    return items


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
    if not reference_settings(estimator).verbose:
        return
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[tabserve] %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.info(message, *args)
