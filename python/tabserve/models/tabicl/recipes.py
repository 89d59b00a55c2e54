"""Serving recipes as data: how a :class:`TabICLv2` runs (precision, attention, compile, buckets).

A :class:`Recipe` is a named configuration; :data:`RECIPES` holds the named ones, the estimators
take ``recipe=<name | Recipe | "auto">`` and :mod:`.serving` turns a recipe into callables.
``recipe="auto"`` reads the promotions the benchmark driver (``python -m tabserve.bench``) wrote
to ``benchmarks/results/recipes.json`` for this device and picks the route measured on the
workload closest to the table; without a measurement it warns and serves :data:`DEFAULT_RECIPE`.

Fields:
    precision: ``fp32`` (TF32 off for matmul and cuDNN), ``tf32``, ``bf16`` / ``fp16`` autocast.
    attention: ``{stage: backend}`` (stages ``col``, ``row``, ``icl``; backends ``math``,
        ``flash``, ``efficient``, ``cudnn``, applied with ``torch.nn.attention.sdpa_kernel``
        around each stage's SDPA calls, or ``head16``: tabserve's head-dim-16 kernel,
        :func:`tabserve.ops.small_head_attention`, on CUDA in fp16 / bf16). Padded attention
        (:func:`tabserve.ops.prefix_attention`) takes the matching kernel from
        :data:`PREFIX_BACKENDS`.
    compile: ``none`` (eager), ``default`` / ``max-autotune-no-cudagraphs`` (whole model,
        ``torch.compile(fullgraph=True)``; static per bucket with ``buckets``) or ``regional``
        (every transformer block compiled on its own, one compiled code object reused by the
        blocks; Dynamo's recompile limit raised to what the blocks times buckets need).
    buckets: pad every table onto the smallest bucket of a :class:`tabserve.buckets.BucketGrid`
        that holds it (padding changes no prediction), so compiled graphs are reused.
    cuda_graphs: capture one CUDA graph per bucket (needs ``buckets``, CUDA only), all sharing
        one memory pool; inputs are copied into the captured buffers before a replay.
    kv_graphs: without buckets, the KV-cached prediction replays a CUDA graph per (cache, test-row
        bucket) (CUDA only): the cache stays unpadded (its real train rows and features: no
        masks in the attention), only the test rows are padded onto the grid's test-row buckets
        (test rows never attend to each other, so padding them changes nothing), and the graph
        reads the cache in place. The one-shot call runs as without it.
    shape_graphs: without buckets, the one-shot call replays a CUDA graph per table shape (CUDA
        only): tables, train rows and features as they are (no masks), the test rows padded
        onto the grid's test-row buckets (split past the largest), so tables of one shape reuse
        one graph whatever their test-row count within a bucket. The input checks still run on
        the host before each replay (one kernel, one transfer); a graph is captured at a shape's
        first call (compiled first under a compiled recipe), and the least recently used ones
        are dropped past :data:`tabserve.models.tabicl.serving.MAX_SHAPE_GRAPHS`. Tables of
        more than ``max_classes`` classes run as without it (the class hierarchy is
        data-dependent).
    dynamic: ``torch.compile(dynamic=True)`` of the unpadded model (whole-model compile, no
        buckets): one graph for every table shape after the first call, no padding; sizes 0 and
        1 still specialise (a one-row test block compiles once more).
    fused_ffn: every block's feed-forward half (LayerNorm, linear, GELU, linear, residual) in
        one pass of :func:`tabserve.ops.feed_forward` where its kernel applies (CUDA, fp16 /
        bf16 autocast, width <= 128: the column and row stages); same roundings as autocast.
    fused_norm_linear: every block's first LayerNorm and its input projections in one pass of
        :func:`tabserve.ops.norm_linear` where its kernel applies (same conditions).
    rope_in_projection: with ``fused_norm_linear``, the row stage's RoPE of queries and keys in
        that same pass (the operator's ``rotary``), so no attention kernel or pass of its own
        rotates them.
    fused_out_projection: with ``fused_ffn``, each block's attention out-projection inside the
        fused feed-forward operator's Triton kernel (its ``update_weight``), so the projected
        attention output is never written.
    fused_row_tokens: with ``fused_ffn``, the column stage's last feed-forward writes the row
        stage's tokens itself, CLS tokens first (the operator's ``row_prefix``), so no pass
        transposes the column stage's output and concatenates it with the CLS tokens.
    icl_one_pass: the unpadded one-shot call's ICL stage takes train and test rows through each
        block in one pass (every row a query, the train rows the keys) instead of the train
        rows first and the test rows against their cache: one attention call per block
        instead of two, no test-row launches of their own. The same maths in another grouping
        of rows (fp8 attention: one query scale over both).
    freeze: Inductor's freezing (``torch._inductor.config.freezing``) for the compiled graphs:
        the weights become constants of each graph, so what depends on weights alone (their
        casts to fp16 / bf16 under autocast, ...) is computed once at compile time instead of at
        every call. Needs a compiled recipe with the ``inductor`` backend; the graphs keep the
        weights they were compiled with (load new weights into a fresh served model).
    compile_backend: the ``torch.compile`` backend (``inductor``; tests use ``aot_eager`` to
        count recompiles without code generation).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
#: ``torch.nn.attention.SDPBackend`` members by the names recipes use.
ATTENTION_BACKENDS = {
    "math": "MATH",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
}
#: tabserve's own attention kernels by the names recipes use: ``head16`` is
#: :func:`tabserve.ops.small_head_attention` (CUDA, fp16 / bf16, head dimension 16: the column
#: and row stages, padded or not); ``head16-short`` the same kernel only where every key fits its
#: one staged chunk (<= 128 keys: the column stage's rows over the 128 induced tokens), the
#: longer key runs (the inducing points over the train rows) on PyTorch's default SDPA. Where
#: the kernel does not apply the stage runs PyTorch's default SDPA.
#: ``flash-half`` / ``flash-fp8`` are :func:`tabserve.ops.flash_attention` on half or fp8
#: operands (its Triton kernel on CUDA with fp16 / bf16, its composite elsewhere) for the
#: stage's unpadded calls; padded calls keep ``prefix_attention``. ``head16-flash`` is
#: ``head16-short`` with the longer unpadded key runs (the column stage's inducing points over
#: the train rows) on ``flash-half`` instead of SDPA.
FLASH_BACKENDS = {"flash-half": False, "flash-fp8": True, "head16-flash": False}
SMALL_HEAD_BACKENDS = ("head16", "head16-short", "head16-flash")
#: The small-head backends that take only key runs of one staged chunk (<= SHORT_KEYS).
SHORT_KEY_BACKENDS = ("head16-short", "head16-flash")
KERNEL_BACKENDS = ("head16", "head16-short", "head16-flash", "flash-half", "flash-fp8")
#: ``prefix_attention`` backend of padded attention for each backend: flash / efficient have
#: varlen kernels reading n on the device; cuDNN and math run SDPA with a key mask (``masked``),
#: under the stage's ``sdpa_kernel``.
PREFIX_BACKENDS = {
    "flash": "flash",
    "efficient": "efficient",
    "cudnn": "masked",
    "math": "masked",
    "head16": "auto",
    "head16-short": "auto",
    "head16-flash": "auto",
    "flash-half": "auto",
    "flash-fp8": "auto",
}
#: The model's stages, in the order data flows through them (``stage -> submodule``).
STAGES = {"col": "col_embedder", "row": "row_interactor", "icl": "icl_predictor"}
COMPILE_MODES = ("none", "default", "max-autotune-no-cudagraphs", "regional")
WHOLE_MODEL_COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")

#: Where the benchmark driver writes its promotions (``TABSERVE_RECIPES`` overrides).
RECIPES_PATH = Path(__file__).resolve().parents[4] / "benchmarks" / "results" / "recipes.json"


@dataclass(frozen=True)
class Recipe:
    """One serving configuration (see the module docstring for the fields)."""

    name: str
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
    description: str = ""

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"recipe {self.name}: precision must be one of {PRECISIONS}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"recipe {self.name}: compile must be one of {COMPILE_MODES}")
        for stage, backend in self.attention.items():
            if stage not in STAGES or backend not in (*ATTENTION_BACKENDS, *KERNEL_BACKENDS):
                raise ValueError(f"recipe {self.name}: bad attention choice {stage}={backend}")
        for fused in ("fused_ffn", "fused_norm_linear"):
            if getattr(self, fused) and autocast_dtype(self.precision) is None:
                raise ValueError(
                    f"recipe {self.name}: {fused} runs under bf16 / fp16 autocast only"
                )
        if self.rope_in_projection and not self.fused_norm_linear:
            raise ValueError(
                f"recipe {self.name}: rope_in_projection rotates inside the fused projection: "
                f"it needs fused_norm_linear"
            )
        for folded in ("fused_out_projection", "fused_row_tokens"):
            if getattr(self, folded) and not self.fused_ffn:
                raise ValueError(
                    f"recipe {self.name}: {folded} folds into the fused feed-forward: "
                    f"it needs fused_ffn"
                )
        if self.freeze and (not self.compiled or self.compile_backend != "inductor"):
            raise ValueError(
                f"recipe {self.name}: freeze is Inductor's freezing: it needs a compiled recipe "
                f"with the inductor backend"
            )
        if self.cuda_graphs and not self.buckets:
            raise ValueError(f"recipe {self.name}: CUDA graphs need buckets (fixed shapes)")
        if self.kv_graphs and self.buckets:
            raise ValueError(
                f"recipe {self.name}: kv_graphs are the unpadded cache's graphs; a bucketed "
                f"recipe with cuda_graphs replays its padded cache's graphs"
            )
        if self.shape_graphs and self.buckets:
            raise ValueError(
                f"recipe {self.name}: shape_graphs are the unpadded tables' graphs; a bucketed "
                f"recipe with cuda_graphs replays its buckets' graphs"
            )
        if self.dynamic and (self.buckets or self.compile not in WHOLE_MODEL_COMPILE_MODES):
            raise ValueError(
                f"recipe {self.name}: dynamic shapes are a whole-model compile of unpadded "
                f"tables (compile in {WHOLE_MODEL_COMPILE_MODES}, no buckets)"
            )

    @property
    def compiled(self) -> bool:
        return self.compile != "none"

    def replace(self, **changes) -> Recipe:
        return dataclasses.replace(self, **changes)

    @property
    def graphs(self) -> bool:
        """Whether any call of the recipe replays CUDA graphs."""
        return self.cuda_graphs or self.kv_graphs or self.shape_graphs

    def context(self, device: torch.device | str):
        """Precision flags and autocast every model call of this recipe runs under. With CUDA
        graphs autocast's cast cache is off: cached weight casts live outside the graph's pool
        and die with the autocast context, so a replay would read freed memory. With ``freeze``,
        Inductor's freezing is on (:func:`freezing`), except with CUDA graphs: serving turns it
        on around the captures, the only calls of those recipes that trace (``kv_graphs`` and
        ``shape_graphs`` recipes trace their other calls too: freezing stays on). With
        ``dynamic``, Dynamo specialises floats (:data:`specialized_floats`)."""
        precision = precision_context(
            self.precision, torch.device(device).type, cast_cache=not self.graphs
        )
        freeze = self.freeze and not self.cuda_graphs
        if not (freeze or self.dynamic):  # every call of most recipes: nothing more
            return precision
        stack = contextlib.ExitStack()
        stack.enter_context(freezing(freeze))
        stack.enter_context(specialized_floats(self.dynamic))
        stack.enter_context(precision)
        return stack


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
    and restoring the flags on its own left the process in the other threads' mode, a state
    torch.export then refused as a mix of TF32 APIs: test_padded_inference's two-thread test
    followed by the AOT bucket tests, 2026-12-01.) Entries of one thread nest as a stack;
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


def sdpa_context(backend: str):
    """``sdpa_kernel`` restricted to one backend of :data:`ATTENTION_BACKENDS`; no restriction
    for tabserve's kernels (:data:`KERNEL_BACKENDS`: SDPA only runs where they do not apply)."""
    if backend in KERNEL_BACKENDS:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, ATTENTION_BACKENDS[backend])])


