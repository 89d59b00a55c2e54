"""Fake kernels and documented Python wrappers of the `torch.ops.tabserve` operators.

The schemas, CPU kernels and CUDA kernels live in csrc/ops/<family>.cpp and
csrc/ops/cuda/<family>.cu; docs/reference/ops.md gives every operator's contract. The fake
kernels here describe output shapes and dtypes so that torch.compile, torch.export and opcheck can
trace the operators without running them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

# The (width, FFN width) feed_forward_resident serves, defined in a module that imports nothing:
# kernels/feed_forward.py reads it from there too, and never imports this module.
from tabserve.kernels._resident import RESIDENT_DIM, RESIDENT_HIDDEN

#: Hash bits kept in production. Tests pass fewer to force hash collisions.
FULL_HASH_BITS = 64


def table_capacity(rows: int) -> int:
    """Slots of the table built for ``rows`` vocabulary rows: max(16, next power of two >= 2 rows).

    Mirrors ``core::table_capacity`` (csrc/core/string_hash.h); a test checks they agree.
    """
    capacity = 16
    while capacity < 2 * rows:
        capacity *= 2
    return capacity


def _same_device(op: str, **tensors) -> None:
    """Refuses tensor arguments on different devices, as the real kernels do.

    Tensors of a real device mixed with meta tensors dispatch to the fake kernel itself (Meta
    outranks CPU and CUDA), which without this check would return uninitialised real memory.
    Lists (Tensor[]) and None entries are accepted.
    """
    named = []
    for name, value in tensors.items():
        if isinstance(value, (list, tuple)):
            named += [(f"{name}[{i}]", t) for i, t in enumerate(value) if isinstance(t, Tensor)]
        elif isinstance(value, Tensor):
            named.append((name, value))
    first, device = named[0][0], named[0][1].device
    for name, t in named[1:]:
        if t.device != device:
            raise RuntimeError(
                f"tabserve::{op}: {name} is on {t.device} but {first} is on {device}"
            )


# ---------------------------------------------------------------------------------------------
# String lookup (csrc/ops/string_lookup.cpp, csrc/ops/cuda/string_lookup.cu)

_LOOKUP_TENSORS = ("vocabulary_data", "vocabulary_offsets", "vocabulary_segments", "slot_hash")
_LOOKUP_TENSORS += ("slot_row", "query_data", "query_offsets", "query_valid")


def _same_lookup_device(op: str, arguments: dict, *more: str) -> None:
    """:func:`_same_device` over a lookup fake's tensor arguments (``arguments``: its
    ``locals()``): the common ones, then the names in ``more``."""
    _same_device(op, **{name: arguments[name] for name in _LOOKUP_TENSORS + more})


@torch.library.register_fake("tabserve::string_index_build")
def _string_index_build_fake(
    vocabulary_data, vocabulary_offsets, vocabulary_valid, vocabulary_segments, hash_bits=64
):
    _same_device(
        "string_index_build",
        vocabulary_data=vocabulary_data,
        vocabulary_offsets=vocabulary_offsets,
        vocabulary_valid=vocabulary_valid,
        vocabulary_segments=vocabulary_segments,
    )
    rows = vocabulary_offsets.shape[0] - 1
    if isinstance(rows, int):
        capacity = table_capacity(rows)
    else:  # symbolic vocabulary size: the capacity is a data-independent but opaque function
        capacity = torch.library.get_ctx().new_dynamic_size(min=16)
    return (
        vocabulary_offsets.new_empty(capacity),
        vocabulary_offsets.new_empty(capacity),
    )


@torch.library.register_fake("tabserve::string_lookup")
def _string_lookup_fake(
    vocabulary_data,
    vocabulary_offsets,
    vocabulary_segments,
    slot_hash,
    slot_row,
    query_data,
    query_offsets,
    query_valid,
    column=0,
    hash_bits=64,
    check_offsets=True,
):
    _same_lookup_device("string_lookup", locals())
    return query_offsets.new_empty(query_offsets.shape[0] - 1, dtype=torch.int64)


@torch.library.register_fake("tabserve::string_lookup_multi")
def _string_lookup_multi_fake(
    vocabulary_data,
    vocabulary_offsets,
    vocabulary_segments,
    slot_hash,
    slot_row,
    query_data,
    query_offsets,
    query_valid,
    hash_bits=64,
    check_offsets=True,
):
    _same_lookup_device("string_lookup_multi", locals())
    rows = sum(offsets.shape[0] - 1 for offsets in query_offsets)
    return vocabulary_offsets.new_empty(rows, dtype=torch.int64)


@torch.library.register_fake("tabserve::dictionary_lookup")
def _dictionary_lookup_fake(
    vocabulary_data,
    vocabulary_offsets,
    vocabulary_segments,
    slot_hash,
    slot_row,
    query_data,
    query_offsets,
    query_valid,
    codes,
    code_columns=None,
    hash_bits=64,
    check_offsets=True,
):
    _same_lookup_device("dictionary_lookup", locals(), "codes")
    # The real kernels' checks of what the trace knows (column counts are static).
    if codes.dtype != torch.int64 or codes.dim() != 2:
        raise RuntimeError(
            f"codes must be a 2-D int64 tensor, got {codes.dtype} {tuple(codes.shape)}"
        )
    if len(query_data) != len(query_offsets) or len(query_data) != len(query_valid):
        raise RuntimeError(
            "query_data, query_offsets and query_valid must each hold one entry per column"
        )
    if code_columns is not None and len(code_columns) != len(query_data):
        raise RuntimeError("code_columns must hold one entry per query column")
    return codes.new_empty((codes.shape[0], len(query_data)))


def string_index_build(
    vocabulary_data: Tensor,
    vocabulary_offsets: Tensor,
    vocabulary_valid: Tensor | None,
    vocabulary_segments: Tensor,
    hash_bits: int = FULL_HASH_BITS,
) -> tuple[Tensor, Tensor]:
    """Builds the hash table of a packed string vocabulary.

    Args:
        vocabulary_data: uint8 [bytes], the labels' bytes.
        vocabulary_offsets: int64 [rows + 1], non-decreasing, within [0, bytes]; row i is
            ``data[offsets[i]:offsets[i + 1]]``. The first offset need not be 0.
        vocabulary_valid: bool [rows] or None; null rows never match.
        vocabulary_segments: int64 [columns + 1], on the same device: column c owns rows
            ``[segments[c], segments[c + 1])``; ``segments[0] == 0`` and ``segments[-1] == rows``.
        hash_bits: low hash bits kept, in [0, 64]; fewer than 64 only to force collisions in tests.

    Returns:
        ``(slot_hash, slot_row)``, int64 [capacity] on the vocabulary's device,
        capacity = :func:`table_capacity` (rows).

    Raises:
        RuntimeError naming the argument for wrong dtypes, ranks, devices, decreasing offsets,
        offsets past the data or malformed segments. On CUDA the checks synchronise once.
    """
    return torch.ops.tabserve.string_index_build(
        vocabulary_data, vocabulary_offsets, vocabulary_valid, vocabulary_segments, hash_bits
    )


def string_lookup(
    vocabulary_data: Tensor,
    vocabulary_offsets: Tensor,
    vocabulary_segments: Tensor,
    slot_hash: Tensor,
    slot_row: Tensor,
    query_data: Tensor,
    query_offsets: Tensor,
    query_valid: Tensor | None = None,
    column: int = 0,
    hash_bits: int = FULL_HASH_BITS,
    check_offsets: bool = True,
) -> Tensor:
    """Codes of one query column in vocabulary column ``column``.

    Returns int64 [query rows] on the vocabulary's device: the label's position in that column's
    vocabulary (the last position when it repeats), -1 for unknown labels and null queries.
    ``check_offsets`` verifies the query offsets (CPU: a scan; CUDA: one reduction and one host
    synchronisation, skipped during CUDA graph capture). With it off, malformed offsets give
    unspecified codes but never out-of-bounds reads.
    """
    return torch.ops.tabserve.string_lookup(
        vocabulary_data,
        vocabulary_offsets,
        vocabulary_segments,
        slot_hash,
        slot_row,
        query_data,
        query_offsets,
        query_valid,
        column,
        hash_bits,
        check_offsets,
    )


def string_lookup_multi(
    vocabulary_data: Tensor,
    vocabulary_offsets: Tensor,
    vocabulary_segments: Tensor,
    slot_hash: Tensor,
    slot_row: Tensor,
    query_data: Sequence[Tensor],
    query_offsets: Sequence[Tensor],
    query_valid: Sequence[Tensor | None],
    hash_bits: int = FULL_HASH_BITS,
    check_offsets: bool = True,
) -> Tensor:
    """Codes of query column c in vocabulary column c, for every column, in one call.

    The three query lists hold one entry per vocabulary column. Returns int64
    [sum of query rows], the columns' codes concatenated in column order (CUDA: one kernel launch
    per 32 columns).
    """
    return torch.ops.tabserve.string_lookup_multi(
        vocabulary_data,
        vocabulary_offsets,
        vocabulary_segments,
        slot_hash,
        slot_row,
        list(query_data),
        list(query_offsets),
        list(query_valid),
        hash_bits,
        check_offsets,
    )


def dictionary_lookup(
    vocabulary_data: Tensor,
    vocabulary_offsets: Tensor,
    vocabulary_segments: Tensor,
    slot_hash: Tensor,
    slot_row: Tensor,
    query_data: Sequence[Tensor],
    query_offsets: Sequence[Tensor],
    query_valid: Sequence[Tensor | None],
    codes: Tensor,
    code_columns: Sequence[int] | None = None,
    hash_bits: int = FULL_HASH_BITS,
    check_offsets: bool = True,
) -> Tensor:
    """Vocabulary codes of dictionary-encoded columns, every column in one call.

    Query column c holds the categories of a dictionary-encoded column whose rows carry codes
    ``codes[:, code_columns[c]]`` (``codes`` int64 [rows, code columns], any strides;
    ``code_columns`` None: column c). Returns int64 [rows, query columns]: the code of each row's
    category in vocabulary column c (as :func:`string_lookup_multi` gives it), -1 for unknown
    categories and for row codes outside [0, rows of query column c) (nulls). CUDA: one lookup
    launch per 32 columns and one gather launch per 128 columns, no host synchronisation.
    """
    return torch.ops.tabserve.dictionary_lookup(
        vocabulary_data,
        vocabulary_offsets,
        vocabulary_segments,
        slot_hash,
        slot_row,
        list(query_data),
        list(query_offsets),
        list(query_valid),
        codes,
        None if code_columns is None else list(code_columns),
        hash_bits,
        check_offsets,
    )


# ---------------------------------------------------------------------------------------------
# Padded tables: bucket padding, prefix attention, QASSMax scaling
# (csrc/ops/padding.cpp, csrc/ops/cuda/padding.cu; bucket maths in csrc/core/bucket_grid.h)

#: Backends of :func:`prefix_attention` on CUDA (CPU always computes exact math).
ATTENTION_BACKENDS = ("auto", "flash", "efficient", "masked")


@torch.library.register_fake("tabserve::pad_to_bucket")
def _pad_to_bucket_fake(x, n_train, train_bucket, test_bucket, feature_bucket, fill=0.0):
    return x.new_empty((x.shape[0], train_bucket + test_bucket, feature_bucket))


@torch.library.register_fake("tabserve::pad_labels")
def _pad_labels_fake(y_train, train_bucket, fill=0.0):
    return y_train.new_empty((*y_train.shape[:-1], train_bucket))


@torch.library.register_fake("tabserve::prefix_attention")
def _prefix_attention_fake(q, k, v, n_keys, scale=None, backend="auto"):
    _same_device("prefix_attention", q=q, k=k, v=v, n_keys=n_keys)
    batch, heads, queries, _ = q.shape
    return q.new_empty((batch, queries, heads, v.shape[-1])).transpose(1, 2)


@torch.library.register_fake("tabserve::qassmax_scale")
def _qassmax_scale_fake(q, n_keys, *weights):
    _same_device("qassmax_scale", q=q, n_keys=n_keys, weights=weights)
    return torch.empty_like(q)


def pad_to_bucket(
    x: Tensor,
    n_train: int,
    train_bucket: int,
    test_bucket: int,
    feature_bucket: int,
    fill: float = 0.0,
) -> Tensor:
    """Pads a table onto its bucket in one pass.

    Args:
        x: [tables, n_train + n_test, features], any dtype, CPU or CUDA; its first ``n_train``
            rows are the train rows, the others the test rows.
        n_train: the real number of train rows, in [0, rows of x].
        train_bucket, test_bucket, feature_bucket: the bucket's sizes; each must hold its part
            (``train_bucket >= n_train``, ``test_bucket >= n_test``,
            ``feature_bucket >= features``).
        fill: value of padded rows and features.

    Returns:
        [tables, train_bucket + test_bucket, feature_bucket] with the train rows at
        ``[0, n_train)`` and the test rows at ``[train_bucket, train_bucket + n_test)``. When x
        already has that layout (``n_train == train_bucket``, ``n_test == test_bucket``,
        ``features == feature_bucket``) x itself is returned, without a copy.

    Raises:
        RuntimeError naming the argument when x is not 3-D or a bucket is too small.
    """
    if (
        x.dim() == 3
        and n_train == train_bucket
        and x.shape[1] == train_bucket + test_bucket
        and x.shape[2] == feature_bucket
    ):
        return x
    return torch.ops.tabserve.pad_to_bucket(
        x, n_train, train_bucket, test_bucket, feature_bucket, fill
    )


def pad_labels(y_train: Tensor, train_bucket: int, fill: float = 0.0) -> Tensor:
    """Pads train labels ``[..., n_train]`` to ``[..., train_bucket]`` with ``fill``.

    Returns y_train itself when ``n_train == train_bucket``. Raises RuntimeError when
    ``train_bucket < n_train``.
    """
    if y_train.dim() >= 1 and y_train.shape[-1] == train_bucket:
        return y_train
    return torch.ops.tabserve.pad_labels(y_train, train_bucket, fill)


def prefix_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    n_keys: Tensor,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """Attention of every query over the first ``n_keys`` keys, n read from a tensor.

    Equals ``F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], scale=scale)`` while
    its shapes stay those of the padded bucket, so one compiled or captured graph serves every n.

    Args:
        q: [B, heads, Lq, D]; k: [B, heads, Lk, D]; v: [B, heads, Lk, Dv]; one floating dtype,
            one device.
        n_keys: int32 or int64, 0-d (one n for all) or [B], on q's device, in [1, Lk]. CPU
            checks the range; CUDA clamps into it (checking would synchronise with the host).
        scale: softmax scale, default 1 / sqrt(D).
        backend: CUDA kernel, one of :data:`ATTENTION_BACKENDS`. ``"auto"``: varlen flash
            (``seqused_k``) for fp16/bf16 with D a multiple of 8 up to 256 and Dv == D, else the
            memory-efficient kernel (``seqlen_k``); ``"masked"``: SDPA with a boolean key mask
            (cuDNN or efficient, picked by PyTorch). CPU ignores it and computes SDPA on the
            sliced keys in fp32 (fp64 for fp64 inputs).

    Returns:
        [B, heads, Lq, Dv] in q's dtype, stored as [B, Lq, heads, Dv] (a transposed view, as
        SDPA's flash path returns). No host synchronisation on CUDA: CUDA-graph capturable. The
        fused CUDA kernels take B <= 65,535 (grid limit) and (B + 1) * L < 2**31.

    Raises:
        RuntimeError naming the argument for wrong ranks, shapes, dtypes, devices, backends, or
        (CPU) n outside [1, Lk].
    """
    return torch.ops.tabserve.prefix_attention(q, k, v, n_keys, scale, backend)


def qassmax_scale(q: Tensor, n_keys: Tensor, base_mlp, query_mlp) -> Tensor:
    """QASSMax query scaling with the real number of keys n from a tensor.

    ``q * base(ln max(n, 1))[head] * (1 + tanh(query_mlp(q)))``, as TabICLv2's
    ``QASSMaxMLP`` computes with ``n = k.size(-2)`` on unpadded keys.

    Args:
        q: [..., heads, queries, head_dim], floating.
        n_keys: int32 or int64, 0-d or [q.shape[0]] (then q must be 4-D), on q's device.
        base_mlp: ``nn.Sequential(Linear(1, hidden), GELU(), Linear(hidden, heads * head_dim))``
            (element-wise) or ``Linear(hidden, heads)``; or the four tensors
            ``(weight1, bias1, weight2, bias2)``.
        query_mlp: ``nn.Sequential(Linear(head_dim, hidden), GELU(), Linear(hidden, head_dim))``
            (element-wise) or ``Linear(hidden, 1)``; or its four tensors.

    Returns:
        The scaled queries, q's shape, dtype and strides. Weights are used in q's dtype (as
        autocast runs the reference's Linear layers). No host synchronisation on CUDA.

    Raises:
        RuntimeError naming the argument for shapes that do not fit, devices or dtypes.
    """
    return torch.ops.tabserve.qassmax_scale(
        q, n_keys, *_mlp_tensors(base_mlp), *_mlp_tensors(query_mlp)
    )


def _mlp_tensors(mlp) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(weight1, bias1, weight2, bias2) of a Linear-GELU-Linear ``nn.Sequential`` or a 4-tuple."""
    if isinstance(mlp, torch.nn.Sequential):
        return mlp[0].weight, mlp[0].bias, mlp[2].weight, mlp[2].bias
    weight1, bias1, weight2, bias2 = mlp
    return weight1, bias1, weight2, bias2


# ---------------------------------------------------------------------------------------------
# Input checks of a TabICL call (csrc/ops/table_checks.cpp, csrc/ops/cuda/table_checks.cu)

#: Label dtypes ``table_checks`` takes (no unsigned types past uint8, no complex).
TABLE_CHECK_LABEL_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    }
)


