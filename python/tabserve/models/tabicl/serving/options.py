"""Serving options: how a :class:`TabICLv2` runs (precision, kernels, compilation, buckets, graphs).

Users pick a **preset** by what they want (:func:`serving_presets`: ``exact``, ``medium``,
``small``, ``large``, ``large-fp8``), let ``recipe="auto"`` pick the one the benchmark driver
measured fastest for the table's shape on this GPU (:func:`auto_options`), or pass a
:class:`ServingOptions`, the expert object, whose fields are:

    precision: ``fp32`` (TF32 off for matmul and cuDNN), ``tf32``, ``bf16`` / ``fp16`` autocast.
    attention: ``{stage: backend}`` (stages ``col``, ``row``, ``icl``; backends ``math``,
        ``flash``, ``efficient``, ``cudnn``, applied with ``torch.nn.attention.sdpa_kernel``
        around each stage's SDPA calls, or tabserve's kernels ``head16``, ``head16-short``,
        ``head16-flash``, ``flash-half``, ``flash-fp8``: :mod:`..network.stage_kernels`).
    compile: ``none`` (eager), ``default`` / ``max-autotune-no-cudagraphs`` (whole model,
        ``torch.compile``; static per bucket with ``buckets``) or ``regional`` (every
        transformer block compiled on its own, one compiled code object reused by the blocks).
    buckets: pad every table onto the smallest bucket of a :class:`tabserve.buckets.BucketGrid`
        that holds it (padding changes no prediction), so compiled graphs are reused.
    cuda_graphs: capture one CUDA graph per bucket (needs ``buckets``, CUDA only), all sharing
        one memory pool; inputs are copied into the captured buffers before a replay.
    kv_graphs: without buckets, the KV-cached prediction replays a CUDA graph per (cache, test-row
        bucket) (CUDA only): the cache stays unpadded (no masks in the attention), only the test
        rows are padded onto the grid's test-row buckets (test rows never attend to each other,
        so padding them changes nothing), and the graph reads the cache in place.
    shape_graphs: without buckets, the one-shot call replays a CUDA graph per table shape (CUDA
        only), the test rows padded onto the grid's test-row buckets; the least recently used
        graphs are dropped past :data:`tabserve.models.tabicl.serving.served.MAX_SHAPE_GRAPHS`. Tables
        of more than ``max_classes`` classes run as without it (the class hierarchy is
        data-dependent).
    dynamic: ``torch.compile(dynamic=True)`` of the unpadded model (whole-model compile, no
        buckets): one graph for every table shape after the first call, no padding.
    fused_ffn: every block's feed-forward half (LayerNorm, linear, GELU, linear, residual) in
        one pass of :func:`tabserve.ops.feed_forward` where its kernel applies (CUDA, fp16 /
        bf16 autocast, width <= 128: the column and row stages); same roundings as autocast.
    fused_norm_linear: every block's first LayerNorm and its input projections in one pass of
        :func:`tabserve.ops.norm_linear` where its kernel applies (same conditions).
    rope_in_projection: with ``fused_norm_linear``, the row stage's RoPE of queries and keys in
        that same pass, so no attention kernel or pass of its own rotates them.
    fused_out_projection: with ``fused_ffn``, each block's attention out-projection inside the
        fused feed-forward, so the projected attention output is never written.
    fused_row_tokens: with ``fused_ffn``, the column stage's last feed-forward writes the row
        stage's tokens itself, CLS tokens first, so no pass transposes and concatenates them.
    icl_one_pass: the unpadded one-shot call's ICL stage takes train and test rows through each
        block in one pass (one attention call per block instead of two).
    freeze: Inductor's freezing for the compiled graphs: weights become constants of each graph,
        so what depends on weights alone (their casts under autocast) is computed once at compile
        time. Needs a compiled configuration with the ``inductor`` backend; the graphs keep the
        weights they were compiled with (load new weights into a fresh served model).
    compile_backend: the ``torch.compile`` backend (``inductor``; tests use ``aot_eager`` /
        ``eager`` to count recompiles without code generation).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import json
import math
import os
import threading
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from ..network.stage_kernels import (
    ATTENTION_BACKENDS,
    FLASH_BACKENDS,
    KERNEL_BACKENDS,
    SDPA_BACKENDS,
    STAGES,
    StageKernels,
)

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
COMPILE_MODES = ("none", "default", "max-autotune-no-cudagraphs", "regional")
WHOLE_MODEL_COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
#: What ``recipe=None`` serves.
DEFAULT_PRESET = "exact"
#: A promotions file that replaces every other (:func:`promotion_files`).
PROMOTIONS_ENV = "TABSERVE_PROMOTIONS"
#: tabserve's per-user cache directory (:func:`user_cache_dir`).
CACHE_DIR_ENV = "TABSERVE_CACHE_DIR"
#: What ``recipe="auto"`` serves on a GPU without measurements: fp16, CUDA graphs, no
#: compilation and none of tabserve's Triton kernels (the measured H200 presets' compiled and
#: fused kernels are tuned for compute capability 9.0).
UNMEASURED_GPU_PRESET = "medium"
PROMOTIONS_SCHEMA = "tabserve.promotions/1"


class _HeldFlag:
    """Holds one boolean compiler setting on while any served call that asked for it is inside
    (host threads may share a served model), and restores the caller's setting when the last
    one leaves. ``module``: the config module's import path; ``name``: the setting."""

    def __init__(self, module: str, name: str):
        self._module, self._name = module, name
        self._lock = threading.Lock()
        self._inside = 0
        self._saved = False

    @contextlib.contextmanager
    def __call__(self, enabled: bool = True):
        if not enabled:
            yield
            return
        config = importlib.import_module(self._module)
        with self._lock:
            if self._inside == 0:
                self._saved = getattr(config, self._name)
                setattr(config, self._name, True)
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if self._inside == 0:
                    setattr(config, self._name, self._saved)