def set_stage_kernels(module: torch.nn.Module, backend: str) -> None:
    """Points every attention layer of one stage module at ``backend``'s kernels: the padded
    attention kernel (:data:`PREFIX_BACKENDS`) and, for ``head16`` / ``head16-short`` /
    ``head16-flash``, tabserve's head-dim-16 operator (the last two: up to
    :data:`~.layers.SHORT_KEYS` keys), for ``flash-half`` / ``flash-fp8`` / ``head16-flash``
    its one-pass attention operator (``head16-flash``: the longer key runs)."""
    from .layers import SHORT_KEYS, Attention

    for attention in module.modules():
        if isinstance(attention, Attention):
            attention.prefix_backend = PREFIX_BACKENDS[backend]
            attention.small_heads = backend in SMALL_HEAD_BACKENDS
            attention.small_head_max_keys = SHORT_KEYS if backend in SHORT_KEY_BACKENDS else None
            attention.flash_fp8 = FLASH_BACKENDS.get(backend)


def _set_flag(module: torch.nn.Module, kind: type, flag: str, value: bool) -> None:
    for child in module.modules():
        if isinstance(child, kind):
            setattr(child, flag, value)


def set_fused_feed_forward(module: torch.nn.Module, fused: bool) -> None:
    """Points every transformer block of ``module`` at the fused feed-forward operator
    (``fused``) or at its modules."""
    from .layers import AttentionBlock

    _set_flag(module, AttentionBlock, "fused_feed_forward", fused)


