"""What the Triton-kernel operators share: Triton itself (or None), the dtypes and widths their
kernels take, tile configurations, argument checks and the rounding helper."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds come without Triton: the composites serve alone
    triton = None

#: Compute dtypes the CUDA kernels run; fp32 keeps the composites (bit for bit the modules).
KERNEL_COMPUTE_DTYPES = (torch.float16, torch.bfloat16)
#: Token widths the kernels take (a power of two: a tile row lives in registers).
KERNEL_WIDTHS = (16, 32, 64, 128)
#: Token streams the kernels read (and residual sums they round to).
STREAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Tile configurations (tokens per program, warps, pipeline stages) by stream length, chosen
#: on the H200 with ``benchmarks/feed_forward.py --sweep`` (18 configurations): 64 x
#: 4 warps x 1 stage is the fastest on the large workload's row and column streams (5.6 and 5.2
#: M tokens: 5.40 and 5.09 ms, against 7.50 and 7.07 ms for Inductor's compiled composite);
#: 128 x 8 x 1 on the small workload's row stream (55 k tokens: 0.085 ms, 64 x 4 x 1 0.159).
LONG_STREAM = 1 << 20
LONG_CONFIG = (64, 4, 1)
SHORT_CONFIG = (128, 8, 1)
#: Set by the benchmarks' sweeps to time one configuration everywhere (None: the table above).
CONFIG_OVERRIDE = None


def tile_config(tokens, long_config: tuple[int, int, int] = LONG_CONFIG) -> tuple[int, int, int]:
    """(tokens per program, warps, stages) for a stream of ``tokens`` tokens; an operator whose
    own sweep chose otherwise passes its ``long_config``."""
    if CONFIG_OVERRIDE is not None:
        return CONFIG_OVERRIDE
    return long_config if tokens >= LONG_STREAM else SHORT_CONFIG


def kernel_takes(x: Tensor, compute_dtype: torch.dtype) -> bool:
    """The conditions every kernel shares: Triton, CUDA, half-precision matmuls, the width."""
    return (
        triton is not None
        and x.device.type == "cuda"
        and compute_dtype in KERNEL_COMPUTE_DTYPES
        and x.dtype in STREAM_DTYPES
        and x.shape[-1] in KERNEL_WIDTHS
    )


def matmul_operand(weight: Tensor, compute_dtype: torch.dtype) -> Tensor:
    """A weight matrix as the kernels read it: fp32 weights cast to the matmul dtype here, once
    per call (under Inductor's freezing, once per compiled graph), instead of every program
    loading the fp32 matrix and rounding it itself. The same round-to-nearest as the kernels'
    ``round_to``, so the same bits; half the bytes each program reads (with fp32 weights, an H200
    profile of the large workload has the fused feed-forward's programs re-reading 256 KiB per 64
    tokens).
    Other dtypes (fp64) keep the kernels' own single rounding."""
    if weight.dtype == torch.float32:
        weight = weight.to(compute_dtype)
    return weight.contiguous()


def check_arguments(
    op: str, x: Tensor, matrix: tuple[str, Tensor], expected: dict, eps, compute_dtype
) -> None:
    """The operators' argument rules, each error naming its argument (fake tensors too).

    ``matrix``: (name, tensor) of the first weight, which must be (rows, x's width);
    ``expected``: {name: (tensor or None, shape)} of the other tensors (None: an absent
    optional argument)."""
    if not x.is_floating_point() or x.dim() < 1:
        raise ValueError(
            f"{op}: x must be a floating-point tensor (..., dim), got {x.dtype} {tuple(x.shape)}"
        )
    dim = x.shape[-1]
    name, weight = matrix
    if weight.dim() != 2 or weight.shape[1] != dim:
        rows = "hidden" if name == "w1" else "out_features"
        raise ValueError(f"{op}: {name} must be ({rows}, {dim}), got {tuple(weight.shape)}")
    present = {n: (t, shape) for n, (t, shape) in expected.items() if t is not None}
    for n, (tensor, shape) in present.items():
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{op}: {n} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")
    for n, tensor in [(name, weight), *((n, t) for n, (t, _) in present.items())]:
        if not tensor.is_floating_point():
            raise ValueError(f"{op}: {n} must be floating point, got {tensor.dtype}")
        if tensor.device != x.device:
            raise ValueError(f"{op}: {n} is on {tensor.device} but x is on {x.device}")
    if compute_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"{op}: compute_dtype must be float16, bfloat16 or float32, got {compute_dtype}"
        )
    if not eps >= 0.0 or eps == float("inf"):
        raise ValueError(f"{op}: eps must be finite and >= 0, got {eps}")