#: ``with freezing(enabled):`` Inductor's freezing for what compiles inside (a no-op when not
#: ``enabled``). Dynamo reads ``torch._inductor.config.freezing`` (the global setting, not
#: ``torch.compile``'s options) while it traces, to lift the weights as constants, so the flag
#: must be on around the calls that may compile; replays of a captured CUDA graph do not trace
#: (serving turns it on around captures only). Freezing applies to graphs traced while
#: gradients are off (the model's entry points run under ``torch.no_grad``). The flag is set
#: directly (``config.patch`` costs 2-3x more per call) and stays on while any caller is inside.
freezing = _HeldFlag("torch._inductor.config", "freezing")

#: ``with specialized_floats(enabled):`` Dynamo's ``specialize_float`` for what traces inside:
#: the dynamic-shape recipes' calls. With ``dynamic=True`` Dynamo otherwise traces every float
#: attribute of the model's modules (each LayerNorm's eps) as a symbolic float, pins each to its
#: value when the graph is lowered, and then traces the whole network a third time: the
#: one-shot frame captured 1,150 operations against 502 static (tiny model, aot_eager, CPU),
#: 556 with this on, and Inductor's cold call on the full model took 143 s against 90 static
#: (CPU, 600 train rows). Shapes stay symbolic; a float argument that changes (the softmax
#: temperature) recompiles, as under static shapes.
specialized_floats = _HeldFlag("torch._dynamo.config", "specialize_float")