def set_fused_norm_linear(module: torch.nn.Module, fused: bool) -> None:
    """Points every transformer block of ``module`` at the fused LayerNorm + projection
    operator (``fused``) or at its modules."""
    from .layers import AttentionBlock

    _set_flag(module, AttentionBlock, "fused_norm_linear", fused)


def set_fused_out_projection(module: torch.nn.Module, fused: bool) -> None:
    """Points every transformer block of ``module`` at its out-projection inside the fused
    feed-forward operator (``fused``) or at the module."""
    from .layers import AttentionBlock

    _set_flag(module, AttentionBlock, "fused_out_projection", fused)


def set_fused_row_tokens(module: torch.nn.Module, fused: bool) -> None:
    """Points the row stage of ``module`` at its tokens written by the column stage's last
    fused feed-forward (``fused``) or at prepending its CLS tokens itself."""
    from .interaction import RowInteraction

    _set_flag(module, RowInteraction, "tokens_from_column_stage", fused)


def set_fused_operators(module: torch.nn.Module, fields) -> None:
    """Points ``module`` at the fused operators that ``fields`` (a :class:`Recipe`, or a
    benchmark cell: the same field names) turns on, and at the modules for the rest."""
    set_fused_feed_forward(module, fields.fused_ffn)
    set_fused_norm_linear(module, fields.fused_norm_linear)
    set_rope_in_projection(module, fields.rope_in_projection)
    set_fused_out_projection(module, fields.fused_out_projection)
    set_fused_row_tokens(module, fields.fused_row_tokens)
    set_icl_one_pass(module, fields.icl_one_pass)


