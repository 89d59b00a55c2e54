"""Shared building blocks of TabICLv2: pre-LN attention blocks, QASSMax, rotary embedding.

Module and parameter names follow the reference ``tabicl`` 2.2.0 state_dict (``norm1``,
``linear1``, ``attn.in_proj_weight``, ``attn.ssmax_layer.base_mlp.0.weight`` ...), so a reference
checkpoint loads with a strict ``load_state_dict``.

All functions accept arbitrary leading batch axes: tokens are ``(..., L, E)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tabserve.kernels._resident import RESIDENT_DIM, RESIDENT_HIDDEN
from tabserve.kernels.layout import MAX_GRID_BATCH, to_rows

from .stage_kernels import DEFAULT_KERNELS, SHORT_KEYS

#: Value that marks a skipped token in the reference (CLS placeholders, padded features).
SKIP_VALUE = -100.0

#: A pair of head-split key / value projections, each ``(..., heads, keys, head_dim)``.
KeyValue = tuple[Tensor, Tensor]


def sentinel_linear(linear: nn.Linear, x: Tensor) -> Tensor:
    """``linear(x)`` with the reference's sentinel rule.

    Tokens whose inputs all equal ``SKIP_VALUE`` get ``SKIP_VALUE`` in every output dimension
    (``SkippableLinear`` in the reference). Shapes: ``(..., in) -> (..., out)``.
    """
    out = linear(x)
    skipped = (x == SKIP_VALUE).all(dim=-1, keepdim=True)
    return out.masked_fill_(skipped, SKIP_VALUE)  # one pass, no tensor of sentinels


class QASSMax(nn.Module):
    """Query-aware scalable softmax, element-wise variant (``qassmax-mlp-elementwise``).

    Scales head-split queries before the softmax: ``q * base(ln n)[head] * (1 + tanh(mlp(q)))``
    where ``n`` is the number of keys (train rows). ``base_mlp`` gives one factor per (head, dim);
    ``query_mlp`` is shared by all heads.
    """

    def __init__(self, num_heads: int, head_dim: int, hidden: int = 64):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.base_mlp = nn.Sequential(
            nn.Linear(1, hidden), nn.GELU(), nn.Linear(hidden, num_heads * head_dim)
        )
        self.query_mlp = nn.Sequential(
            nn.Linear(head_dim, hidden), nn.GELU(), nn.Linear(hidden, head_dim)
        )

    def forward(self, q: Tensor, num_keys: int) -> Tensor:
        """q: ``(batch, heads, queries, head_dim)``; returns the scaled queries, same shape."""
        if torch.compiler.is_compiling():
            # The key count may be symbolic (torch.compile(dynamic=True)): math.log would pin it
            # to its first value; the same float64 log on the device stays symbolic.
            n = torch.full((1, 1), num_keys, device=q.device, dtype=torch.float64)
            log_n = n.clamp_min(1).log().to(q.dtype)
        else:
            # torch.full fills on the device: no host-to-device copy, which would synchronise
            # the host with the GPU once per ICL block and stall kernel launches behind it.
            log_n = torch.full((1, 1), math.log(max(num_keys, 1)), device=q.device, dtype=q.dtype)
        base = self.base_mlp(log_n).view(1, self.num_heads, 1, self.head_dim)
        modulation = 1 + torch.tanh(self.query_mlp(q))
        return q * (base * modulation)


#: Devices whose eager RoPE runs the one-pass ``tabserve::rotary_embedding`` operator (on the
#: H200 bitwise equal to the composite and 2.8-3.3x faster than it eager, docs/reference/ops.md).
ROTARY_OP_DEVICES = frozenset({"cpu", "cuda"})


class RotaryEmbedding(nn.Module):
    """Rotate-half (non-interleaved) RoPE, the TabICLv2 flavour.

    ``freqs`` (``head_dim // 2`` values) is a non-trainable parameter, as in the reference
    state_dict. Positions are the 0-based token indices; they are generated in the input dtype
    (as the reference does) and the rotation itself is evaluated in fp32.
    """

    def __init__(self, head_dim: int, base: float):
        super().__init__()
        # Computed on the CPU and moved to the default device: arithmetic on ``meta`` (where
        # checkpoints build the model) runs torch's Python references, which import Dynamo.
        exponents = torch.arange(0, head_dim, 2, device="cpu")[: head_dim // 2].float() / head_dim
        freqs = (1.0 / (base**exponents)).to(torch.empty(0).device)
        self.freqs = nn.Parameter(freqs, requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        """x: ``(..., L, head_dim)`` with positions along ``L``; returns the rotated tensor.

        Eager calls on :data:`ROTARY_OP_DEVICES` run the one-pass operator
        ``tabserve.ops.rotary_embedding`` (bit for bit the composite below, one read and one
        write instead of six passes with float32 intermediates); compiled graphs keep the
        composite, which Inductor fuses with the head split around it.
        """
        cos, sin = self.tables(x.shape[-2], x.device, x.dtype)
        if x.device.type in ROTARY_OP_DEVICES and not torch.compiler.is_compiling():
            fused = _rotary_op()
            if fused is not None:
                return fused(x, cos, sin)
        return rotate_half(x, cos, sin)

    def tables(self, length: int, device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin ``[length, head_dim]`` (in the frequencies' dtype) of positions 0..length-1,
        generated in ``dtype`` as the reference does."""
        positions = torch.arange(length, device=device, dtype=dtype).to(self.freqs.dtype)
        angles = positions[:, None] * self.freqs[None, :]
        return torch.cat([angles.cos(), angles.cos()], dim=-1), torch.cat(
            [angles.sin(), angles.sin()], dim=-1
        )


def rotate_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE as ATen ops: ``x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin`` in the
    tables' precision, cast back to x's dtype (what ``tabserve::rotary_embedding`` fuses)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Multi-head attention with packed in-projection (``nn.MultiheadAttention`` parameter names).

    Optional QASSMax on the queries (after RoPE) with ``n`` = number of keys. No masks: train /
    test asymmetry is expressed by which tokens are passed as keys and values.
    """

    def __init__(self, dim: int, num_heads: int, qassmax: bool):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embedding dim {dim} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * dim))
        self.out_proj = nn.Linear(dim, dim)
        self.ssmax_layer = QASSMax(num_heads, self.head_dim) if qassmax else None
        #: The stage's kernel choices (:class:`~.stage_kernels.StageKernels`), handed over by a
        #: served model when it is built.
        self.kernels = DEFAULT_KERNELS

    @property
    def prefix_backend(self) -> str:
        """Kernel of padded attention (``tabserve.ops.prefix_attention``'s ``backend``)."""
        return self.kernels.prefix_backend

    @property
    def small_heads(self) -> bool:
        """Attention through :func:`tabserve.ops.small_head_attention` where it applies (CUDA,
        fp16 / bf16, head dimension 16)."""
        return self.kernels.small_heads

    @property
    def small_head_max_keys(self) -> int | None:
        """With :attr:`small_heads`: the most keys the kernel takes here (None: any number)."""
        return self.kernels.small_head_max_keys

    @property
    def flash_fp8(self) -> bool | None:
        """Unpadded attention through :func:`tabserve.ops.flash_attention` on fp8 (True) or
        half (False) operands; None: SDPA."""
        return self.kernels.flash_fp8

    @property
    def rope_in_projection(self) -> bool:
        """RoPE of queries and keys inside the fused LayerNorm + projection
        (:func:`tabserve.ops.norm_linear`'s ``rotary``) where that operator serves it."""
        return self.kernels.rope_in_projection

    def _split_heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(-3, -2)

    def _rope_in_kernel(self, rope: RotaryEmbedding, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """Attention with RoPE and no QASSMax (the row stage) on the head-dim-16 kernel, which
        rotates q and k itself from fp32 tables (shapes and dtypes only: static under
        compile)."""
        return self.rotates_keys_itself(rope) and self._kernel_takes(q, k, v)

    def _kernel_takes(self, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """Whether this layer's attention runs on :func:`tabserve.ops.small_head_attention`
        (shapes and dtypes only: static under compile)."""
        limit = self.small_head_max_keys
        return (
            self.small_heads
            and (limit is None or k.shape[-2] <= limit)
            and _small_head_kernel_applies(q, k, v)
        )

    def rotates_keys_itself(self, rope: RotaryEmbedding | None) -> bool:
        """Whether keys handed to :meth:`forward` had better come unrotated (``keys_rotated=
        False``): the head-dim-16 kernel may then rotate them as it loads them (the row stage's
        CLS block: its keys are every token of the row), saving a pass over them."""
        return (
            rope is not None
            and self.small_heads
            and not self.rope_in_projection
            and self.ssmax_layer is None
            and rope.freqs.dtype == torch.float32
        )

    def _project(self, x: Tensor, weight: Tensor, bias: Tensor, norm: nn.LayerNorm | None):
        """``linear(x)`` of normalised tokens, or with ``norm`` ``linear(norm(x))`` of raw ones:
        one pass of :func:`tabserve.ops.norm_linear` where its kernel applies (CUDA under
        fp16 / bf16 autocast), else the modules."""
        if norm is None:
            return F.linear(x, weight, bias)
        dtype = _autocast_matmul_dtype(x)
        if dtype is not None and _norm_linear_kernels().kernel_applies(x, weight, dtype):
            return _norm_linear_kernels().norm_linear_op(
                x, norm.weight, norm.bias, weight, bias, norm.eps, dtype
            )
        return F.linear(norm(x), weight, bias)

    def _project_rotating(
        self, x: Tensor, weight: Tensor, bias: Tensor, norm: nn.LayerNorm | None,
        rope: RotaryEmbedding | None, rotary_features: int,
    ) -> tuple[Tensor, bool]:  # fmt: skip
        """:meth:`_project`, and with :attr:`rope_in_projection` where the fused projection
        serves it, RoPE of its leading ``rotary_features`` outputs (heads at their positions
        along x's L axis) in the same pass. Returns the projection and whether they came
        rotated (shapes, dtypes and flags only: static under compile)."""
        dtype = _autocast_matmul_dtype(x)
        if (
            rope is None
            or norm is None
            or not self.rope_in_projection
            or dtype is None
            or not _norm_linear_kernels().kernel_applies(x, weight, dtype)
        ):
            return self._project(x, weight, bias, norm), False
        cos, sin = rope.tables(x.shape[-2], x.device, dtype)
        return _norm_linear_kernels().norm_linear_op(
            x, norm.weight, norm.bias, weight, bias, norm.eps, dtype, cos, sin, rotary_features
        ), True  # fmt: skip

    def project_kv(
        self, kv: Tensor, rope: RotaryEmbedding | None = None, norm: nn.LayerNorm | None = None
    ) -> KeyValue:
        """Head-split K and V of normalised tokens ``(..., L, E)`` (raw ones with ``norm``)."""
        dim = kv.shape[-1]
        weight, bias = self.in_proj_weight[dim:], self.in_proj_bias[dim:]
        kv_out, rotated = self._project_rotating(kv, weight, bias, norm, rope, dim)
        # K and V stay head-split views of the one packed projection, in a KV cache too:
        # contiguous copies made KV-cached predictions slower (H100, ready preset, 1 / 16 /
        # 100 rows of a 10,000-row table: 9.15 / 8.39 / 9.68 ms against 6.31 / 5.55 / 6.89).
        k, v = (self._split_heads(t) for t in kv_out.chunk(2, dim=-1))
        if rope is not None and not rotated:
            k = rope(k)
        return k, v

    def forward(
        self,
        q: Tensor,
        kv: KeyValue | None = None,
        rope: RotaryEmbedding | None = None,
        n_keys: Tensor | None = None,
        norm: nn.LayerNorm | None = None,
        keys_rotated: bool = True,
        project_out: bool = True,
    ) -> Tensor:
        """q: normalised query tokens ``(..., Lq, E)`` (raw ones with ``norm``, which the
        projections then apply); kv from ``project_kv`` (broadcastable), or None for
        self-attention over ``q``. ``keys_rotated=False``: kv's keys come without RoPE
        (``project_kv`` without ``rope``, see :meth:`rotates_keys_itself`), and are rotated here,
        in the head-dim-16 kernel where it applies.

        ``n_keys`` (padded serving): a 0-d integer tensor on q's device; only the first n keys
        are real (the rest is bucket padding). Attention then runs over those n keys and QASSMax
        uses ln n, through :func:`tabserve.ops.prefix_attention` / ``qassmax_scale``, so the
        shapes stay the bucket's and n never reaches the host.

        ``project_out=False``: the heads' merged output before ``out_proj`` (a caller that
        folds the out-projection into what follows).
        """
        dim = q.shape[-1]
        weight, bias = self.in_proj_weight, self.in_proj_bias
        if kv is None:  # one packed projection, as the reference's self-attention does
            packed, rotated = self._project_rotating(q, weight, bias, norm, rope, 2 * dim)
            query, k, v = (self._split_heads(t) for t in packed.chunk(3, -1))
            keys_rotated = query_rotated = rotated  # (queries and keys lead the packing)
        else:
            projected, query_rotated = self._project_rotating(
                q, weight[:dim], bias[:dim], norm, rope, dim
            )
            query = self._split_heads(projected)
            k, v = kv
        fused_rope = None  # RoPE tables handed to the head-dim-16 kernel instead
        if rope is not None and not keys_rotated:
            if not query_rotated and self._rope_in_kernel(rope, query, k, v):
                # Queries sit at positions 0..Lq-1, as rope(query) puts them.
                length = max(query.shape[-2], k.shape[-2])
                fused_rope = rope.tables(length, query.device, query.dtype)
            else:
                k = rope(k)
        if rope is not None and fused_rope is None and not query_rotated:
            query = rope(query)
        per_table = n_keys is not None and n_keys.dim() == 1
        if self.ssmax_layer is not None and not per_table:
            # Before broadcasting: the scale depends only on the query and the number of keys.
            query = (
                self.ssmax_layer(query, k.shape[-2])
                if n_keys is None
                else _padded_ops().qassmax_scale(
                    query, n_keys, self.ssmax_layer.base_mlp, self.ssmax_layer.query_mlp
                )
            )
        batch_shape = broadcast_batch(query.shape[:-3], k.shape[:-3])
        query = query.expand(*batch_shape, *query.shape[-3:]).reshape(-1, *query.shape[-3:])
        k = k.expand(*batch_shape, *k.shape[-3:]).reshape(-1, *k.shape[-3:])
        v = v.expand(*batch_shape, *v.shape[-3:]).reshape(-1, *v.shape[-3:])
        if per_table:
            n_keys = per_batch_counts(n_keys, batch_shape)
            if self.ssmax_layer is not None:  # per table: after broadcasting, with its n
                query = _padded_ops().qassmax_scale(
                    query, n_keys, self.ssmax_layer.base_mlp, self.ssmax_layer.query_mlp
                )
        if self._kernel_takes(query, k, v):
            out = _padded_ops().small_head_attention(query, k, v, n_keys, rotary=fused_rope)
        elif n_keys is None and self.flash_fp8 is not None:
            out = _flash_attention_op()(query, k, v, self.flash_fp8)
        elif n_keys is None:
            out = batched_sdpa(query, k, v)
        else:
            out = prefix_sdpa(query, k, v, n_keys, self.prefix_backend)
        out = out.view(*batch_shape, *out.shape[-3:]).transpose(-3, -2).flatten(-2)
        return self.out_proj(out) if project_out else out




def broadcast_batch(a: Sequence[int], b: Sequence[int]) -> tuple:
    """``torch.broadcast_shapes(a, b)`` of two batch shapes. Eager, torch's own builds its
    symbolic-shape machinery at its first call: 0.66 s on the CPU, and 2.8 of the 3.3 s of a
    fresh process's first predict on the H200 (cProfile). Traced, torch's own (it guards sizes
    without specialising them)."""
    if torch.compiler.is_compiling():
        return tuple(torch.broadcast_shapes(a, b))
    width = max(len(a), len(b))
    a, b = (1,) * (width - len(a)) + tuple(a), (1,) * (width - len(b)) + tuple(b)
    if any(x != y and 1 not in (x, y) for x, y in zip(a, b)):
        raise RuntimeError(f"batch shapes {a} and {b} do not broadcast")
    return tuple(y if x == 1 else x for x, y in zip(a, b))


#: On the CPU the column and row stages run in chunks of at most this many cells / tokens,
#: whatever their own budget: a chunk's activations (16 MiB for the widest, the feed-forward
#: hidden layer) stay in the allocator's heap and are reused, where a whole stage's activations
#: of hundreds of MiB are mapped afresh, faulted in and zeroed by the kernel at every operator.
#: 2-core AMD EPYC, full-size model, exact recipe, 8 members, two fits + predicts in a fresh
#: process: 600 + 150 rows of 30 features 30.3 s and 1.17 GiB peak against 36.1 s and 1.47 GiB
#: in one pass (medians of 3, answers bit for bit the same); 1,000 + 200 rows of 50 features
#: 58.0 s and 1.53 GiB against 80.2 s and 2.33 GiB (one run each). Single runs of chunks of
#: 2**12 to 2**16 took 28-32 s on the first table.
HOST_CHUNK_TOKENS = 1 << 13


def chunk_budget(budget: int, device: torch.device) -> int:
    """A stage's chunk budget on ``device``: at most :data:`HOST_CHUNK_TOKENS` on the CPU."""
    return min(budget, HOST_CHUNK_TOKENS) if device.type == "cpu" else budget


def chunk_slices(length: int, cost_per_item: int, budget: int) -> list:
    """Slices covering ``range(length)`` whose items cost at most ``budget`` together (at least
    one item per slice); ``[slice(None)]`` when everything fits. Shapes only, never data: a
    compiled or captured graph holds the chunking fixed."""
    step = max(1, budget // max(1, cost_per_item))
    if length <= step:
        return [slice(None)]
    return [slice(i, i + step) for i in range(0, length, step)]


def per_batch_counts(counts: Tensor, batch_shape: Sequence[int]) -> Tensor:
    """A count per table ``(B,)`` (tables of several sizes packed on one bucket) as one count
    per entry of the flattened ``batch_shape``, whose leading dimension is the tables'."""
    if len(batch_shape) == 0 or batch_shape[0] != counts.shape[0]:
        raise ValueError(
            f"per-table counts of {counts.shape[0]} tables for attention batch {tuple(batch_shape)}"
        )
    leading = counts.view(-1, *[1] * (len(batch_shape) - 1))
    return leading.expand(*batch_shape).reshape(-1)


def _in_cuda_batch_chunks(attend, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``attend(q, k, v)`` over ``(B, heads, L, D)``, in batch chunks of at most 65,535 on CUDA:
    the fused kernels (flash, varlen flash, memory-efficient) put the batch on a grid dimension
    of that limit and fail to launch beyond it; the row stage's batch is tables x rows (8 x
    10,240 on the large workload, seen on the H200 with flash forced). One call wherever the
    batch fits. Chunk bounds are shapes, not data: a compiled or captured graph holds them."""
    chunks = chunk_slices(q.shape[0], 1, MAX_GRID_BATCH)
    if q.device.type != "cuda" or len(chunks) == 1:
        return attend(q, k, v)
    return torch.cat([attend(q[c], k[c], v[c]) for c in chunks])


def batched_sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``F.scaled_dot_product_attention`` within the CUDA batch limit."""
    return _in_cuda_batch_chunks(F.scaled_dot_product_attention, q, k, v)


@functools.cache
def extension_ops():
    """``tabserve.ops``, or None without the compiled extension (the unpadded model then runs
    on ATen ops alone, as it always could)."""
    try:
        return _padded_ops()
    except (ImportError, OSError):
        return None


@functools.cache
def _rotary_op():
    """``tabserve.ops.rotary_embedding``, or None without the compiled extension."""
    ops = extension_ops()
    return None if ops is None else ops.rotary_embedding


def _small_head_kernel_applies(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether :func:`tabserve.ops.small_head_attention` serves these operands (shapes and
    dtypes only: static under compile)."""
    return (
        q.device.type == "cuda"
        and q.shape[-1] == 16
        and q.dtype in (torch.float16, torch.bfloat16)
        and k.dtype == q.dtype
        and v.dtype == q.dtype
    )


# The kernel modules load Triton and register their operators (torch.library.triton_op pulls in
# Inductor): seconds of import that only a fused call needs, so they load at the first one.
def _feed_forward_kernels():
    from tabserve.kernels import feed_forward

    return feed_forward


def _norm_linear_kernels():
    from tabserve.kernels import norm_linear

    return norm_linear


def load_kernels() -> None:
    """Loads every kernel module now: a served model whose options may call them does, so that
    their operators are registered before anything traces a call."""
    from tabserve.kernels import feed_forward, flash_attention, norm_linear  # noqa: F401


def _flash_attention_op():
    from tabserve.kernels.flash_attention import flash_attention_op

    return flash_attention_op


def _padded_ops():
    # Imported lazily: the reference-parity path must not need the compiled extension.
    from tabserve import ops

    return ops


def prefix_sdpa(q: Tensor, k: Tensor, v: Tensor, n_keys: Tensor, backend: str = "auto") -> Tensor:
    """SDPA of ``q (B, heads, Lq, D)`` over the first ``n_keys`` keys of ``k``/``v``
    (:func:`tabserve.ops.prefix_attention`), within the CUDA batch limit."""
    if n_keys.dim() == 1 and q.device.type == "cpu":
        # A count per table on the CPU: one masked SDPA. The CPU operator attends entry by entry
        # over its sliced keys, 70 of 80 s of 30 packed tiny tables' call on 2 cores.
        real = torch.arange(k.shape[-2], device=q.device) < n_keys[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=real[:, None, None, :])
    prefix_attention = _padded_ops().prefix_attention
    chunks = chunk_slices(q.shape[0], 1, MAX_GRID_BATCH)
    if n_keys.dim() == 0 or q.device.type != "cuda" or len(chunks) == 1:
        return _in_cuda_batch_chunks(
            lambda q, k, v: prefix_attention(q, k, v, n_keys, backend=backend), q, k, v
        )
    return torch.cat(
        [prefix_attention(q[c], k[c], v[c], n_keys[c], backend=backend) for c in chunks]
    )


class AttentionBlock(nn.Module):
    """Pre-LN transformer block: ``x = q + MHA(LN1(q), LN1(kv)); x = x + FFN(LN2(x))``.

    The same ``norm1`` normalises queries and keys/values; the residual is added to the raw query
    tokens. FFN = ``linear2(gelu(linear1(.)))`` with the exact (erf) GELU.
    """

    def __init__(self, dim: int, num_heads: int, ff_dim: int, ln_bias: bool, qassmax: bool = False):
        super().__init__()
        self.linear1 = nn.Linear(dim, ff_dim)
        self.linear2 = nn.Linear(ff_dim, dim)
        self.norm1 = nn.LayerNorm(dim, bias=ln_bias)
        self.norm2 = nn.LayerNorm(dim, bias=ln_bias)
        self.attn = Attention(dim, num_heads, qassmax)
        #: The stage's kernel choices (:class:`~.stage_kernels.StageKernels`).
        self.kernels = DEFAULT_KERNELS

    @property
    def fused_feed_forward(self) -> bool:
        """Feed-forward half through :func:`tabserve.ops.feed_forward` where its kernel applies
        (CUDA under fp16 / bf16 autocast, width <= 128)."""
        return self.kernels.fused_ffn

    @property
    def fused_norm_linear(self) -> bool:
        """LayerNorm 1 and the input projections through :func:`tabserve.ops.norm_linear` where
        its kernel applies (same conditions)."""
        return self.kernels.fused_norm_linear

    @property
    def fused_out_projection(self) -> bool:
        """With :attr:`fused_feed_forward`: the attention's out-projection folded into the fused
        feed-forward operator (its ``update_weight``) where it applies."""
        return self.kernels.fused_out_projection

    def _projection_norm(self, x: Tensor) -> nn.LayerNorm | None:
        """``norm1`` when the projections of ``x`` normalise it themselves (fused), else None:
        then ``x`` is normalised first, as the modules do."""
        if not self.fused_norm_linear:
            return None
        dtype = _autocast_matmul_dtype(x)
        weight = self.attn.in_proj_weight
        applies = dtype is not None and _norm_linear_kernels().kernel_applies(x, weight, dtype)
        return self.norm1 if applies else None

    def key_value(self, kv: Tensor, rope: RotaryEmbedding | None = None) -> KeyValue:
        """K/V projections this block attends to, for raw (un-normalised) tokens ``kv``."""
        norm = self._projection_norm(kv)
        kv_in = kv if norm is not None else matmul_input(self.norm1, kv)
        return self.attn.project_kv(kv_in, rope, norm)

    def forward(
        self,
        q: Tensor,
        kv: Tensor | None = None,
        *,
        cached_kv: KeyValue | None = None,
        kv_rows: int | None = None,
        rope: RotaryEmbedding | None = None,
        return_kv: bool = False,
        n_keys: Tensor | None = None,
        skip: Tensor | None = None,
        row_prefix: Tensor | None = None,
    ):
        """Attend from raw query tokens ``q (..., Lq, E)``.

        Keys/values come from ``cached_kv`` if given, else from ``kv`` (raw tokens), else from the
        first ``kv_rows`` tokens of ``q`` (all of them if None: self-attention). With
        ``return_kv`` also returns the K/V pair used. ``n_keys``: padded keys, see
        :meth:`Attention.forward`. ``skip``: bool over ``q``'s leading dims (without Lq, E):
        the outputs of each marked set are ``SKIP_VALUE`` (see :meth:`feed_forward`).
        ``row_prefix``: the output laid out as rows led by these tokens (see
        :meth:`feed_forward`).
        """
        norm = self._projection_norm(q)  # fused: the projections normalise q themselves
        q_in = q if norm is not None else matmul_input(self.norm1, q)
        keys_rotated = True
        if cached_kv is not None:
            keys_values = cached_kv
        elif kv_rows is not None:
            keys_values = self.attn.project_kv(q_in[..., :kv_rows, :], rope, norm)
        elif kv is None:
            keys_values = self.attn.project_kv(q_in, rope, norm) if return_kv else None
        else:
            # Unrotated keys where the attention kernel rotates them itself (never returned:
            # a caller's cache holds rotated keys).
            keys_rotated = return_kv or not self.attn.rotates_keys_itself(rope)
            keys_values = self.key_value(kv, rope if keys_rotated else None)
        fold = self._folds_out_projection(q)
        update = self.attn(
            q_in, keys_values, rope, n_keys, norm, keys_rotated=keys_rotated, project_out=not fold
        )
        if fold and update.shape != q.shape:  # broadcast queries: projected before the sum
            update, fold = self.attn.out_proj(update), False
        x = self.feed_forward(q, update, skip, self.attn.out_proj if fold else None, row_prefix)
        return (x, keys_values) if return_kv else x

    def _folds_out_projection(self, x: Tensor) -> bool:
        """Whether the fused feed-forward operator takes the attention's out-projection too
        (:attr:`fused_out_projection`; shapes and dtypes only: static under compile)."""
        if not (self.fused_out_projection and self.fused_feed_forward):
            return False
        dtype = _autocast_matmul_dtype(x)
        return dtype is not None and _feed_forward_kernels().kernel_applies(x, None, self.linear1.weight, dtype)

    def feed_forward(
        self,
        x: Tensor,
        update: Tensor | None = None,
        skip: Tensor | None = None,
        out_proj: nn.Linear | None = None,
        row_prefix: Tensor | None = None,
    ) -> Tensor:
        """``s + FFN(LN2(s))`` with ``s = x (+ update)``; with :attr:`fused_feed_forward` in one
        pass of the fused operator (same roundings as autocast), else as the modules. ``skip``
        (bool over x's leading dims, without the token and embedding dims): the outputs of each
        marked set are ``SKIP_VALUE``, written by the fused operator itself. ``out_proj``: the
        update is the attention's output before its out-projection, which the fused operator
        applies itself (the modules: first). ``row_prefix`` ``(P, E)``, for x ``(B, S, L, E)``:
        the output is ``(B, L, P + S, E)``, rows of the prefix's tokens and then the sets'
        (:func:`tabserve.ops.feed_forward`'s layout; the fused operator writes it directly)."""
        if update is not None and update.shape != x.shape:  # broadcast queries (inducing points)
            update = update if out_proj is None else out_proj(update)
            x, update, out_proj = x + update, None, None
        dtype = _autocast_matmul_dtype(x) if self.fused_feed_forward else None
        if dtype is not None and _feed_forward_kernels().kernel_applies(x, update, self.linear1.weight, dtype):
            norm, linear1, linear2 = self.norm2, self.linear1, self.linear2
            projection = (None, None) if out_proj is None else (out_proj.weight, out_proj.bias)
            return _feed_forward_kernels().feed_forward(
                x, update, norm.weight, norm.bias, linear1.weight, linear1.bias,
                linear2.weight, linear2.bias, norm.eps, dtype, skip, SKIP_VALUE, *projection,
                row_prefix,
            )  # fmt: skip
        if out_proj is not None:
            update = out_proj(update)
        if _resident_serves(x, update, self.linear1.weight):
            return to_rows(self._feed_forward_resident(x, update, skip), row_prefix)
        if update is not None:
            x = x + update
        out = x + self.linear2(F.gelu(self.linear1(matmul_input(self.norm2, x))))
        if skip is not None:
            out = out.masked_fill_(skip[..., None, None], SKIP_VALUE)  # one pass, in place
        return to_rows(out, row_prefix)

    def _feed_forward_resident(self, x: Tensor, update: Tensor | None, skip: Tensor | None):
        """The unfused feed-forward half on :func:`tabserve.ops.feed_forward_resident` (see
        :func:`_resident_serves`)."""
        dtype = _autocast_matmul_dtype(x)
        norm, linear1, linear2 = self.norm2, self.linear1, self.linear2
        return _padded_ops().feed_forward_resident(
            x, norm.weight, norm.bias, linear1.weight.to(dtype), linear1.bias.to(dtype),
            linear2.weight.to(dtype), linear2.bias.to(dtype), norm.eps, update, skip, SKIP_VALUE,
        )  # fmt: skip


#: Token widths :func:`tabserve.ops.layer_norm_cast`'s CUDA kernel serves (one warp per row).
LAYER_NORM_CAST_WIDTHS = (128, 256, 512, 1024)


def _eager_cuda_autocast(x: Tensor) -> torch.dtype | None:
    """The autocast dtype of an eager call on a CUDA tensor (None under torch.compile's
    tracing, where Inductor fuses LayerNorms, casts and residual sums into kernels of its own,
    without autocast, or off CUDA).

    Where it is set the blocks run tabserve's C++ kernels instead of the modules
    (:func:`matmul_input`, :func:`_resident_serves`). On an H100 (full-size model, the ready
    preset ``medium``, ``scripts/device/kernels_ab.py``) that made a fit + predict of the
    estimator suite's small, mixed, wide-rows, many-class and regression tables 1.13x, 1.21x,
    1.27x, 1.19x and 1.26x faster, 48 small tables packed in one call 1.22x and their loop of
    fresh estimators 1.17x, answers within 7.3e-4 of the modules' (fp16 roundings)."""
    if x.device.type != "cuda" or torch.compiler.is_compiling():
        return None
    return _autocast_matmul_dtype(x)


def matmul_input(norm: nn.LayerNorm, x: Tensor) -> Tensor:
    """``norm(x)`` for matmuls to read. Under autocast on CUDA (eager), an fp32 stream of a
    width :data:`LAYER_NORM_CAST_WIDTHS` holds is normalised and rounded to the autocast dtype
    in one pass of :func:`tabserve.ops.layer_norm_cast`: autocast's fp32 LayerNorm and the
    matmul's cast of its output, the same roundings (up to the summation order) in 6 bytes per
    value moved instead of 14. Elsewhere the module."""
    dtype = _eager_cuda_autocast(x)
    if (
        dtype is None
        or x.dtype != torch.float32
        or x.shape[-1] not in LAYER_NORM_CAST_WIDTHS
        or not _built("layer_norm_cast")
    ):
        return norm(x)
    return _padded_ops().layer_norm_cast(x, norm.weight, norm.bias, norm.eps, dtype)


def _resident_serves(x: Tensor, update: Tensor | None, w1: Tensor) -> bool:
    """Whether an unfused feed-forward half runs on :func:`tabserve.ops.feed_forward_resident`:
    under autocast on CUDA (eager, sm80+), at its one shape (width 128, FFN width 256: the
    column and row stages). That C++ kernel computes autocast's roundings (another summation
    order) in one read and one write of the stream, where the modules make eight passes, and
    it is built with the package: nothing compiles at its first call, unlike the Triton
    operator that ``fused_ffn`` adds for the other shapes."""
    dtype = _eager_cuda_autocast(x)
    return (
        dtype is not None
        and x.shape[-1] == RESIDENT_DIM
        and tuple(w1.shape) == (RESIDENT_HIDDEN, RESIDENT_DIM)
        and x.dtype in (torch.float32, dtype)
        and (update is None or update.dtype == dtype)
        and _sm80(x.device)
        and _built("feed_forward_resident")
    )


@functools.cache
def _sm80(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


@functools.cache
def _built(op: str) -> bool:
    """Whether this build of the extension has ``tabserve::<op>``'s CUDA kernel (a build
    without nvcc has the CPU kernels only)."""
    _padded_ops()  # loads the library
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"tabserve::{op}", "CUDA")


def _autocast_matmul_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype autocast runs ``x``'s matmuls in (None without autocast on its device)."""
    device = x.device.type
    if device not in ("cuda", "cpu") or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)
