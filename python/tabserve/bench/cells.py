"""Benchmark cells: named serving recipes, as data.

A cell says *what* runs (the reference ``tabicl`` or tabserve), in which precision, with which
attention backend per stage, compiled how, and with which serving features (KV cache, shape
buckets, regional compile, CUDA graphs). :mod:`.engines` turns a cell into callables; nothing else
branches on cell names.

A recipe that the driver cannot run yet carries ``pending``: the reason it is reported as
"skipped: not implemented". Bucketed, regional and CUDA-graph cells run through
:class:`tabserve.models.tabicl.serving.ServedTabICL` (:mod:`.engines`); their padded outputs are
also gated against unpadded ones (fp32 eager, same workload).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field

#: Precisions a cell may ask for; ``fp32`` means TF32 off for matmul and cuDNN.
PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
#: ``torch.nn.attention.SDPBackend`` members by the names cells use.
ATTENTION_BACKENDS = {
    "math": "MATH",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
}
#: tabserve's own attention kernels (``head16``: :func:`tabserve.ops.small_head_attention`;
#: ``head16-short``: the same where the keys fit its one staged chunk, <= 128; ``head16-flash``:
#: ``head16-short`` with the longer key runs on ``flash-half``; ``flash-half`` / ``flash-fp8``:
#: :func:`tabserve.ops.flash_attention` on half / fp8 operands); the recipes' table
#: (``recipes.KERNEL_BACKENDS``, kept equal by a test).
KERNEL_BACKENDS = ("head16", "head16-short", "head16-flash", "flash-half", "flash-fp8")
#: The model's stages, in the order data flows through them.
STAGES = ("col", "row", "icl")
#: ``torch.compile`` modes a cell may ask for (None: eager).
COMPILE_MODES = (None, "default", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class Cell:
    """One serving recipe.

    Fields:
        name: ``c<N>-<what>``, stable across runs (results and recipe files refer to it).
        engine: ``"reference"`` (tabicl 2.2.0) or ``"tabserve"``.
        precision: one of :data:`PRECISIONS`.
        attention: ``{stage: backend}`` for stages in :data:`STAGES`, backends in
            :data:`ATTENTION_BACKENDS` or :data:`KERNEL_BACKENDS`; empty = PyTorch's own choice.
        compile: one of :data:`COMPILE_MODES`.
        dynamic: ``torch.compile(dynamic=True)``: one graph for every shape, no padding.
        fullgraph: ``torch.compile(fullgraph=True)``.
        kv_cache: the end-to-end estimator is fitted with ``kv_cache=True`` and predicts from it.
        buckets: name of a bucket grid (padded shapes), or None.
        regional: per-block (regional) compilation.
        cuda_graphs: CUDA graphs captured per bucket.
        kv_graphs: without buckets, the KV-cached prediction replayed from a CUDA graph per cache
            and test-row bucket (the cache unpadded; ``Recipe.kv_graphs``).
        shape_graphs: without buckets, the one-shot call replayed from a CUDA graph per table
            shape, the test rows on the grid's test-row buckets (``Recipe.shape_graphs``).
        fused_ffn: the fused feed-forward operator in every block where its kernel applies
            (:func:`tabserve.ops.feed_forward`; bf16 / fp16 only).
        fused_norm_linear: the fused LayerNorm + input projection operator likewise
            (:func:`tabserve.ops.norm_linear`).
        rope_in_projection: with ``fused_norm_linear``, the row stage's RoPE inside that
            operator (``Recipe.rope_in_projection``).
        fused_out_projection: with ``fused_ffn``, each block's out-projection inside the fused
            feed-forward's Triton kernel (``Recipe.fused_out_projection``).
        fused_row_tokens: with ``fused_ffn``, the row stage's tokens written by the column
            stage's last fused feed-forward (``Recipe.fused_row_tokens``).
        icl_one_pass: the ICL stage's train and test rows through each block in one pass in
            unpadded one-shot calls (``Recipe.icl_one_pass``).
        ffn_projecting_tile: with ``fused_out_projection``, the fused feed-forward's long-stream
            tile (tokens, warps, stages) for the launches that fold the out-projection
            (``kernels.feed_forward.PROJECTING_LONG_CONFIG``), to measure a tile in the whole
            model; a measurement knob, not a recipe field: such a cell is never promoted.
        ffn_gelu: with ``fused_ffn``, the fused feed-forward kernel's GELU form (one of
            ``kernels.feed_forward.GELUS``), to measure a form in the whole model; a
            measurement knob like ``ffn_projecting_tile``.
        checks_first: the model reads its input checks' verdict before it queues the network
            (``TabICLv2.defer_checks`` off: the one-shot path before the fifteenth session), to
            measure what deferring the read saves; a measurement knob like ``ffn_gelu``.
        freeze: Inductor's freezing for the compiled graphs (weights as constants: their casts
            are folded at compile time; ``Recipe.freeze``).
        warm_cache: a server restart: a priming process compiles the workload's bucket and saves
            the compile-cache artifacts (tabserve.compile_cache); the measured process starts
            with empty caches and loads them; its cold call is the restart's ready time.
        aot: with ``warm_cache``: the priming process exports the workload's bucket packages
            (AOTInductor, tabserve.models.tabicl.aot) and the restart loads them instead.
        devices: device types the cell can run on.
        pending: why the driver cannot run this recipe yet (reported as skipped).
        baseline: a reference cell (speedups are quoted against these; never promoted).
        description: one line for the table legend and the docs.
    """

    name: str
    engine: str
    precision: str
    description: str
    attention: dict = field(default_factory=dict)
    compile: str | None = None
    dynamic: bool = False
    fullgraph: bool = False
    kv_cache: bool = False
    buckets: str | None = None
    regional: bool = False
    cuda_graphs: bool = False
    kv_graphs: bool = False
    shape_graphs: bool = False
    fused_ffn: bool = False
    fused_norm_linear: bool = False
    rope_in_projection: bool = False
    fused_out_projection: bool = False
    fused_row_tokens: bool = False
    icl_one_pass: bool = False
    ffn_projecting_tile: tuple | None = None
    ffn_gelu: str | None = None
    checks_first: bool = False
    freeze: bool = False
    warm_cache: bool = False
    aot: bool = False
    devices: tuple = ("cuda",)
    pending: str | None = None
    baseline: bool = False

    def __post_init__(self):
        if self.engine not in ("reference", "tabserve"):
            raise ValueError(f"{self.name}: unknown engine {self.engine!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"{self.name}: unknown precision {self.precision!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"{self.name}: unknown compile mode {self.compile!r}")
        for stage, backend in self.attention.items():
            if stage not in STAGES or backend not in (*ATTENTION_BACKENDS, *KERNEL_BACKENDS):
                raise ValueError(f"{self.name}: bad attention choice {stage}={backend}")
        for fused in ("fused_ffn", "fused_norm_linear"):
            if getattr(self, fused) and self.precision not in ("bf16", "fp16"):
                raise ValueError(f"{self.name}: {fused} runs under bf16 / fp16 autocast only")
        if self.rope_in_projection and not self.fused_norm_linear:
            raise ValueError(f"{self.name}: rope_in_projection needs fused_norm_linear")
        for folded in ("fused_out_projection", "fused_row_tokens"):
            if getattr(self, folded) and not self.fused_ffn:
                raise ValueError(f"{self.name}: {folded} needs fused_ffn")
        if self.ffn_projecting_tile is not None:
            tile = tuple(self.ffn_projecting_tile)
            tokens = tile[0] if len(tile) == 3 else 0
            if (
                not self.fused_out_projection
                or len(tile) != 3
                or min(tile) < 1
                or tokens & (tokens - 1)
            ):
                raise ValueError(
                    f"{self.name}: ffn_projecting_tile is (tokens: a power of two, warps, "
                    f"stages) of launches that fold the out-projection (fused_out_projection)"
                )
        if self.ffn_gelu is not None:
            from tabserve.kernels.feed_forward import GELUS

            if not self.fused_ffn or self.ffn_gelu not in GELUS:
                raise ValueError(
                    f"{self.name}: ffn_gelu is the fused feed-forward's GELU form (fused_ffn), "
                    f"one of {GELUS}"
                )
        if self.checks_first and self.engine != "tabserve":
            raise ValueError(f"{self.name}: checks_first is a setting of tabserve's model")
        if self.freeze and not (self.compile or self.regional):
            raise ValueError(f"{self.name}: freeze is Inductor's freezing of compiled graphs")
        if self.kv_graphs and self.buckets:
            raise ValueError(f"{self.name}: kv_graphs serve unpadded caches (no buckets)")
        if self.shape_graphs and self.buckets:
            raise ValueError(f"{self.name}: shape_graphs serve unpadded tables (no buckets)")
        if self.aot and not (self.warm_cache and self.buckets):
            raise ValueError(f"{self.name}: aot packages are a restart (warm_cache) of buckets")

    @property
    def reduced_precision(self) -> bool:
        return self.precision != "fp32"

    @property
    def uniform_attention(self) -> str | None:
        """The backend when every stage uses the same one (then applied around whole calls)."""
        backends = {self.attention.get(stage) for stage in STAGES}
        return backends.pop() if len(backends) == 1 else None

    def kernel_knobs(self) -> dict:
        """The measurement knobs this cell sets (``ffn_projecting_tile``, ``ffn_gelu``,
        ``checks_first``): settings of the kernels and the model, set in the cell's own process,
        which a recipe does not carry."""
        knobs = {
            "ffn_projecting_tile": self.ffn_projecting_tile,
            "ffn_gelu": self.ffn_gelu,
            "checks_first": self.checks_first or None,
        }
        return {name: value for name, value in knobs.items() if value is not None}

    def recipe(self) -> dict:
        """The recipe fields (what ``recipe="auto"`` needs to rebuild this cell)."""
        skip = {
            "name", "description", "devices", "pending", "baseline", "warm_cache", "aot",
            "ffn_projecting_tile", "ffn_gelu", "checks_first",
        }  # fmt: skip
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip
        }


def _all(backend: str) -> dict:
    return {stage: backend for stage in STAGES}


_BOTH = ("cpu", "cuda")

#: c38 to c42, which later cells vary.
_C38 = Cell(
    "c38-fp16-compile-head16-row-fused-frozen",
    "tabserve",
    "fp16",
    "c36 with Inductor's freezing (weights as compile-time constants)",
    compile="default",
    attention={"row": "head16"},
    fused_ffn=True,
    fused_norm_linear=True,
    freeze=True,
)
_C39 = dataclasses.replace(
    _C38,
    name="c39-fp16-buckets-compile-cudagraphs-head16-row-fused-frozen",
    description="c37 with Inductor's freezing (weights as compile-time constants)",
    buckets="default",
    cuda_graphs=True,
)
_C40 = dataclasses.replace(
    _C38,
    name="c40-fp16-compile-head16-fused-frozen",
    description="c38 with the column stage's short key runs on the head-dim-16 kernel",
    attention={"row": "head16", "col": "head16-short"},
)
_C41 = dataclasses.replace(
    _C39,
    name="c41-fp16-buckets-compile-cudagraphs-head16-fused-frozen",
    description="c39 with the column stage's short key runs on the head-dim-16 kernel",
    attention={"row": "head16", "col": "head16-short"},
)
_C42 = dataclasses.replace(
    _C40,
    name="c42-fp16-compile-head16-fused-frozen-kvgraphs",
    description="c40 whose KV-cached prediction replays a CUDA graph per cache and test-row bucket",
    kv_graphs=True,
)

#: c59, which c60 and c61 vary (see the table).
_C59 = dataclasses.replace(
    _C42,
    name="c59-fp16-compile-head16-fused-frozen-kvgraphs-ropeproj-outproj-rowtokens-gelu"
    "-iclfp8-colflash",
    description="c57 with the column stage's inducing points on tabserve's flash kernel",
    attention={"row": "head16", "col": "head16-flash", "icl": "flash-fp8"},
    rope_in_projection=True,
    fused_out_projection=True,
    fused_row_tokens=True,
    ffn_gelu="rational",
)

CELLS: tuple[Cell, ...] = (
    # Baselines: the reference package as a user runs it.
    Cell(
        "c0-ref-fp32",
        "reference",
        "fp32",
        "tabicl 2.2.0, fp32 (TF32 off)",
        devices=_BOTH,
        baseline=True,
    ),
    Cell(
        "c1-ref-fp16",
        "reference",
        "fp16",
        "tabicl 2.2.0 with its own fp16 autocast (use_amp)",
        baseline=True,
    ),
    # Precision.
    Cell("c2-fp32", "tabserve", "fp32", "eager, fp32 (TF32 off)", devices=_BOTH),
    Cell("c3-tf32", "tabserve", "tf32", "eager, TF32 matmul and cuDNN"),
    Cell("c4-bf16", "tabserve", "bf16", "eager, bf16 autocast"),
    Cell("c5-fp16", "tabserve", "fp16", "eager, fp16 autocast"),
    # Attention backend per stage (sdpa_kernel).
    Cell(
        "c6-fp16-cudnn",
        "tabserve",
        "fp16",
        "fp16, cuDNN attention everywhere",
        attention=_all("cudnn"),
    ),
    Cell(
        "c7-fp16-flash",
        "tabserve",
        "fp16",
        "fp16, flash attention everywhere",
        attention=_all("flash"),
    ),
    Cell(
        "c8-fp16-efficient",
        "tabserve",
        "fp16",
        "fp16, memory-efficient attention everywhere",
        attention=_all("efficient"),
    ),
    Cell(
        "c9-fp16-flash-cudnn-icl",
        "tabserve",
        "fp16",
        "fp16, flash in col/row, cuDNN in ICL",
        attention={"col": "flash", "row": "flash", "icl": "cudnn"},
    ),
    # Whole-model compile.
    Cell(
        "c10-fp16-compile",
        "tabserve",
        "fp16",
        "fp16, torch.compile (default mode)",
        compile="default",
    ),
    Cell(
        "c11-fp16-compile-max-autotune",
        "tabserve",
        "fp16",
        "fp16, torch.compile max-autotune-no-cudagraphs",
        compile="max-autotune-no-cudagraphs",
    ),
    Cell(
        "c12-fp16-dynamic-flash",
        "tabserve",
        "fp16",
        "fp16, torch.compile(dynamic=True), flash first, unpadded",
        compile="default",
        dynamic=True,
        attention=_all("flash"),
    ),
    # KV cache (end-to-end predict from a cached fit).
    Cell(
        "c13-fp32-kv",
        "tabserve",
        "fp32",
        "fp32, estimator with kv_cache=True",
        kv_cache=True,
        devices=_BOTH,
    ),
    Cell("c14-fp16-kv", "tabserve", "fp16", "fp16, estimator with kv_cache=True", kv_cache=True),
    # Issue 5 recipes: regional compile, buckets, CUDA graphs, compile-cache artifacts.
    Cell(
        "c15-fp16-regional",
        "tabserve",
        "fp16",
        "fp16, regional (per-block) compile",
        compile="default",
        regional=True,
    ),
    Cell(
        "c16-fp16-buckets-compile",
        "tabserve",
        "fp16",
        "fp16, bucket grid + torch.compile",
        compile="default",
        buckets="default",
    ),
    Cell(
        "c17-fp16-buckets-regional",
        "tabserve",
        "fp16",
        "fp16, bucket grid + regional compile",
        compile="default",
        buckets="default",
        regional=True,
    ),
    Cell(
        "c18-fp16-buckets-cudagraphs",
        "tabserve",
        "fp16",
        "fp16, bucket grid + CUDA graph per bucket",
        buckets="default",
        cuda_graphs=True,
    ),
    Cell(
        "c19-fp16-buckets-cudagraphs-kv",
        "tabserve",
        "fp16",
        "fp16, bucket grid + CUDA graphs, KV-cached predict",
        buckets="default",
        cuda_graphs=True,
        kv_cache=True,
    ),
    Cell(
        "c20-fp16-buckets-warm-cache",
        "tabserve",
        "fp16",
        "fp16, bucket grid + compile, restart from saved compile-cache artifacts",
        compile="default",
        buckets="default",
        warm_cache=True,
    ),
    # Optional.
    Cell(
        "c21-fp8-te",
        "tabserve",
        "fp8",
        "fp8 linear layers through Transformer Engine",
        pending="no Transformer Engine integration in tabserve yet",
    ),
    # Padding on its own (CPU-capable): exercises the padded-vs-unpadded gate without a GPU.
    Cell(
        "c22-fp32-buckets",
        "tabserve",
        "fp32",
        "fp32 eager on the bucket grid (padded tables)",
        buckets="default",
        devices=_BOTH,
    ),
    # Compile and CUDA graphs together: Inductor's fused kernels replayed per bucket.
    Cell(
        "c23-fp16-buckets-compile-cudagraphs",
        "tabserve",
        "fp16",
        "fp16, bucket grid + torch.compile, the compiled kernels in a CUDA graph per bucket",
        compile="default",
        buckets="default",
        cuda_graphs=True,
    ),
    # Whole-model compile with other kernels for the head-dim-16 stages (column and row), which
    # the H200 profile of c10 / c23 shows as the largest remaining cost on large tables.
    Cell(
        "c24-fp16-compile-efficient-colrow",
        "tabserve",
        "fp16",
        "fp16, torch.compile, memory-efficient attention in col/row, cuDNN in ICL",
        compile="default",
        attention={"col": "efficient", "row": "efficient", "icl": "cudnn"},
    ),
    Cell(
        "c25-fp16-compile-flash-colrow",
        "tabserve",
        "fp16",
        "fp16, torch.compile, flash in col/row, cuDNN in ICL",
        compile="default",
        attention={"col": "flash", "row": "flash", "icl": "cudnn"},
    ),
    # c23 with autotuned Inductor kernels: the small table's replay is all kernel time.
    Cell(
        "c26-fp16-buckets-max-autotune-cudagraphs",
        "tabserve",
        "fp16",
        "fp16, bucket grid + torch.compile max-autotune-no-cudagraphs, captured per bucket",
        compile="max-autotune-no-cudagraphs",
        buckets="default",
        cuda_graphs=True,
    ),
    # A restart from bucket packages compiled ahead of time (AOTInductor): no tracing, no compile.
    Cell(
        "c27-fp16-buckets-aot-restart",
        "tabserve",
        "fp16",
        "fp16, bucket grid, restart from ahead-of-time bucket packages (AOTInductor)",
        buckets="default",
        warm_cache=True,
        aot=True,
    ),
    Cell(
        "c28-fp32-buckets-aot-restart",
        "tabserve",
        "fp32",
        "fp32, bucket grid, restart from ahead-of-time bucket packages (AOTInductor)",
        buckets="default",
        warm_cache=True,
        aot=True,
        devices=_BOTH,
    ),
    Cell(
        "c29-fp16-buckets-aot-cudagraphs-restart",
        "tabserve",
        "fp16",
        "fp16, bucket grid, restart from bucket packages, each captured in a CUDA graph",
        buckets="default",
        cuda_graphs=True,
        warm_cache=True,
        aot=True,
    ),
    # tabserve's head-dim-16 kernel in the column and row stages (small_head_attention).
    Cell(
        "c30-fp16-compile-head16-colrow",
        "tabserve",
        "fp16",
        "fp16, torch.compile, tabserve's head-dim-16 kernel in col/row, default SDPA in ICL",
        compile="default",
        attention={"col": "head16", "row": "head16"},
    ),
    Cell(
        "c31-fp16-buckets-compile-cudagraphs-head16",
        "tabserve",
        "fp16",
        "c23 with tabserve's head-dim-16 kernel in col/row (padded keys skipped, n on device)",
        compile="default",
        buckets="default",
        cuda_graphs=True,
        attention={"col": "head16", "row": "head16"},
    ),
    # c30 with the kernel only where it won on the H200 (row stage; the column stage keeps
    # cuDNN, 2-3x faster there): benchmarks/results/h200/small-head-attention-cuda.json.
    Cell(
        "c32-fp16-compile-head16-row",
        "tabserve",
        "fp16",
        "fp16, torch.compile, tabserve's head-dim-16 kernel in the row stage only",
        compile="default",
        attention={"row": "head16"},
    ),
    Cell(
        "c33-fp16-buckets-compile-cudagraphs-head16-row",
        "tabserve",
        "fp16",
        "c23 with tabserve's head-dim-16 kernel in the row stage only (feature padding skipped)",
        compile="default",
        buckets="default",
        cuda_graphs=True,
        attention={"row": "head16"},
    ),
    # The fused feed-forward operator (tabserve.ops.feed_forward) on top of c32 / c33.
    Cell(
        "c34-fp16-compile-head16-row-ffn",
        "tabserve",
        "fp16",
        "c32 with the fused feed-forward operator in the column and row stages",
        compile="default",
        attention={"row": "head16"},
        fused_ffn=True,
    ),
    Cell(
        "c35-fp16-buckets-compile-cudagraphs-head16-row-ffn",
        "tabserve",
        "fp16",
        "c33 with the fused feed-forward operator in the column and row stages",
        compile="default",
        buckets="default",
        cuda_graphs=True,
        attention={"row": "head16"},
        fused_ffn=True,
    ),
    # ... and LayerNorm 1 with the input projections (tabserve.ops.norm_linear) on top.
    Cell(
        "c36-fp16-compile-head16-row-fused",
        "tabserve",
        "fp16",
        "c34 with the fused LayerNorm + input projection operator too",
        compile="default",
        attention={"row": "head16"},
        fused_ffn=True,
        fused_norm_linear=True,
    ),
    Cell(
        "c37-fp16-buckets-compile-cudagraphs-head16-row-fused",
        "tabserve",
        "fp16",
        "c35 with the fused LayerNorm + input projection operator too",
        compile="default",
        buckets="default",
        cuda_graphs=True,
        attention={"row": "head16"},
        fused_ffn=True,
        fused_norm_linear=True,
    ),
    # Inductor's freezing on top: the weights' per-call casts to fp16 (~160 kernels per small
    # call in the fifth session's profile of c33) are folded at compile time.
    _C38,
    _C39,
    # The column stage's rows over the 128 induced tokens on the head-dim-16 kernel too (the
    # ninth session's kernel: fewer instructions per score), the inducing points' attention
    # over the train rows still on cuDNN.
    _C40,
    _C41,
    # c40's KV-cached prediction from a CUDA graph per (cache, test bucket): no guard checks
    # and launches before the device starts (0.4-0.9 ms of c40's 23.5 ms on the H200), the
    # cache unpadded (no masks).
    _C42,
    # c40, c42 and c41 with the row stage's RoPE inside the fused LayerNorm + projection: the
    # head-dim-16 kernel then attends over rotated queries and keys (its RoPE variant took
    # 15.8 ms over the row stage's 3 calls in c40's large one-shot profile, eleventh session;
    # the plain kernel 10.3 ms on those shapes in the ninth session's benchmark).
    *(
        dataclasses.replace(
            base,
            name=f"c{number}-{base.name.split('-', 1)[1]}-ropeproj",
            description=f"{base.name.split('-')[0]} with the row stage's RoPE inside the fused "
            "projection",
            rope_in_projection=True,
        )
        for number, base in ((43, _C40), (44, _C42), (45, _C41))
    ),
    # c43 and c44 with each block's out-projection inside the fused feed-forward's Triton
    # kernel (the projected attention output, 1.4 GB per big block on large, never written).
    *(
        dataclasses.replace(
            base,
            name=f"c{number}-{base.name.split('-', 1)[1]}-ropeproj-outproj",
            description=f"c{number - 3} with the out-projections inside the fused feed-forward",
            rope_in_projection=True,
            fused_out_projection=True,
        )
        for number, base in ((46, _C40), (47, _C42))
    ),
    # c46 and c47 with the row stage's tokens written by the column stage's last fused
    # feed-forward (its output transposed into rows behind the CLS tokens): the pass that
    # did it took 1.38 ms of c46's large one-shot profile (twelfth session), ~0.28 ms of
    # c40's cached predict.
    *(
        dataclasses.replace(
            base,
            name=f"c{number}-{base.name.split('-', 1)[1]}-ropeproj-outproj-rowtokens",
            description=f"c{number - 2} with the row stage's tokens written by the column "
            "stage's last feed-forward",
            rope_in_projection=True,
            fused_out_projection=True,
            fused_row_tokens=True,
        )
        for number, base in ((48, _C40), (49, _C42))
    ),
    # c49 with the folding launches' tile that led benchmarks/feed_forward.py's sweep on the
    # folded out-projection (32 tokens x 4 warps x 2 stages: 7.34 ms against the default's
    # 7.90 on the large row stream, 1.46 / 1.63 on the KV-cached one; H200, thirteenth
    # session, fp32 stream): does it carry over to the model's fp16 streams? (Run 17 did not
    # tell: the tile was set only where the engine prepared a model, and this cell's kv_graphs
    # model is served, so it ran c49's tile; the engine sets the knobs for every cell now.)
    dataclasses.replace(
        _C42,
        name="c50-fp16-compile-head16-fused-frozen-kvgraphs-ropeproj-outproj-rowtokens-tile32",
        description="c49 with 32-token tiles (4 warps, 2 stages) where the feed-forward folds "
        "the out-projection",
        rope_in_projection=True,
        fused_out_projection=True,
        fused_row_tokens=True,
        ffn_projecting_tile=(32, 4, 2),
    ),
    # c49 whose one-shot call replays a CUDA graph per table shape: no guard checks, launches
    # or host syncs between the checks and the last kernel (c46's large one-shot profile,
    # twelfth session: 1.81 ms of idle gaps and 0.83 ms of host lead in 122.2 ms).
    dataclasses.replace(
        _C42,
        name="c51-fp16-compile-head16-fused-frozen-kvgraphs-ropeproj-outproj-rowtokens-shapegraphs",
        description="c49 whose one-shot call replays a CUDA graph per table shape (test rows "
        "on the grid's test-row buckets)",
        rope_in_projection=True,
        fused_out_projection=True,
        fused_row_tokens=True,
        shape_graphs=True,
    ),
    # c49 with the fused feed-forward's rational GELU form: 22 instead of 31 SASS instructions
    # per hidden unit, the erf's share of the kernel's instructions about two thirds. Run 19
    # (H200, fourteenth session): 121.3 ms one-shot and 22.1 KV-cached against c49's 122.4 /
    # 22.8 with erff, so the form is the kernel's default since: c49 runs it too from then on.
    dataclasses.replace(
        _C42,
        name="c52-fp16-compile-head16-fused-frozen-kvgraphs-ropeproj-outproj-rowtokens-gelu",
        description="c49 with the fused feed-forward's rational GELU form",
        rope_in_projection=True,
        fused_out_projection=True,
        fused_row_tokens=True,
        ffn_gelu="rational",
    ),
    # c52 reading its input checks' verdict before it queues the network, as every one-shot
    # call did before the fifteenth session: c49's large profile (fourteenth session) showed
    # the device idle for 1.13 ms after the checks' kernel while the host read the verdict,
    # checked the compiled frame's guards and launched. c52 now queues first and reads after.
    # Run 20 (H200, fifteenth session): 120.1 ms one-shot both (p20-p80 119.9-121.1 / 119.6-
    # 120.4): unprofiled, that idle time was not on the critical path.
    dataclasses.replace(
        _C42,
        name="c53-fp16-compile-head16-fused-frozen-kvgraphs-ropeproj-outproj-rowtokens-gelu"
        "-checksfirst",
        description="c52 reading the input checks' verdict before the network",
        rope_in_projection=True,
        fused_out_projection=True,
        fused_row_tokens=True,
        ffn_gelu="rational",
        checks_first=True,
    ),
    # c41 (buckets, whole compile, CUDA graphs per bucket) with every fused kernel c52 serves
    # large with: RoPE in the projections, the out-projections in the feed-forward, the row
    # tokens written by the column stage (the rational GELU is the kernel's default). The small
    # workload's one-shot call is ~370 kernels in a graph (c39's profile), so kernels that fold
    # a pass away count there; c41 took 3.46 ms against a 10x target of ~3.0-3.3 ms.
    dataclasses.replace(
        _C41,
        name="c54-fp16-buckets-compile-cudagraphs-head16-fused-frozen-ropeproj-outproj-rowtokens",
        description="c41 with c52's fused kernels (RoPE in the projections, out-projections "
        "in the feed-forward, row tokens from the column stage)",
        rope_in_projection=True,
        fused_out_projection=True,
        fused_row_tokens=True,
    ),
    # Small run 11 (H200, eighteenth session): c45 and c54 took 3.65 ms against c41's 3.43 in
    # one run, so the row stage's RoPE inside the projection costs the small table ~0.2 ms;
    # the out-projections and row tokens changed nothing one-shot and took the KV-cached
    # prediction from 1.53 to 1.28 ms. c55: c41 with those two, RoPE as c41 has it. c56: the
    # same kernels unpadded, the one-shot call replayed from a graph per table shape (the
    # padded ICL calls ran 1.9x slower than cuDNN on sliced keys: icl_attention.py --prefix).
    dataclasses.replace(
        _C41,
        name="c55-fp16-buckets-compile-cudagraphs-head16-fused-frozen-outproj-rowtokens",
        description="c41 with the out-projections in the feed-forward and the row tokens "
        "from the column stage",
        fused_out_projection=True,
        fused_row_tokens=True,
    ),
    dataclasses.replace(
        _C42,
        name="c56-fp16-compile-head16-fused-frozen-kvgraphs-outproj-rowtokens-shapegraphs",
        description="c42 with the out-projections in the feed-forward, the row tokens from "
        "the column stage and a CUDA graph per table shape (c51 without RoPE in the projection)",
        fused_out_projection=True,
        fused_row_tokens=True,
        shape_graphs=True,
    ),
    # c52 with the ICL stage's unpadded attention on tabserve's one-pass kernel: on fp8
    # operands (c57; the route to the xlarge target, whose one-shot call cuDNN's fp16 attention
    # bounds: 1,098 of c52's 1,850 ms) and on half ones (c58: the kernel against cuDNN in the
    # whole model). fp8 in those calls moved the probabilities by up to 5e-3 in the CPU study
    # (benchmarks/fp8_attention_emulation.py); the cell keeps fp16's reduced-precision gate.
    *(
        dataclasses.replace(
            _C42,
            name=f"c{number}-fp16-compile-head16-fused-frozen-kvgraphs-ropeproj-outproj"
            f"-rowtokens-gelu-icl{label}",
            description=f"c52 with the ICL stage's attention on tabserve's flash kernel, "
            f"{label} operands",
            attention={"row": "head16", "col": "head16-short", "icl": f"flash-{label}"},
            rope_in_projection=True,
            fused_out_projection=True,
            fused_row_tokens=True,
            ffn_gelu="rational",
        )
        for number, label in ((57, "fp8"), (58, "half"))
    ),
    # c57 with the column stage's inducing points over the train rows on the same kernel (half
    # operands, head dim 16, read in place: no copies of the head-split keys): cuDNN took about
    # 60 ms of c52's xlarge profile over those 3 x 3 calls (fifteenth session), ~2x the
    # exponentials' floor; the rows over the 128 induced tokens stay on the head-dim-16 kernel.
    _C59,
    # c59 with every unpadded column-stage attention on the flash kernel (half operands): the
    # rows over the 128 induced tokens too, where the head-dim-16 kernel ran at ~2.7x the
    # exponentials' floor on large (3.53 ms, ninth session); the kernel against it on that
    # shape is `small_head_attention.py --cases col-rows`' "tabserve flash half" row.
    dataclasses.replace(
        _C59,
        name=f"{_C59.name.replace('c59', 'c60', 1)}all",
        description="c59 with all of the column stage's unpadded attention on tabserve's "
        "flash kernel",
        attention={**_C59.attention, "col": "flash-half"},
    ),
    # c59 with the ICL stage's train and test rows in one pass per block: on xlarge the 12
    # test-row calls took ~2.2 ms each on the fp8 kernel (1,000 queries, 1.5 ms of a merged
    # call's time by its rate) and quantized the keys and values a second time (~13 ms in all
    # by that estimate).
    dataclasses.replace(
        _C59,
        name=f"{_C59.name.replace('c59', 'c61', 1)}-iclonepass",
        description="c59 with the ICL stage's train and test rows in one pass per block",
        icl_one_pass=True,
    ),
)


def cell_by_name(name: str) -> Cell:
    """The cell called ``name``. Raises KeyError listing the known names."""
    for cell in CELLS:
        if cell.name == name:
            return cell
    raise KeyError(f"unknown cell {name!r}; known: {', '.join(c.name for c in CELLS)}")


def recipe_cells() -> list:
    """The cells served through a tabserve recipe (``recipes.recipe_from_cell``): the tabserve
    engine's cells, less the fp8 ones, which Transformer Engine would serve."""
    return [c for c in CELLS if c.engine == "tabserve" and c.precision != "fp8"]