def set_icl_one_pass(module: torch.nn.Module, on: bool) -> None:
    """Points the ICL stage of ``module`` at one pass of train and test rows per block (``on``,
    unpadded one-shot calls) or at the train rows' cache first."""
    from .learning import InContextLearner

    _set_flag(module, InContextLearner, "one_pass", on)


def set_rope_in_projection(module: torch.nn.Module, on: bool) -> None:
    """Points every attention layer of ``module`` at RoPE inside the fused projection (``on``)
    or at RoPE of its own (a pass, or the head-dim-16 kernel)."""
    from .layers import Attention

    _set_flag(module, Attention, "rope_in_projection", on)


def _recipe(name: str, description: str, **fields) -> tuple[str, Recipe]:
    return name, Recipe(name, description=description, **fields)


#: Named recipes. Precision variants x {eager, bucketed compile, regional, CUDA graphs}.
RECIPES: dict[str, Recipe] = dict(
    [
        _recipe("fp32-eager", "eager, fp32 (TF32 off): the exact reference path"),
        _recipe("tf32-eager", "eager, TF32 matmul and cuDNN", precision="tf32"),
        _recipe("bf16-eager", "eager, bf16 autocast", precision="bf16"),
        _recipe("fp16-eager", "eager, fp16 autocast", precision="fp16"),
        _recipe(
            "fp16-efficient-row",
            "fp16, memory-efficient attention in the row stage (perf-anchors section 6)",
            precision="fp16",
            attention={"row": "efficient"},
        ),
        _recipe(
            "fp16-compile",
            "torch.compile of the whole unpadded model, fp16 (a graph per table shape)",
            precision="fp16",
            compile="default",
        ),
        _recipe(
            "fp16-compile-head16-row",
            "fp16-compile with tabserve's head-dim-16 kernel in the row stage (cell c32: the "
            "fastest on the large workload on the H200)",
            precision="fp16",
            compile="default",
            attention={"row": "head16"},
        ),
        _recipe(
            "fp16-compile-head16-row-ffn",
            "fp16-compile-head16-row with the fused feed-forward operator in the column and row "
            "stages (cell c34)",
            precision="fp16",
            compile="default",
            attention={"row": "head16"},
            fused_ffn=True,
        ),
        _recipe(
            "fp16-compile-head16-row-fused",
            "fp16-compile-head16-row-ffn with LayerNorm 1 and the input projections fused too "
            "(cell c36)",
            precision="fp16",
            compile="default",
            attention={"row": "head16"},
            fused_ffn=True,
            fused_norm_linear=True,
        ),
        _recipe(
            "fp16-compile-head16-row-fused-frozen",
            "fp16-compile-head16-row-fused with Inductor's freezing (cell c38: the fastest on the "
            "large workload on the H200)",
            precision="fp16",
            compile="default",
            attention={"row": "head16"},
            fused_ffn=True,
            fused_norm_linear=True,
            freeze=True,
        ),
        _recipe(
            "fp16-dynamic-flash",
            "torch.compile(dynamic=True) of the unpadded model, flash attention first, fp16",
            precision="fp16",
            compile="default",
            dynamic=True,
            attention={"col": "flash", "row": "flash", "icl": "flash"},
        ),
        _recipe("fp32-buckets", "eager on padded buckets, fp32", buckets=True),
        _recipe(
            "fp32-buckets-compile",
            "torch.compile(fullgraph) per bucket, fp32",
            buckets=True,
            compile="default",
        ),
        _recipe(
            "fp16-buckets-compile",
            "torch.compile(fullgraph) per bucket, fp16 autocast",
            precision="fp16",
            buckets=True,
            compile="default",
        ),
        _recipe(
            "fp16-buckets-max-autotune",
            "torch.compile max-autotune-no-cudagraphs per bucket, fp16",
            precision="fp16",
            buckets=True,
            compile="max-autotune-no-cudagraphs",
        ),
        _recipe(
            "fp32-buckets-regional",
            "regional (per-block) compile on buckets, fp32",
            buckets=True,
            compile="regional",
        ),
        _recipe(
            "fp16-buckets-regional",
            "regional (per-block) compile on buckets, fp16",
            precision="fp16",
            buckets=True,
            compile="regional",
        ),
        _recipe(
            "fp16-regional",
            "regional (per-block) compile, unpadded, fp16",
            precision="fp16",
            compile="regional",
        ),
        _recipe(
            "fp16-buckets-cudagraphs",
            "one CUDA graph per bucket (shared pool), eager kernels, fp16 (CUDA only)",
            precision="fp16",
            buckets=True,
            cuda_graphs=True,
        ),
        _recipe(
            "fp16-buckets-compile-cudagraphs",
            "torch.compile(fullgraph) per bucket, its kernels captured in one CUDA graph per "
            "bucket (shared pool), fp16 (CUDA only)",
            precision="fp16",
            buckets=True,
            compile="default",
            cuda_graphs=True,
        ),
        _recipe(
            "fp16-buckets-compile-cudagraphs-head16-row-ffn",
            "fp16-buckets-compile-cudagraphs with tabserve's head-dim-16 kernel in the row stage "
            "and the fused feed-forward operator (cell c35)",
            precision="fp16",
            buckets=True,
            compile="default",
            cuda_graphs=True,
            attention={"row": "head16"},
            fused_ffn=True,
        ),
        _recipe(
            "fp16-buckets-compile-cudagraphs-head16-row-fused",
            "fp16-buckets-compile-cudagraphs-head16-row-ffn with LayerNorm 1 and the input "
            "projections fused too (cell c37)",
            precision="fp16",
            buckets=True,
            compile="default",
            cuda_graphs=True,
            attention={"row": "head16"},
            fused_ffn=True,
            fused_norm_linear=True,
        ),
        _recipe(
            "fp16-buckets-compile-cudagraphs-head16-row-fused-frozen",
            "fp16-buckets-compile-cudagraphs-head16-row-fused with Inductor's freezing (cell c39)",
            precision="fp16",
            buckets=True,
            compile="default",
            cuda_graphs=True,
            attention={"row": "head16"},
            fused_ffn=True,
            fused_norm_linear=True,
            freeze=True,
        ),
        _recipe(
            "fp16-compile-head16-fused-frozen",
            "fp16-compile-head16-row-fused-frozen with the column stage's rows over the induced "
            "tokens on the head-dim-16 kernel too (head16-short; cell c40: the fastest on the "
            "large workload on the H200)",
            precision="fp16",
            compile="default",
            attention={"row": "head16", "col": "head16-short"},
            fused_ffn=True,
            fused_norm_linear=True,
            freeze=True,
        ),
        _recipe(
            "fp16-buckets-compile-cudagraphs-head16-fused-frozen",
            "fp16-buckets-compile-cudagraphs-head16-row-fused-frozen with the column stage's "
            "short key runs on the head-dim-16 kernel too (cell c41)",
            precision="fp16",
            buckets=True,
            compile="default",
            cuda_graphs=True,
            attention={"row": "head16", "col": "head16-short"},
            fused_ffn=True,
            fused_norm_linear=True,
            freeze=True,
        ),
        _recipe(
            "fp32-buckets-cudagraphs",
            "one CUDA graph per bucket (shared pool), fp32 (CUDA only)",
            buckets=True,
            cuda_graphs=True,
        ),
    ]
)
RECIPES["fp16-compile-head16-fused-frozen-kvgraphs"] = RECIPES[
    "fp16-compile-head16-fused-frozen"
].replace(
    name="fp16-compile-head16-fused-frozen-kvgraphs",
    description="fp16-compile-head16-fused-frozen whose KV-cached prediction replays a CUDA graph "
    "per cache and test-row bucket (cell c42; the cache unpadded: no masks)",
    kv_graphs=True,
)