def check_skip(op: str, x: Tensor, skip: Tensor | None) -> None:
    """``skip`` (optional): bool over a leading part of x's shape (x.shape[:skip.dim()], fewer
    dimensions than x), on x's device: the sets of tokens whose outputs are the skip value."""
    if skip is None:
        return
    if skip.dtype != torch.bool or skip.dim() >= x.dim() or skip.shape != x.shape[: skip.dim()]:
        raise ValueError(
            f"{op}: skip must be a bool tensor of a leading part of x's shape "
            f"{tuple(x.shape[:-1])}, got {skip.dtype} {tuple(skip.shape)}"
        )
    if skip.device != x.device:
        raise ValueError(f"{op}: skip is on {skip.device} but x is on {x.device}")


def apply_skip(out: Tensor, skip: Tensor | None, skip_value: float) -> Tensor:
    """``out`` with the sets ``skip`` marks filled with ``skip_value`` (the composites' rule)."""
    if skip is None:
        return out
    return out.masked_fill(skip.view(*skip.shape, *([1] * (out.dim() - skip.dim()))), skip_value)


if triton is not None:

    @triton.jit
    def round_to(x, BF16: tl.constexpr):
        """``x`` rounded to the matmul dtype (bf16 or fp16), as that dtype."""
        if BF16:
            return x.to(tl.bfloat16)
        else:
            return x.to(tl.float16)

    @triton.jit
    def layer_norm_rows(
        x,
        norm_weight_ptr,
        norm_bias_ptr,
        cols,
        DIM: tl.constexpr,
        EPS: tl.constexpr,
        HAS_NORM_BIAS: tl.constexpr,
        BF16: tl.constexpr,
    ):
        """LayerNorm of every row of an fp32 tile in fp32 (biased variance, as ATen), rounded
        to the matmul dtype as autocast rounds it before a linear."""
        mean = tl.sum(x, axis=1) / DIM
        centred = x - mean[:, None]
        variance = tl.sum(centred * centred, axis=1) / DIM
        normed = centred * (1.0 / tl.sqrt_rn(variance + EPS))[:, None]
        normed = normed * tl.load(norm_weight_ptr + cols).to(tl.float32)[None, :]
        if HAS_NORM_BIAS:
            normed = normed + tl.load(norm_bias_ptr + cols).to(tl.float32)[None, :]
        return round_to(normed, BF16)


@contextlib.contextmanager
def tile_override(config: tuple[int, int, int]):
    """Every kernel launched inside runs tile ``config`` (the benchmarks' sweeps)."""
    global CONFIG_OVERRIDE
    saved, CONFIG_OVERRIDE = CONFIG_OVERRIDE, tuple(config)
    try:
        yield
    finally:
        CONFIG_OVERRIDE = saved


#: Most registers per thread of every kernel launched while set (Triton's ``maxnreg``; None:
#: the compiler's choice). Set by the benchmarks (:func:`register_limit_override`) to time
#: occupancy against spills: the fused kernels use 100-245 registers, so 2 programs share an SM.
REGISTER_LIMIT = None


def launch_limits() -> dict:
    """The launch options :data:`REGISTER_LIMIT` adds (none while it is None, so compiled
    graphs, which pass no other launch options than warps and stages, never see one)."""
    return {} if REGISTER_LIMIT is None else {"maxnreg": REGISTER_LIMIT}


@contextlib.contextmanager
def register_limit_override(limit: int):
    """Every kernel launched inside uses at most ``limit`` registers per thread (a multiple of
    8 from 24 to 255, as ptxas takes them). Raises ValueError for another number."""
    global REGISTER_LIMIT
    if not 24 <= limit <= 255 or limit % 8:
        raise ValueError(f"register limit must be a multiple of 8 in [24, 255], got {limit}")
    saved, REGISTER_LIMIT = REGISTER_LIMIT, limit
    try:
        yield
    finally:
        REGISTER_LIMIT = saved