def autocast_dtype(precision: str):
    """The autocast dtype of a precision (None: no autocast)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


class _PrecisionFlags:
    """``with precision_flags(precision):`` TF32 on for ``tf32``, off (IEEE fp32) for every
    other precision, for matmuls and cuDNN.

    The flags are process-wide, and serving threads enter their contexts concurrently: each
    entry is kept in a list, the flags follow the latest entry still inside, and the first
    entry saves what the process had, which the last one out restores. (Each context saving
    and restoring the flags on its own would leave the process in another thread's mode, a
    state torch.export refuses as a mix of TF32 APIs.) Entries of one thread nest as a stack;
    threads inside in different modes get the latest one's mode."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside: list[tuple[object, str]] = []  # (entry, mode), oldest first
        self._saved: tuple[str, str] | None = None

    @staticmethod
    def _apply(matmul_mode: str, cudnn_mode: str) -> None:
        torch.backends.cuda.matmul.fp32_precision = matmul_mode
        torch.backends.cudnn.fp32_precision = cudnn_mode

    @contextlib.contextmanager
    def __call__(self, precision: str):
        mode = "tf32" if precision == "tf32" else "ieee"
        entry = object()
        with self._lock:
            if not self._inside:
                self._saved = (
                    torch.backends.cuda.matmul.fp32_precision,
                    torch.backends.cudnn.fp32_precision,
                )
            self._inside.append((entry, mode))
            self._apply(mode, mode)
        try:
            yield
        finally:
            with self._lock:
                self._inside = [(e, m) for e, m in self._inside if e is not entry]
                if self._inside:
                    latest = self._inside[-1][1]
                    self._apply(latest, latest)
                else:
                    self._apply(*self._saved)


precision_flags = _PrecisionFlags()


@contextlib.contextmanager
def precision_context(precision: str, device_type: str, cast_cache: bool = True):
    """:func:`precision_flags` plus autocast for ``bf16`` / ``fp16``."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(precision_flags(precision))
        dtype = autocast_dtype(precision)
        if dtype is not None:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cast_cache))
        yield


def sdpa_context(backend: str | None):
    """``sdpa_kernel`` restricted to one SDPA backend (:data:`SDPA_BACKENDS`); no restriction
    for tabserve's kernels (:data:`KERNEL_BACKENDS`: SDPA only runs where they do not apply)."""
    if backend is None or backend in KERNEL_BACKENDS:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[backend])])