def _variant(base: str, suffix: str, what: str, **fields) -> None:
    """Adds the recipe ``base + suffix``: ``RECIPES[base]`` with ``fields``, described as
    ``base`` ``what``."""
    name = base + suffix
    RECIPES[name] = RECIPES[base].replace(name=name, description=f"{base} {what}", **fields)


#: c40, c42 and c41 with the row stage's RoPE inside the fused projection (cells c43-c45);
#: c43 / c44 with the out-projections inside the fused feed-forward too (c46 / c47); c46 / c47
#: with the row stage's tokens written by the column stage's last feed-forward (c48 / c49);
#: c45 with both (c54: the bucketed CUDA-graph recipe with every fused kernel of c52).
for _base in (
    "fp16-compile-head16-fused-frozen",
    "fp16-compile-head16-fused-frozen-kvgraphs",
    "fp16-buckets-compile-cudagraphs-head16-fused-frozen",
):
    _variant(
        _base,
        "-ropeproj",
        "with the row stage's RoPE inside the fused LayerNorm + projection",
        rope_in_projection=True,
    )
for _base in (
    "fp16-compile-head16-fused-frozen",
    "fp16-compile-head16-fused-frozen-kvgraphs",
    "fp16-buckets-compile-cudagraphs-head16-fused-frozen",
):
    _variant(
        f"{_base}-ropeproj",
        "-outproj",
        "with each block's out-projection inside the fused feed-forward",
        fused_out_projection=True,
    )
    _variant(
        f"{_base}-ropeproj-outproj",
        "-rowtokens",
        "with the row stage's tokens written by the column stage's last fused feed-forward",
        fused_row_tokens=True,
    )