@contextlib.contextmanager
def choice_override(module, name: str, value, choices: tuple, operator: str):
    """``module.<name>`` (a kernel setting among ``choices``) is ``value`` inside, and what it
    was after. Raises ValueError naming the setting when ``value`` is not one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{operator}: {name.lower()} must be one of {choices}, got {value!r}")
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


class WouldCompile(RuntimeError):
    """A Triton kernel launch inside :func:`no_triton_compiles` whose specialization is not
    compiled yet: nothing was compiled or launched."""


@dataclass(frozen=True)
class Specialization:
    """A Triton kernel specialization that a launch would have compiled: the kernel (its
    module and qualified name) and Triton's serialized form of the specialization, what
    ``JITFunction.preload`` compiles (:mod:`tabserve.kernels.precompile`)."""

    module: str
    qualname: str
    data: str


_GUARD = threading.local()  # per thread: the open guards, innermost last
_REFUSE = object()  # the guard of no_triton_compiles (a collect_compiles guard is its list)
_hook_lock = threading.Lock()
_chained_hook: list = [None]  # the jit_cache_hook found when ours was installed


def _on_compile(**kwargs):
    """Triton's ``jit_cache_hook``: called before a JIT function compiles a specialization
    absent from the process's kernel cache (returning True skips the compile and the launch;
    raising stops the launch). The innermost guard of this thread decides."""
    guards = getattr(_GUARD, "open", None)
    if guards:
        if guards[-1] is _REFUSE:
            raise WouldCompile(f"{kwargs.get('repr', 'a Triton kernel')} is not compiled yet")
        found = _specialization(kwargs)
        if found is not None:
            if found not in guards[-1]:
                guards[-1].append(found)
            return True
        return None  # nothing to compile elsewhere: this launch compiles here
    chained = _chained_hook[0]
    # A hook installed after ours may chain to ours, and ours (reinstalled) to it: call it once
    if chained is None or getattr(_GUARD, "chaining", False):
        return None
    _GUARD.chaining = True
    try:
        return chained(**kwargs)
    finally:
        _GUARD.chaining = False


def _specialization(kwargs: dict) -> Specialization | None:
    fn, data = kwargs.get("fn"), (kwargs.get("compile") or {}).get("specialization_data")
    module, qualname = getattr(fn, "module", None), getattr(fn, "name", None)
    if not (isinstance(data, str) and isinstance(module, str) and isinstance(qualname, str)):
        return None
    return Specialization(module, qualname, data)


def guards_compiles() -> bool:
    """Whether :func:`no_triton_compiles` and :func:`collect_compiles` work: Triton with its
    runtime hooks (``triton.knobs``, Triton 3.4 and later)."""
    return triton is not None and hasattr(getattr(triton, "knobs", None), "runtime")


@contextlib.contextmanager
def _guarded(guard, name: str):
    if not guards_compiles():
        raise RuntimeError(f"{name} needs Triton 3.4 or later (triton.knobs)")
    runtime = triton.knobs.runtime
    with _hook_lock:
        if runtime.jit_cache_hook is not _on_compile:  # installed once, chaining another
            _chained_hook[0] = runtime.jit_cache_hook
            runtime.jit_cache_hook = _on_compile
    guards = _GUARD.__dict__.setdefault("open", [])
    guards.append(guard)
    try:
        yield guard
    finally:
        guards.pop()


def no_triton_compiles():
    """Inside, in this thread only, a Triton kernel launch that would first compile its
    specialization (a shape class, dtype or constant not launched yet in this process, or read
    from Triton's disk cache) raises :class:`WouldCompile` instead, before compiling or
    launching; compiled kernels launch as usual. A compile costs seconds of the calling thread
    (ptxas and Triton's passes), which a serving call must not pay: the caller answers with
    another model and leaves the compile to a background thread. Raises RuntimeError where
    :func:`guards_compiles` is False."""
    return _guarded(_REFUSE, "no_triton_compiles")


def collect_compiles():
    """Inside, in this thread only, a Triton kernel launch that would first compile its
    specialization skips the compile and the launch and adds the :class:`Specialization` to
    the list the context yields (once each); compiled kernels launch as usual. So a call run
    inside lists what it would compile, for :func:`.precompile.compile_elsewhere`, and its
    outputs are not its answer. (A launch whose Triton gives no serialized specialization
    compiles and launches as usual.) Raises RuntimeError where :func:`guards_compiles` is
    False."""
    return _guarded([], "collect_compiles")


def define_operator(name: str, fn):
    """Registers ``fn`` as the operator ``name``: a ``triton_op`` (torch.compile traces the
    Triton program inside into its own graph; ``fn`` is also the fake kernel), or without
    Triton a custom op whose only kernel is ``fn``'s composite."""
    if triton is not None:
        return torch.library.triton_op(name, fn, mutates_args=())
    op = torch.library.custom_op(name, fn, mutates_args=())
    op.register_fake(fn)
    return op