@dataclass(frozen=True)
class ServingOptions:
    """One serving configuration (the fields: see the module docstring). Raises ValueError
    naming the field for a value out of range or a combination that cannot run."""

    precision: str = "fp32"
    attention: dict = field(default_factory=dict)
    compile: str = "none"
    dynamic: bool = False
    buckets: bool = False
    cuda_graphs: bool = False
    kv_graphs: bool = False
    shape_graphs: bool = False
    fused_ffn: bool = False
    fused_norm_linear: bool = False
    rope_in_projection: bool = False
    fused_out_projection: bool = False
    fused_row_tokens: bool = False
    icl_one_pass: bool = False
    freeze: bool = False
    compile_backend: str = "inductor"

    def __post_init__(self):
        def fail(message: str):
            raise ValueError(f"ServingOptions: {message}")

        if self.precision not in PRECISIONS:
            fail(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.compile not in COMPILE_MODES:
            fail(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        if not isinstance(self.attention, dict):
            fail(f"attention must be a dict {{stage: backend}}, got {type(self.attention).__name__}")
        for stage, backend in self.attention.items():
            if stage not in STAGES or backend not in ATTENTION_BACKENDS:
                fail(
                    f"attention {stage}={backend!r}: stages are {tuple(STAGES)}, backends "
                    f"{ATTENTION_BACKENDS}"
                )
        for name in ("dynamic", "buckets", "cuda_graphs", "kv_graphs", "shape_graphs",
                     "fused_ffn", "fused_norm_linear", "rope_in_projection",
                     "fused_out_projection", "fused_row_tokens", "icl_one_pass", "freeze"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                fail(f"{name} must be True or False, got {getattr(self, name)!r}")
        for fused in ("fused_ffn", "fused_norm_linear"):
            if getattr(self, fused) and autocast_dtype(self.precision) is None:
                fail(f"{fused} runs under bf16 / fp16 autocast only (precision bf16 or fp16)")
        if self.rope_in_projection and not self.fused_norm_linear:
            fail("rope_in_projection rotates inside the fused projection: it needs fused_norm_linear")
        for folded in ("fused_out_projection", "fused_row_tokens"):
            if getattr(self, folded) and not self.fused_ffn:
                fail(f"{folded} folds into the fused feed-forward: it needs fused_ffn")
        if self.freeze and (not self.compiled or self.compile_backend != "inductor"):
            fail("freeze is Inductor's freezing: it needs compile != 'none' and the inductor backend")
        if self.cuda_graphs and not self.buckets:
            fail("cuda_graphs need buckets (fixed shapes)")
        if self.kv_graphs and self.buckets:
            fail(
                "kv_graphs are the unpadded cache's graphs; with buckets, cuda_graphs replay the "
                "padded cache's graphs"
            )
        if self.shape_graphs and self.buckets:
            fail(
                "shape_graphs are the unpadded tables' graphs; with buckets, cuda_graphs replay "
                "the buckets' graphs"
            )
        if self.dynamic and (self.buckets or self.compile not in WHOLE_MODEL_COMPILE_MODES):
            fail(
                f"dynamic shapes are a whole-model compile of unpadded tables (compile in "
                f"{WHOLE_MODEL_COMPILE_MODES}, no buckets)"
            )

    @property
    def compiled(self) -> bool:
        return self.compile != "none"

    @property
    def graphs(self) -> bool:
        """Whether any call replays CUDA graphs."""
        return self.cuda_graphs or self.kv_graphs or self.shape_graphs

    @property
    def triton_kernels(self) -> bool:
        """Whether any call may run one of tabserve's Triton kernels (the fused operators, the
        flash attention)."""
        flash = any(backend in FLASH_BACKENDS for backend in self.attention.values())
        return self.fused_ffn or self.fused_norm_linear or flash

    @property
    def uses_fp8(self) -> bool:
        """Whether any stage computes in fp8 (the fp8 flash attention)."""
        return "flash-fp8" in self.attention.values()

    def replace(self, **changes) -> ServingOptions:
        """A copy with ``changes`` (validated)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"ServingOptions has no field {unknown[0]!r}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> ServingOptions:
        """The options of ``fields`` (as :meth:`to_dict` writes them); ValueError for unknown
        fields."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"ServingOptions has no field {unknown[0]!r}")
        return cls(**fields)

    def stage_kernels(self, stage: str) -> StageKernels:
        """The kernel choices of ``stage`` (``col``, ``row`` or ``icl``)."""
        shared = {f.name for f in dataclasses.fields(StageKernels)} - {"attention"}
        return StageKernels(
            attention=self.attention.get(stage), **{name: getattr(self, name) for name in shared}
        )

    def context(self, device: torch.device | str):
        """Precision flags and autocast every model call runs under. With CUDA graphs
        autocast's cast cache is off: cached weight casts live outside the graph's pool and die
        with the autocast context, so a replay would read freed memory. With ``freeze``,
        Inductor's freezing is on (:data:`freezing`), except with ``cuda_graphs``: serving turns
        it on around the captures, the only calls that trace. With ``dynamic``, Dynamo
        specialises floats (:data:`specialized_floats`)."""
        precision = precision_context(
            self.precision, torch.device(device).type, cast_cache=not self.graphs
        )
        freeze = self.freeze and not self.cuda_graphs
        if not (freeze or self.dynamic):
            return precision
        stack = contextlib.ExitStack()
        stack.enter_context(freezing(freeze))
        stack.enter_context(specialized_floats(self.dynamic))
        stack.enter_context(precision)
        return stack


@dataclass(frozen=True)
class Preset:
    """A named :class:`ServingOptions` with the one line that says when to use it."""

    name: str
    description: str
    options: ServingOptions


def _preset(name: str, description: str, **fields) -> tuple[str, Preset]:
    return name, Preset(name, description, ServingOptions(**fields))


_SMALL_HEADS = {"row": "head16", "col": "head16-short"}
#: tabserve's fused Triton operators and what folds into them (the compiled presets', packs').
_FUSED = {
    "fused_ffn": True,
    "fused_norm_linear": True,
    "fused_out_projection": True,
    "fused_row_tokens": True,
}
_LARGE = {
    "precision": "fp16",
    "compile": "default",
    "kv_graphs": True,
    "attention": _SMALL_HEADS,
    **_FUSED,
    "rope_in_projection": True,
    "freeze": True,
}

#: The serving presets, by what a user wants. Each is the configuration the benchmark driver
#: measured fastest (within its accuracy gate) on the H200 for its kind of table.
PRESETS: dict[str, Preset] = dict(
    [
        _preset(
            "exact",
            "fp32 eager, TF32 off: the reference's answers (within 1e-5); CPU and GPU",
        ),
        # tabserve's small-head attention needs no compile, so the ready preset has it: on an
        # H100 (full-size model, default recipe) it took a fresh process's first fit + predict
        # of a 200 + 50-row table (after the imports) from 2.00 to 1.43 s, and 60 varied small
        # tables packed from 2.43 to 1.83 s, the loop unchanged (2.41 against 2.27 s). Its fused
        # feed-forward and norm-linear kernels are Triton's, compiled at first use: 16.6 s for
        # that first fit + predict, 86 s for a first packed pass. Its blocks run the C++ kernels
        # built with the package instead where they apply (LayerNorm rounded to fp16 before
        # each matmul, the width-128 feed-forward halves): ``layers._eager_cuda_autocast``.
        _preset(
            "medium",
            "fp16 on padded buckets replayed from CUDA graphs, tabserve's small-head attention, "
            "nothing compiled: ~1,000-row tables and streams of tables of changing shapes",
            precision="fp16",
            buckets=True,
            cuda_graphs=True,
            attention=_SMALL_HEADS,
        ),
        _preset(
            "small",
            "fp16 compiled per bucket with frozen weights, replayed from CUDA graphs, "
            "tabserve's fused kernels: tables of a few hundred rows",
            precision="fp16",
            compile="default",
            buckets=True,
            cuda_graphs=True,
            attention=_SMALL_HEADS,
            **_FUSED,
            freeze=True,
        ),
        _preset(
            "large",
            "fp16 whole-model compile with frozen weights and every fused kernel, KV-cached "
            "prediction from CUDA graphs: thousands of train rows",
            **_LARGE,
        ),
        _preset(
            "large-fp8",
            "large with the in-context attention on fp8 operands (tabserve's flash kernel): "
            "tens of thousands of train rows, within the reduced-precision gate",
            **{
                **_LARGE,
                "attention": {"row": "head16", "col": "head16-flash", "icl": "flash-fp8"},
                "icl_one_pass": True,
            },
        ),
    ]
)


def packs_options(options: ServingOptions) -> ServingOptions:
    """``options`` (an uncompiled preset's: ``medium``) with tabserve's fused Triton kernels,
    for packed calls, which run uncompiled and uncaptured (no graphs, no buckets): on an H100
    the fused feed-forward and LayerNorm + projection kernels took the classification packs of
    60 varied small tables from 0.91 to 0.37 s, but compile at first use (86 s for a fresh
    process's first packed pass), so :class:`~.background.CompilingTabICL` moves packs to them
    only once a background warm-up has compiled them."""
    return dataclasses.replace(options, buckets=False, cuda_graphs=False, **_FUSED)


def serving_presets() -> dict[str, str]:
    """The serving presets: ``{name: one-line description}``, for ``recipe=<name>``."""
    return {name: preset.description for name, preset in PRESETS.items()}


def preset_name(options: ServingOptions) -> str | None:
    """The name of the preset whose options equal ``options``, or None."""
    for name, preset in PRESETS.items():
        if preset.options == options:
            return name
    return None


def describe(options: ServingOptions) -> str:
    """A short label of ``options``: its preset's name, else its fields that differ from the
    defaults."""
    name = preset_name(options)
    if name is not None:
        return name
    default = ServingOptions()
    changed = [
        f"{f.name}={getattr(options, f.name)!r}"
        for f in dataclasses.fields(options)
        if getattr(options, f.name) != getattr(default, f.name)
    ]
    return f"ServingOptions({', '.join(changed)})"


def _unknown_preset(name: object) -> ValueError:
    names = list(PRESETS)
    close = difflib.get_close_matches(str(name), [*names, "auto"], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ValueError(
        f"unknown serving preset {name!r}{hint}; presets: {', '.join(names)} (or 'auto', or a "
        f"ServingOptions)"
    )


def resolve_options(recipe: str | ServingOptions | None) -> ServingOptions:
    """The :class:`ServingOptions` of ``recipe``: a preset name, options as they are, or None
    (:data:`DEFAULT_PRESET`). ``"auto"`` is resolved by :func:`auto_options`, not here. Raises
    ValueError (with the closest preset name) for an unknown name, TypeError for another type."""
    if recipe is None:
        return PRESETS[DEFAULT_PRESET].options
    if isinstance(recipe, ServingOptions):
        return recipe
    if isinstance(recipe, str):
        if recipe in PRESETS:
            return PRESETS[recipe].options
        raise _unknown_preset(recipe)
    raise TypeError(
        f"recipe must be 'auto', a preset name ({', '.join(PRESETS)}), a ServingOptions or None, "
        f"got {type(recipe).__name__}"
    )


def device_key(device: torch.device | str) -> str:
    """The key the benchmark driver files a device under: the GPU name, or ``"cpu"``."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def user_cache_dir() -> Path:
    """tabserve's per-user cache directory: ``$TABSERVE_CACHE_DIR``, else the platform's
    (``platformdirs``; ``~/.cache/tabserve`` on Linux)."""
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("tabserve"))


def user_promotions_path() -> Path:
    """Where the benchmark driver files this machine's own promotions, which ``recipe="auto"``
    prefers to the shipped ones."""
    return user_cache_dir() / "promotions.json"


def promotions_path() -> Path:
    """The shipped promotions file (in the package: found after a wheel install)."""
    return Path(str(resources.files(__package__).joinpath("promotions.json")))


def promotion_files() -> list[Path]:
    """The promotions files ``recipe="auto"`` reads, first match wins: ``$TABSERVE_PROMOTIONS``
    alone when set, else this machine's own (:func:`user_promotions_path`) and the shipped
    ones."""
    override = os.environ.get(PROMOTIONS_ENV)
    if override:
        return [Path(override)]
    return [user_promotions_path(), promotions_path()]


def _device_entries(path: Path) -> dict:
    try:
        devices = json.loads(path.read_text())["devices"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return devices if isinstance(devices, dict) else {}


def _measured_entry(device: torch.device, paths: list[Path]) -> tuple[dict | None, str]:
    """The promotions entry for ``device`` (its GPU name, or ``cpu``) from the first file that
    has one, else, for an unmeasured GPU, the entry of a measured GPU of the same compute
    capability; with a sentence saying where it came from."""
    key = device_key(device)
    for path in paths:
        entry = _device_entries(path).get(key)
        if isinstance(entry, dict):
            return entry, f"{key!r} in {path}"
    if device.type != "cuda":
        return None, ""
    capability = list(torch.cuda.get_device_capability(device))
    for path in paths:
        for name, entry in _device_entries(path).items():
            if isinstance(entry, dict) and entry.get("capability") == capability:
                return entry, f"{name!r} (same compute capability {capability}) in {path}"
    return None, ""


def _warn_if_other_versions(entry: dict, where: str) -> None:
    import tabserve

    measured = {"torch": entry.get("torch"), "tabserve": entry.get("tabserve")}
    current = {"torch": torch.__version__, "tabserve": tabserve.__version__}
    changed = [
        f"{name} {measured[name]} (now {current[name]})"
        for name in measured
        if measured[name] not in (None, current[name])
    ]
    if changed:
        warnings.warn(
            f"recipe='auto': the promotions of {where} were measured with {', '.join(changed)}; "
            f"python -m tabserve.bench measures again",
            stacklevel=4,
        )


def _promoted_preset(entry: dict, route: str, allow_fp8: bool) -> str | None:
    """The preset an entry promotes on ``route`` (its fastest without fp8 where ``allow_fp8``
    is False and the fastest computes in fp8), None where it has none or names no preset."""
    for key in (route,) if allow_fp8 else (route, route + WITHOUT_FP8):
        promoted = entry.get(key)
        name = promoted.get("preset") if isinstance(promoted, dict) else None
        if name in PRESETS and (allow_fp8 or not PRESETS[name].options.uses_fp8):
            return name
    return None


#: Suffix of a route's entry naming its fastest preset without fp8 maths, written where the
#: route's fastest computes in fp8.
WITHOUT_FP8 = "_without_fp8"


def auto_options(
    device: torch.device | str,
    n_train: int,
    n_features: int,
    kv_cache: bool = False,
    path: Path | str | None = None,
    *,
    task: str | None = None,
    n_classes: int | None = None,
    many_classes_above: int = 10,
    allow_fp8: bool = True,
) -> str:
    """The name of the preset the benchmark driver promoted on this device for the closest
    measured workload.

    Route ``kv_predict`` with a KV cache, else ``one_shot``. ``allow_fp8=False``: never a preset
    that computes in fp8; where the promoted one does, the driver's fastest without fp8 on that
    workload (a workload without one is left out). Among the measured workloads, those of the
    same ``task`` ("clf" or "reg") are preferred, then, for classification, those on the same
    side of ``many_classes_above`` classes (past it the model runs its many-class hierarchy); a
    criterion that no measured workload meets is dropped rather than failing. Closest = smallest
    distance in log2 of train rows and features. The files: :func:`promotion_files` (or
    ``path``). A GPU none of them measured takes the promotions of a measured GPU of the same
    compute capability; with none of those either, it warns and returns
    :data:`UNMEASURED_GPU_PRESET` (never fp32 on a GPU); the CPU unmeasured warns and returns
    :data:`DEFAULT_PRESET`. Promotions measured under another torch or tabserve version warn.
    """
    if task not in (None, "clf", "reg"):
        raise ValueError(f"auto_options: task must be 'clf', 'reg' or None, got {task!r}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    entry, where = _measured_entry(device, [Path(path)] if path is not None else promotion_files())
    workloads = entry.get("workloads") if entry else None
    route = "kv_predict" if kv_cache else "one_shot"
    candidates = [
        (measured["shape"], name)
        for measured in (workloads.values() if isinstance(workloads, dict) else ())
        if isinstance(measured, dict)
        and isinstance(measured.get("shape"), dict)
        and (name := _promoted_preset(measured, route, allow_fp8))
    ]
    if not candidates:
        fallback = UNMEASURED_GPU_PRESET if device.type == "cuda" else DEFAULT_PRESET
        warnings.warn(
            f"recipe='auto': no {route} measurement for {device_key(device)!r}; serving "
            f"{fallback!r} (python -m tabserve.bench on this machine measures one)",
            stacklevel=3,
        )
        return fallback
    _warn_if_other_versions(entry, where)

    def prefer(pool: list, keep) -> list:
        kept = [c for c in pool if keep(c[0])]
        return kept or pool

    if task is not None:
        candidates = prefer(candidates, lambda shape: shape.get("task", "clf") == task)
    if n_classes is not None and task != "reg":
        many = n_classes > many_classes_above
        candidates = prefer(
            candidates,
            lambda shape: (
                shape.get("task", "clf") == "clf"
                and (shape.get("n_classes", 2) > many_classes_above) == many
            ),
        )

    def distance(shape: dict) -> float:
        return abs(math.log2(shape["n_train"] / max(n_train, 1))) + abs(
            math.log2(shape["n_features"] / max(n_features, 1))
        )

    return min(candidates, key=lambda c: distance(c[0]))[1]