#: c49 whose one-shot call replays a CUDA graph per table shape too (cell c51).
_variant(
    "fp16-compile-head16-fused-frozen-kvgraphs-ropeproj-outproj-rowtokens",
    "-shapegraphs",
    "whose one-shot call replays a CUDA graph per table shape (test rows on the grid's buckets)",
    shape_graphs=True,
)
#: c41 with the out-projections and row tokens, its RoPE unfused (cell c55: the fastest on the
#: small workload, where RoPE inside the projection cost ~0.2 ms), and the same kernels on
#: c42 with a graph per table shape (cell c56).
_variant(
    "fp16-buckets-compile-cudagraphs-head16-fused-frozen",
    "-outproj-rowtokens",
    "with the out-projections inside the fused feed-forward and the row stage's tokens written "
    "by the column stage's last one",
    fused_out_projection=True,
    fused_row_tokens=True,
)
_variant(
    "fp16-compile-head16-fused-frozen-kvgraphs",
    "-outproj-rowtokens-shapegraphs",
    "with the out-projections inside the fused feed-forward, the row stage's tokens written by "
    "the column stage and the one-shot call replayed from a CUDA graph per table shape",
    fused_out_projection=True,
    fused_row_tokens=True,
    shape_graphs=True,
)
#: c49 with the ICL stage's unpadded attention on tabserve's flash kernel, fp8 operands (cell
#: c57), and with the column stage's inducing points over the train rows on it too, half
#: operands (cell c59: 1,564 ms on xlarge on the H200, 2.82x; its gate 5.5e-3 of probability
#: against fp32, where c49's fp16 is 1.5e-3).
_variant(
    "fp16-compile-head16-fused-frozen-kvgraphs-ropeproj-outproj-rowtokens",
    "-iclfp8",
    "with the ICL stage's attention on tabserve's flash kernel, fp8 operands",
    attention={"row": "head16", "col": "head16-short", "icl": "flash-fp8"},
)
_variant(
    "fp16-compile-head16-fused-frozen-kvgraphs-ropeproj-outproj-rowtokens-iclfp8",
    "-colflash",
    "with the column stage's inducing points on tabserve's flash kernel too (half operands)",
    attention={"row": "head16", "col": "head16-flash", "icl": "flash-fp8"},
)
#: c59 with the ICL stage's train and test rows in one pass per block (cell c61: the fastest on
#: xlarge on the H200, 1,488 ms, 3.00x in its run, gate 4.9e-3; twenty-sixth session).
_variant(
    "fp16-compile-head16-fused-frozen-kvgraphs-ropeproj-outproj-rowtokens-iclfp8-colflash",
    "-iclonepass",
    "with the ICL stage's train and test rows in one pass per block (unpadded one-shot calls)",
    icl_one_pass=True,
)
del _base
DEFAULT_RECIPE = "fp32-eager"