@torch.library.register_fake("tabserve::table_checks")
def _table_checks_fake(X, y_train, classification):
    _same_device("table_checks", X=X, y_train=y_train)
    torch._check(X.dim() == 3, lambda: f"X must be (tables, rows, features), got {X.dim()}-D")
    torch._check(
        X.dtype.is_floating_point, lambda: f"X must be a floating-point tensor, got {X.dtype}"
    )
    torch._check(
        y_train.dim() == 2 and y_train.shape[0] == X.shape[0],
        lambda: f"y_train must be (tables, train rows) = ({X.shape[0]}, N)",
    )
    torch._check(
        y_train.dtype in TABLE_CHECK_LABEL_DTYPES,
        lambda: (
            f"y_train must be bool, a signed integer type, uint8 or floating point, got "
            f"{y_train.dtype}"
        ),
    )
    return X.new_empty(2 + 3 * X.shape[0], dtype=torch.int64)


def table_checks(X: Tensor, y_train: Tensor, classification: bool) -> Tensor:
    """The value checks of a TabICL call in one kernel, as one int64 vector on X's device.

    Args:
        X: (tables, rows, features) floating tensor, any strides.
        y_train: (tables, N) labels of the first N rows: bool, uint8, a signed integer type or
            floating point.
        classification: also check that the labels of every table are 0..K-1.

    Returns:
        ``[non-finite values of X, non-finite labels]``, then for each table t at ``2 + 3t``
        (classification; zeros otherwise): the labels that are not integers in ``[0, N)``
        (NaN / infinite ones included), the number of distinct labels among the others and the
        largest of those (-1 if none). The labels are exactly 0..K-1 in every table, one K,
        when every bad count is 0, every distinct count is K and every largest label is K - 1
        (K labels 0..K-1 need K <= N, so the bitmap of [0, N) sees every one of them).

    Raises:
        RuntimeError naming the argument: X not 3-D or not floating point, y_train of the wrong
        shape, dtype or device.
    """
    return torch.ops.tabserve.table_checks(X, y_train, classification)