def select_cells(patterns: list | None) -> list:
    """Cells whose name matches any shell-style pattern (all cells when ``patterns`` is empty),
    in the order of the patterns (a pattern's own matches in table order), each once: a run
    cut by its deadline reaches the cells named first."""
    from fnmatch import fnmatch

    if not patterns:
        return list(CELLS)
    chosen, unknown = [], []
    for pattern in patterns:
        matches = [c for c in CELLS if fnmatch(c.name, pattern) or c.name == pattern]
        if not matches:
            unknown.append(pattern)
        chosen += [c for c in matches if c not in chosen]
    if unknown:
        raise KeyError(f"no cell matches {unknown}; known: {', '.join(c.name for c in CELLS)}")
    return chosen


def skip_reason(cell: Cell, device_type: str) -> str | None:
    """Why ``cell`` cannot run on ``device_type`` here, or None when it can."""
    if cell.precision == "fp8" and importlib.util.find_spec("transformer_engine") is None:
        return "skipped: transformer_engine is not importable"
    if cell.pending:
        return f"skipped: not implemented ({cell.pending})"
    if device_type not in cell.devices:
        return (
            "skipped: no CUDA device"
            if device_type == "cpu"
            else f"skipped: {device_type} not supported"
        )
    if cell.engine == "reference" and importlib.util.find_spec("tabicl") is None:
        return "skipped: tabicl is not installed"
    return None