def get_recipe(recipe: str | Recipe | dict | None) -> Recipe:
    """A :class:`Recipe` from a name in :data:`RECIPES`, a Recipe, or a benchmark cell's recipe
    dict (``Cell.recipe()``). ``None`` gives :data:`DEFAULT_RECIPE`. ``"auto"`` and
    ``"auto-without-fp8"`` are resolved by :func:`auto_recipe`, not here. Raises ValueError for
    unknown names or fields."""
    if recipe is None:
        return RECIPES[DEFAULT_RECIPE]
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, dict):
        return recipe_from_cell(recipe)
    if recipe in RECIPES:
        return RECIPES[recipe]
    raise ValueError(
        f"unknown recipe {recipe!r}; known: auto, auto-without-fp8, {', '.join(RECIPES)}"
    )


#: Suffix of a route's entry in the recipe file naming its fastest cell without fp8 maths,
#: written by the benchmark driver where the route's fastest cell has them.
WITHOUT_FP8 = "_without_fp8"


def recipe_uses_fp8(fields) -> bool:
    """Whether a recipe (a :class:`Recipe`, a benchmark cell, or a cell's recipe dict) computes
    in fp8 anywhere: an fp8 precision or an fp8 attention stage."""
    get = fields.get if isinstance(fields, dict) else lambda key: getattr(fields, key, None)
    return get("precision") == "fp8" or "flash-fp8" in (get("attention") or {}).values()