# ---------------------------------------------------------------------------------------------
# Rotary position embedding (csrc/ops/rotary.cpp, csrc/ops/cuda/rotary.cu)


@torch.library.register_fake("tabserve::rotary_embedding")
def _rotary_embedding_fake(x, cos, sin):
    _same_device("rotary_embedding", x=x, cos=cos, sin=sin)
    torch._check(x.dim() >= 2, lambda: f"x must have at least 2 dimensions, got {x.dim()}")
    torch._check(
        tuple(cos.shape) == tuple(x.shape[-2:]) and tuple(sin.shape) == tuple(x.shape[-2:]),
        lambda: f"cos and sin must be [L, D] = {tuple(x.shape[-2:])}",
    )
    return x.new_empty(x.shape)  # contiguous, x's dtype


def rotary_embedding(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half rotary position embedding in one pass (the TabICLv2 row stage's RoPE).

    Args:
        x: [..., L, D] floating tensor, positions along L, D even; any strided view whose last
            axis is contiguous (head-split queries / keys) is read in place.
        cos, sin: [L, D] float32 or float64 tables on x's device (``cat([cos(a), cos(a)])`` of
            the angles ``a = position * frequency``).

    Returns:
        A new contiguous tensor of x's shape and dtype:
        ``x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin``, evaluated in
        ``promote_types(x.dtype, cos.dtype)`` with each product and the sum rounded, then cast
        to x's dtype: bit for bit what those ATen ops give, in one read and one write.

    Raises:
        RuntimeError naming the argument: x not floating or under 2-D, odd D, tables of the wrong
        shape, dtype or device.
    """
    return torch.ops.tabserve.rotary_embedding(x, cos, sin)


# ---------------------------------------------------------------------------------------------
# Attention with head dimension 16 (csrc/ops/attention.cpp, csrc/ops/cuda/attention.cu)

#: The head dimension :func:`small_head_attention` serves.
SMALL_HEAD_DIM = 16


@torch.library.register_fake("tabserve::small_head_attention")
def _small_head_attention_fake(q, k, v, n_keys=None, scale=None, rotary_cos=None, rotary_sin=None):
    _same_device(
        "small_head_attention",
        q=q,
        k=k,
        v=v,
        n_keys=n_keys,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
    )
    torch._check(
        q.dim() == 4 and q.shape[-1] == SMALL_HEAD_DIM,
        lambda: f"q must be [batch, heads, length, {SMALL_HEAD_DIM}], got {tuple(q.shape)}",
    )
    batch, heads, queries, _ = q.shape
    return q.new_empty((batch, queries, heads, SMALL_HEAD_DIM)).transpose(1, 2)


def small_head_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    n_keys: Tensor | None = None,
    scale: float | None = None,
    rotary: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Attention with head dimension 16 (TabICLv2's column and row stages), optionally over
    only the first ``n_keys`` keys, n read from a tensor, optionally after rotary position
    embedding of q and k.

    Equals ``F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], scale=scale)``. On CUDA
    one fused kernel on the tensor cores built for these shapes (a 16-wide head is the k of one
    m16n8k16 product; the softmax stays in registers; keys staged 128 at a time; no batch
    limit). On the H200 it is 2-3.6x faster than cuDNN on the row stage's short sequences and
    slower on the column stage's long key runs (docs/reference/ops.md).

    Args:
        q: [B, heads, Lq, 16]; k, v: [B, heads, Lk, 16] with Lk >= 1; any strides (a head-split
            view of a packed projection is read in place; broadcast batch or heads may have
            stride 0). One floating dtype, one device; CUDA takes float16 and bfloat16 on
            compute capability 8.0 or newer.
        n_keys: optional int32 or int64 tensor, 0-d (one n for all) or [B], on q's device: only
            the first n keys are used (padded buckets). CPU checks n in [1, Lk]; CUDA clamps
            into it (checking would synchronise with the host).
        scale: softmax scale, default 1 / 4 (= 1 / sqrt(16)).
        rotary: optional ``(cos, sin)`` float32 tables [L >= max(Lq, Lk), 16] (as
            ``RotaryEmbedding.tables`` builds them): q and k are first rotated at their row
            positions (rotate-half RoPE in fp32, rounded to their dtype, as
            :func:`rotary_embedding` computes), inside the kernel on CUDA, so the row stage's
            rotated copies are never written.

    Returns:
        [B, heads, Lq, 16] in q's dtype, stored as [B, Lq, heads, 16] (a transposed view, so the
        heads merge back with a view). CPU computes exact maths (fp32; fp64 for fp64 inputs).
        CUDA accumulates the scores, the softmax and the output in fp32 and rounds the
        probabilities to the input dtype before multiplying them with v, as the fused SDPA
        kernels do. No host synchronisation: CUDA-graph capturable.

    Raises:
        RuntimeError naming the argument for wrong ranks, shapes, head dims, dtypes or devices,
        (CPU) n outside [1, Lk], RoPE tables of the wrong shape, dtype or device, and (CUDA)
        fp32 / fp64 inputs or a GPU older than sm80.
    """
    cos, sin = rotary if rotary is not None else (None, None)
    return torch.ops.tabserve.small_head_attention(q, k, v, n_keys, scale, cos, sin)


# ---------------------------------------------------------------------------------------------
# Fused halves of a transformer block (python/tabserve/kernels/<op>.py: schema,
# composite CPU kernel, Triton CUDA kernel and fake kernel in one file)


def feed_forward(
    x: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor | None,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    eps: float = 1e-5,
    compute_dtype: torch.dtype = torch.float16,
    update: Tensor | None = None,
    skip: Tensor | None = None,
    skip_value: float = 0.0,
    update_weight: Tensor | None = None,
    update_bias: Tensor | None = None,
    row_prefix: Tensor | None = None,
) -> Tensor:
    """``s + linear2(gelu(linear1(layer_norm(s))))`` with ``s = x (+ update)``, as
    ``torch.autocast`` to ``compute_dtype`` computes it, in one pass on CUDA.

    LayerNorm runs in fp32 and is rounded to ``compute_dtype``; the weights and biases are cast
    to it; both linears accumulate in fp32 and round their outputs, the exact (erf) GELU runs in
    fp32 and rounds its output; the residual sums are in the promoted dtypes (``x + update``
    as ATen adds them). On CUDA with fp16 / bf16 ``compute_dtype``, a width of 16, 32, 64 or 128
    and a hidden width that is a multiple of 64, one kernel reads each tile of tokens once and
    writes it once (the hidden activations never reach memory): :func:`feed_forward_resident`
    for width 128 / hidden 256 streams below 2^20 tokens, the Triton kernel otherwise; elsewhere
    (CPU, fp32, other shapes) the ATen composite runs. The kernel's matmuls sum in another order than
    cuBLAS: results differ from the composite by rounding (bounds in docs/reference/ops.md).

    Args:
        x: [..., dim] float tensor (fp32 / fp16 / bf16 on CUDA), any leading shape.
        norm_weight, norm_bias: LayerNorm's [dim] affine parameters (bias may be None).
        w1, b1: linear1's [hidden, dim] weight and [hidden] bias (``nn.Linear`` layout).
        w2, b2: linear2's [dim, hidden] weight and [dim] bias.
        eps: LayerNorm's epsilon (finite, >= 0).
        compute_dtype: the matmul dtype: float16, bfloat16 or float32 (fp32: the composite).
        update: optional tensor of x's shape added to x first (a pre-LN block's attention
            output: the sum is then never written).
        skip: optional bool tensor over a leading part of x's shape (``x.shape[:skip.dim()]``,
            fewer dimensions than x): every output element of a marked set is ``skip_value``
            (the column stage's sentinel rule, written by the kernels' epilogue instead of a
            separate masked fill over the stream).
        skip_value: the value of skipped sets' outputs.
        update_weight, update_bias: optional [dim, dim] weight and [dim] bias (bias needs the
            weight; the weight needs ``update``): ``update`` is first projected,
            ``linear(update, update_weight, update_bias)`` as autocast computes it (operands
            cast to ``compute_dtype``, output in it) — the attention half's out-projection,
            done by the Triton kernel on each tile so its output is never written. The
            resident kernel does not fold it: there cuBLAS projects first.
        row_prefix: optional [P, dim] float tensor, for x of shape [B, S, L, dim] (S sets of
            L tokens): the output is laid out as L rows of P + S tokens each, [B, L, P + S,
            dim], every row led by ``row_prefix`` (cast to the output dtype) and followed by
            the S sets' tokens at that position: ``cat([row_prefix.expand(B, L, P, dim),
            out.transpose(1, 2)], 2)`` (TabICLv2's column stage handing its cells to the row
            stage, CLS tokens first). The Triton kernel writes its tiles there directly; the
            resident kernel's output is rearranged by ATen.

    Returns:
        [..., dim] tensor of the promoted dtype of x, update and ``compute_dtype``, contiguous
        (with ``row_prefix``: [B, L, P + S, dim]).

    Raises:
        ValueError naming the argument for shapes that do not fit ``x``'s width, non-float
        tensors, tensors on another device than ``x``, an unsupported ``compute_dtype``, a
        negative or infinite ``eps``, or a ``row_prefix`` for an ``x`` that is not 4-D.
    """
    from tabserve.kernels import feed_forward as kernels

    args = (x, update, norm_weight, norm_bias, w1, b1, w2, b2, eps, compute_dtype)
    return kernels.feed_forward(*args, skip, skip_value, update_weight, update_bias, row_prefix)


def norm_linear(
    x: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor | None,
    weight: Tensor,
    bias: Tensor,
    eps: float = 1e-5,
    compute_dtype: torch.dtype = torch.float16,
    rotary: tuple[Tensor, Tensor] | None = None,
    rotary_features: int = 0,
) -> Tensor:
    """``linear(layer_norm(x), weight, bias)`` as ``torch.autocast`` to ``compute_dtype``
    computes it (a pre-LN block's normalisation and input projection), in one pass on CUDA,
    optionally with rotary position embedding of its leading outputs.

    LayerNorm runs in fp32 and is rounded to ``compute_dtype``; weight and bias are cast to it;
    the product accumulates in fp32 and is rounded. On CUDA with fp16 / bf16 ``compute_dtype``, a
    width of 16, 32, 64 or 128 and an output width that is a multiple of 64, one Triton kernel
    reads each tile of tokens once and writes only the projection (the normalised tokens never
    reach memory); elsewhere the ATen composite runs. Sums in another order than cuBLAS.

    Args:
        x: [..., dim] float tensor (fp32 / fp16 / bf16 on CUDA).
        norm_weight, norm_bias: LayerNorm's [dim] affine parameters (bias may be None).
        weight, bias: the projection's [out_features, dim] weight and [out_features] bias.
        eps: LayerNorm's epsilon (finite, >= 0).
        compute_dtype: the matmul dtype: float16, bfloat16 or float32 (fp32: the composite).
        rotary: optional ``(cos, sin)`` tables [L' >= L, head_dim] (as
            ``RotaryEmbedding.tables`` builds them), ``L = x.shape[-2]``: outputs
            ``[0, rotary_features)``, seen as heads of ``head_dim``, are rotated at their
            token's position along x's L axis (rotate-half RoPE of the rounded projection in the
            tables' dtype, rounded again: :func:`rotary_embedding` of the projection's head
            split). The kernel takes fp32 tables of a power-of-two head_dim up to 32 and
            ``rotary_features`` a multiple of 64 (the row stage's packed queries and keys);
            other RoPE arguments run the composite.
        rotary_features: with ``rotary``, how many leading outputs are rotated (a multiple of
            head_dim, at most out_features); 0 without.

    Returns:
        [..., out_features] tensor of dtype ``compute_dtype``, contiguous.

    Raises:
        ValueError naming the argument for shapes that do not fit ``x``'s width, non-float
        tensors, tensors on another device than ``x``, an unsupported ``compute_dtype``, a
        negative or infinite ``eps``, RoPE tables of the wrong shape or a ``rotary_features``
        that does not fit them.
    """
    from tabserve.kernels.norm_linear import norm_linear_op

    cos, sin = rotary if rotary is not None else (None, None)
    args = (x, norm_weight, norm_bias, weight, bias, eps, compute_dtype)
    return norm_linear_op(*args, cos, sin, rotary_features)


# ---------------------------------------------------------------------------------------------
def flash_attention(q: Tensor, k: Tensor, v: Tensor, fp8: bool = False) -> Tensor:
    """``softmax(q @ k^T / sqrt(dim)) @ v`` in one pass over the keys (an online softmax: the
    scores never reach memory), on half or fp8 operands: the ICL stage's long calls.

    ``fp8=False``: fp16 / bf16 operands as given, the softmax weights rounded to their dtype for
    the product with v. ``fp8=True``: q, k and v are first rounded to ``float8_e4m3fn``, each
    scaled by its largest magnitude over 448 (one scale per tensor, on the device), the scores
    and the softmax run in fp32, the weights (times 256) are rounded to e4m3 for the product
    with v, and the row sums stay fp32; the matmuls then run on fp8 tensor cores. On CUDA with
    fp16 / bf16 operands and a head dimension of 16, 32, 64 or 128 (fp8: 32 to 128, compute
    capability 8.9 or later) one Triton kernel runs; elsewhere (CPU, fp32, other shapes) the ATen composite
    computes the same roundings in fp32 maths with a two-pass softmax. The kernel sums in
    another order and rescales its weights by a running row maximum, so the two differ by
    rounding (bounds in docs/reference/ops.md).

    Args:
        q: [..., queries, dim] floating tensor (any leading shape).
        k, v: [..., keys, dim] tensors of q's dtype, device, leading shape and dim; keys >= 1.
        fp8: round the operands and weights to e4m3 as above.

    Returns:
        [..., queries, dim] tensor of q's dtype, contiguous.

    Raises:
        ValueError naming the argument: a non-float or under-2-D tensor, another dtype or
        device than q's, k and v of different shapes, a leading shape or dim other than q's,
        no keys.
    """
    from tabserve.kernels.flash_attention import flash_attention_op

    return flash_attention_op(q, k, v, fp8)


# The feed-forward half at TabICLv2's width, weights resident on chip (csrc/ops/feed_forward.cpp,
# csrc/ops/cuda/feed_forward.cu); its shape: RESIDENT_DIM, RESIDENT_HIDDEN (kernels/_resident.py)


@torch.library.register_fake("tabserve::feed_forward_resident")
def _feed_forward_resident_fake(
    x, update, norm_weight, norm_bias, w1, b1, w2, b2, eps, skip=None, skip_value=0.0
):
    _same_device(
        "feed_forward_resident",
        x=x, update=update, norm_weight=norm_weight, norm_bias=norm_bias,
        w1=w1, b1=b1, w2=w2, b2=b2, skip=skip,
    )  # fmt: skip
    compute = w1.dtype
    torch._check(
        compute in (torch.float16, torch.bfloat16),
        lambda: f"w1 must be float16 or bfloat16, got {compute}",
    )
    torch._check(
        x.dim() >= 1 and x.shape[-1] == RESIDENT_DIM,
        lambda: f"x must be [..., {RESIDENT_DIM}], got {tuple(x.shape)}",
    )
    torch._check(
        x.dtype in (torch.float32, compute),
        lambda: f"x must be float32 or the weights' dtype {compute}, got {x.dtype}",
    )
    expected = {
        "update": (update, tuple(x.shape), compute),
        "norm_weight": (norm_weight, (RESIDENT_DIM,), torch.float32),
        "norm_bias": (norm_bias, (RESIDENT_DIM,), torch.float32),
        "w1": (w1, (RESIDENT_HIDDEN, RESIDENT_DIM), compute),
        "b1": (b1, (RESIDENT_HIDDEN,), compute),
        "w2": (w2, (RESIDENT_DIM, RESIDENT_HIDDEN), compute),
        "b2": (b2, (RESIDENT_DIM,), compute),
    }
    for name, (tensor, shape, dtype) in expected.items():
        if tensor is None:
            continue
        message = f"{name} must be {dtype} {shape}, got {tensor.dtype} {tuple(tensor.shape)}"
        fits = tuple(tensor.shape) == shape and tensor.dtype == dtype
        torch._check(fits, lambda: message)  # noqa: B023 (called at once, inside the loop)
    torch._check(eps >= 0.0 and eps != float("inf"), lambda: f"eps must be finite and >= 0: {eps}")
    if skip is not None:
        torch._check(
            skip.dtype == torch.bool
            and skip.dim() < x.dim()
            and tuple(skip.shape) == tuple(x.shape[: skip.dim()]),
            lambda: "skip must be a bool tensor of a leading part of x's shape",
        )
    return x.new_empty(x.shape)  # contiguous, x's dtype


def feed_forward_resident(
    x: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor | None,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    eps: float = 1e-5,
    update: Tensor | None = None,
    skip: Tensor | None = None,
    skip_value: float = 0.0,
) -> Tensor:
    """:func:`feed_forward` at width 128 and FFN width 256 (TabICLv2's column and row stages),
    with both weight matrices held in shared memory for the whole CUDA launch.

    ``s = x (+ update)``; ``out = s + linear2(gelu(linear1(layer_norm(s))))``, as
    ``torch.autocast`` to the weights' dtype T computes it: LayerNorm in fp32 rounded to T, both
    linears accumulated in fp32 and rounded to T, the exact (erf) GELU in fp32 rounded to T,
    ``x + update`` rounded to T when x is T, ``s + y`` in fp32. On CUDA (sm80+) one warp runs a
    16-token tile through every step in registers (tensor-core products, another summation order
    than cuBLAS: results differ from the composite by rounding, bounds in docs/reference/ops.md);
    on CPU ATen's fp32 kernels compute the same roundings (the tests' reference).

    Args:
        x: [..., 128] float32 or T tensor, any leading shape.
        norm_weight, norm_bias: LayerNorm's float32 [128] parameters (bias may be None).
        w1, b1: linear1's [256, 128] weight and [256] bias, T (float16 or bfloat16).
        w2, b2: linear2's [128, 256] weight and [128] bias, T.
        eps: LayerNorm's epsilon (finite, >= 0).
        update: optional T tensor of x's shape added to x first (the attention half's output).
        skip, skip_value: as :func:`feed_forward`.

    Returns:
        [..., 128] contiguous tensor of x's dtype. No host synchronisation (CUDA-graph safe).

    Raises:
        RuntimeError naming the argument for any other shape or dtype, tensors on another device
        than x, a negative or infinite eps, or (CUDA) a GPU older than sm80.
    """
    return torch.ops.tabserve.feed_forward_resident(
        x, update, norm_weight, norm_bias, w1, b1, w2, b2, eps, skip, skip_value
    )


# ---------------------------------------------------------------------------------------------
# LayerNorm rounded to the matmul dtype (csrc/ops/layer_norm.cpp, csrc/ops/cuda/layer_norm.cu)


@torch.library.register_fake("tabserve::layer_norm_cast")
def _layer_norm_cast_fake(x, weight, bias, eps, dtype):
    _same_device("layer_norm_cast", x=x, weight=weight, bias=bias)
    torch._check(
        dtype in (torch.float16, torch.bfloat16),
        lambda: f"dtype must be float16 or bfloat16, got {dtype}",
    )
    torch._check(x.is_floating_point(), lambda: f"x must be floating point, got {x.dtype}")
    torch._check(
        weight.dim() == 1 and weight.dtype == torch.float32,
        lambda: f"weight must be float32 1-D, got {weight.dtype} {tuple(weight.shape)}",
    )
    torch._check(
        x.dim() >= 1 and x.shape[-1] == weight.shape[0],
        lambda: f"x must be [..., {weight.shape[0]}] (weight's length), got {tuple(x.shape)}",
    )
    if bias is not None:
        torch._check(
            bias.shape == weight.shape and bias.dtype == torch.float32,
            lambda: f"bias must be float32 of weight's shape, got {bias.dtype} {tuple(bias.shape)}",
        )
    torch._check(eps >= 0.0 and eps != float("inf"), lambda: f"eps must be finite and >= 0: {eps}")
    return x.new_empty(x.shape, dtype=dtype)


def layer_norm_cast(
    x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, dtype: torch.dtype
) -> Tensor:
    """LayerNorm over ``x``'s last dimension, rounded to ``dtype``: what ``torch.autocast`` to
    ``dtype`` computes for a LayerNorm whose output a matmul reads (the LayerNorm in fp32, then
    the matmul's cast of its output), in one pass over the stream.

    On CUDA an fp32 ``x`` of width 128, 256, 512 or 1024 runs one warp per row (its own
    summation order: results differ from ATen's by rounding, bounds in docs/reference/ops.md);
    other inputs, and the CPU, run the ATen composite.

    Args:
        x: [..., E] floating-point tensor (computed in fp32).
        weight, bias: LayerNorm's float32 [E] parameters (bias may be None).
        eps: LayerNorm's epsilon (finite, >= 0).
        dtype: ``torch.float16`` or ``torch.bfloat16``.

    Returns:
        x's shape in ``dtype``, contiguous. No host synchronisation (CUDA-graph safe).

    Raises:
        RuntimeError naming the argument for any other shape or dtype, tensors on another device
        than x, or a negative or infinite eps.
    """
    return torch.ops.tabserve.layer_norm_cast(x, weight, bias, eps, dtype)


# ---------------------------------------------------------------------------------------------
# Sets made only of one value (csrc/ops/all_equal.cpp, csrc/ops/cuda/all_equal.cu)


@torch.library.register_fake("tabserve::all_equal")
def _all_equal_fake(x, value, dims):
    torch._check(dims >= 1, lambda: f"dims must be >= 1, got {dims}")
    torch._check(x.dim() >= dims, lambda: f"x must have at least dims = {dims} dimensions")
    torch._check(x.is_floating_point(), lambda: f"x must be floating point, got {x.dtype}")
    return x.new_empty(x.shape[: x.dim() - dims], dtype=torch.bool)


def all_equal(x: Tensor, value: float, dims: int = 1) -> Tensor:
    """Whether every value of each set equals ``value``: ``(x == value).flatten(-dims).all(-1)``
    in one pass that leaves each set at its first other value (the column stage's sentinel
    check: only all-sentinel sets, i.e. padded features, are read whole).

    Args:
        x: [..., set dims] floating tensor, any strides (a strided x is copied first); the last
            ``dims`` dimensions form one set.
        value: compared after rounding to x's dtype, as ``x == value`` does; NaN equals nothing.
        dims: how many trailing dimensions one set spans (>= 1).

    Returns:
        bool tensor of shape ``x.shape[:-dims]`` on x's device (an empty set is all equal). No
        host synchronisation.

    Raises:
        RuntimeError naming the argument: dims < 1, x with fewer than ``dims`` dimensions or not
        floating point.
    """
    return torch.ops.tabserve.all_equal(x, value, dims)


# ---------------------------------------------------------------------------------------------
# Yeo-Johnson lambdas (csrc/ops/yeo_johnson.cpp, csrc/ops/cuda/yeo_johnson.cu)


@torch.library.register_fake("tabserve::yeo_johnson_lambdas")
def _yeo_johnson_lambdas_fake(z):
    torch._check(z.dtype == torch.float64, lambda: f"z must be float64, got {z.dtype}")
    torch._check(z.dim() == 2, lambda: f"z must be 2-D (rows, columns), got {z.dim()} dimensions")
    return z.new_empty(z.shape[1])


def yeo_johnson_lambdas(z: Tensor) -> Tensor:
    """Yeo-Johnson lambdas of every column of ``z``, as scikit-learn's
    ``PowerTransformer(method="yeo-johnson").fit(z).lambdas_`` computes them: each column's own
    bounded Brent search (SciPy's ``fminbound``, its stopping rule and its 500-evaluation cap) of
    the transform's negative log-likelihood over its non-missing values, in one kernel (a thread
    per column on the CPU, a block per column on the GPU).

    Args:
        z: [rows, columns] float64, any strides; NaN marks a missing value.

    Returns:
        float64 [columns] on z's device: 1 (the identity) for a constant, all-zero or all-missing
        column, as scikit-learn. The lambdas agree with scikit-learn's to the search's tolerance
        (sums run in another order). No host synchronisation.

    Raises:
        RuntimeError naming the argument: z not float64 or not 2-D.
    """
    return torch.ops.tabserve.yeo_johnson_lambdas(z)