def recipe_from_cell(fields: dict, name: str | None = None) -> Recipe:
    """The recipe of a benchmark cell's fields (``tabserve.bench.cells.Cell.recipe()``)."""
    if fields.get("engine", "tabserve") != "tabserve":
        raise ValueError("only tabserve cells describe a tabserve recipe")
    compile_mode = "regional" if fields.get("regional") else (fields.get("compile") or "none")
    return Recipe(
        name or fields.get("name", "measured"),
        precision=fields.get("precision", "fp32"),
        attention=dict(fields.get("attention") or {}),
        compile=compile_mode,
        dynamic=bool(fields.get("dynamic")),
        buckets=bool(fields.get("buckets")),
        cuda_graphs=bool(fields.get("cuda_graphs")),
        kv_graphs=bool(fields.get("kv_graphs")),
        shape_graphs=bool(fields.get("shape_graphs")),
        fused_ffn=bool(fields.get("fused_ffn")),
        fused_norm_linear=bool(fields.get("fused_norm_linear")),
        rope_in_projection=bool(fields.get("rope_in_projection")),
        fused_out_projection=bool(fields.get("fused_out_projection")),
        fused_row_tokens=bool(fields.get("fused_row_tokens")),
        icl_one_pass=bool(fields.get("icl_one_pass")),
        freeze=bool(fields.get("freeze")),
        description="promoted by the benchmark driver",
    )


def device_key(device: torch.device | str) -> str:
    """The key the benchmark driver files a device under: the GPU name, or ``"cpu"``."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def auto_recipe(
    device: torch.device | str,
    n_train: int,
    n_features: int,
    kv_cache: bool = False,
    path: Path | str | None = None,
    *,
    task: str | None = None,
    n_classes: int | None = None,
    many_classes_above: int = 10,
    fp8: bool = True,
) -> Recipe:
    """The recipe the benchmark driver promoted on this device for the closest workload.

    Route ``kv_predict`` with a KV cache, else ``one_shot``. ``fp8=False``: never a recipe that
    computes in fp8 (the fp8 ICL attention: answers within the reduced-precision gate, but
    further from fp32 than fp16's); where the promoted one does, the driver's fastest without
    fp8 on that workload (its ``<route>_without_fp8`` entry; a workload without one is left
    out). Among the workloads measured on that
    route, those of the same ``task`` ("clf" or "reg") are preferred, then, for classification,
    those on the same side of ``many_classes_above`` classes (past it the model runs its
    hierarchical many-class path, a different workload); a criterion that no measured workload
    meets is dropped rather than failing. Closest = smallest distance in log2 of train rows and
    features. No file, no entry for the device or an unusable entry: warns and returns
    :data:`DEFAULT_RECIPE`.
    """
    if task not in (None, "clf", "reg"):
        raise ValueError(f"auto_recipe: task must be 'clf', 'reg' or None, got {task!r}")
    path = Path(path or os.environ.get("TABSERVE_RECIPES", RECIPES_PATH))
    key = device_key(device)
    try:
        workloads = json.loads(path.read_text())["devices"][key]["workloads"]
    except (OSError, ValueError, KeyError, TypeError):
        workloads = {}
    route = "kv_predict" if kv_cache else "one_shot"

    def measured(entry: dict) -> dict | None:
        promoted = entry.get(route)
        if fp8 or not promoted or not recipe_uses_fp8(promoted.get("recipe") or {}):
            return promoted
        return entry.get(route + WITHOUT_FP8)

    candidates = [
        (entry["shape"], measured(entry))
        for entry in workloads.values()
        if isinstance(entry, dict) and entry.get("shape") and measured(entry)
    ]
    if not candidates:
        warnings.warn(
            f"recipe='auto': no {route} measurement for device {key!r} in {path}; serving "
            f"{DEFAULT_RECIPE!r} (run python -m tabserve.bench on this machine to measure)",
            stacklevel=3,
        )
        return RECIPES[DEFAULT_RECIPE]

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
        return abs(math.log2(shape["n_train"] / n_train)) + abs(
            math.log2(shape["n_features"] / n_features)
        )

    _, promoted = min(candidates, key=lambda c: distance(c[0]))
    try:
        return recipe_from_cell(promoted["recipe"], name=promoted.get("cell"))
    except (KeyError, ValueError) as e:
        warnings.warn(
            f"recipe='auto': promoted entry {promoted.get('cell')!r} is unusable ({e}); serving "
            f"{DEFAULT_RECIPE!r}",
            stacklevel=3,
        )
        return RECIPES[DEFAULT_RECIPE]
