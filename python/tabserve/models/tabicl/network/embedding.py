"""Stage 1: column-wise embedding (distribution-aware, target-aware set transformer).

Every feature group (3 features at cyclic offsets +1, +2, +4) is one set of ``T`` cells. Cells are
embedded by a linear layer, train cells get a label embedding, and a stack of induced-set-attention
blocks (ISAB) mixes each set: 128 learned inducing points attend to the train cells only
(QASSMax, ``n`` = train rows), then every cell attends to the inducing points. Columns, tables and
test rows never interact, so wide, tall inputs run in chunks of feature groups
(:data:`COLUMN_STAGE_MAX_CELLS`) with the same result and bounded activations.

The reference also pushes 4 placeholder columns (the row stage's CLS slots) through this stage and
discards them; we skip them, which is exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tabserve.kernels.layout import to_rows

from .layers import (
    SKIP_VALUE,
    AttentionBlock,
    KeyValue,
    chunk_budget,
    chunk_slices,
    sentinel_linear,
)

#: Cyclic feature offsets of one group (``col_feature_group="same"``, group size 3).
GROUP_OFFSETS: tuple[int, ...] = (1, 2, 4)

#: Cells (tables x feature groups x rows) the set transformer processes in one pass; more run in
#: chunks of feature groups (the feed-forward hidden layer is 4 x dim wide per cell). Every
#: workload up to 8 x 10,240 rows x 64 features runs in one pass.
COLUMN_STAGE_MAX_CELLS = 1 << 24


class InducedSetBlock(nn.Module):
    """One ISAB block: ``hidden = attn1(inducing, train cells)``; ``out = attn2(cells, hidden)``."""

    def __init__(self, dim: int, num_heads: int, ff_dim: int, num_inds: int, ln_bias: bool):
        super().__init__()
        self.ind_vectors = nn.Parameter(torch.empty(num_inds, dim))
        self.multihead_attn1 = AttentionBlock(dim, num_heads, ff_dim, ln_bias, qassmax=True)
        self.multihead_attn2 = AttentionBlock(dim, num_heads, ff_dim, ln_bias)

    def summary(self, cells: Tensor, n_train: int, n_keys: Tensor | None = None) -> KeyValue:
        """K/V of the induced tokens for cells ``(..., T, E)``; depends on train cells only.

        Returns two tensors ``(..., heads, num_inds, head_dim)``: this is the column cache entry.
        Padded serving: ``n_train`` is the train bucket and ``n_keys`` (0-d tensor) the real
        train-row count, which the inducing points attend to and QASSMax scales by.
        """
        hidden = self.multihead_attn1(self.ind_vectors, cells[..., :n_train, :], n_keys=n_keys)
        return self.multihead_attn2.key_value(hidden)

    def forward(self, cells: Tensor, summary: KeyValue, row_prefix: Tensor | None = None) -> Tensor:
        """Cells ``(..., T, E)`` attend to the induced tokens; sets made only of the sentinel stay.

        The check reads each set only up to its first other value (``tabserve::all_equal``:
        as ``(cells == SKIP_VALUE).flatten(-2).all(-1)`` it read all of the cells before every
        block), and the fused feed-forward writes the sentinels itself (no masked fill pass).
        ``row_prefix``: the output in the row stage's layout (:meth:`ColumnEmbedding.forward`)."""
        skipped = torch.ops.tabserve.all_equal(cells, SKIP_VALUE, 2)
        return self.multihead_attn2(cells, cached_kv=summary, skip=skipped, row_prefix=row_prefix)


class SetTransformer(nn.Module):
    """Stack of ISAB blocks (state_dict prefix ``col_embedder.tf_col``)."""

    def __init__(
        self, num_blocks: int, dim: int, num_heads: int, ff_dim: int, num_inds: int, ln_bias: bool
    ):
        super().__init__()
        self.blocks = nn.ModuleList(
            InducedSetBlock(dim, num_heads, ff_dim, num_inds, ln_bias) for _ in range(num_blocks)
        )

    def forward(
        self,
        cells: Tensor,
        n_train: int,
        n_keys: Tensor | None = None,
        row_prefix: Tensor | None = None,
    ) -> tuple[Tensor, list[KeyValue]]:
        """Returns the embedded cells and the per-block K/V summaries (the column cache).
        ``row_prefix``: the last block writes the cells in the row stage's layout."""
        summaries, last = [], len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            summary = block.summary(cells, n_train, n_keys)
            cells = block(cells, summary, row_prefix if i == last else None)
            summaries.append(summary)
        return cells, summaries

    def forward_cached(
        self, cells: Tensor, summaries: Sequence[KeyValue], row_prefix: Tensor | None = None
    ) -> Tensor:
        """Test cells only, against cached summaries (``row_prefix``: as :meth:`forward`)."""
        last = len(self.blocks) - 1
        for i, (block, summary) in enumerate(zip(self.blocks, summaries)):
            cells = block(cells, summary, row_prefix if i == last else None)
        return cells


def mixed_radix_bases(num_classes: int, max_classes: int) -> list[int]:
    """Balanced bases ``[k_0, ..., k_{D-1}]`` (each <= max_classes, product >= num_classes).

    Same walk as the reference: start from ``ceil(K ** (1/D))`` and bump bases left to right once
    while the product is too small. K = 25 -> [5, 5]; K = 101 -> [5, 5, 5].
    """
    if num_classes <= max_classes:
        return [num_classes]
    digits = math.ceil(math.log(num_classes) / math.log(max_classes))
    base = min(math.ceil(num_classes ** (1.0 / digits)), max_classes)
    bases = [base] * digits
    product = base**digits
    for i in range(digits):
        if product >= num_classes:
            break
        if bases[i] < max_classes:
            product = product // bases[i] * (bases[i] + 1)
            bases[i] += 1
    return bases


def mixed_radix_digits(labels: Tensor, bases: Sequence[int]) -> list[Tensor]:
    """Digits of integer labels in the mixed radix ``bases`` (most significant first)."""
    digits = []
    for i, base in enumerate(bases):
        divisor = math.prod(bases[i + 1 :])
        digits.append((labels.long() // divisor) % base)
    return digits


class ColumnEmbedding(nn.Module):
    """Column-wise embedding (state_dict prefix ``col_embedder``).

    Input tables ``X (B, T, H)`` with the first ``N`` rows being train rows, labels
    ``y_train (B, N)``; output cell embeddings ``(B, T, H, E)`` (one token per feature group).
    """

    def __init__(
        self,
        dim: int,
        num_blocks: int,
        num_heads: int,
        ff_dim: int,
        num_inds: int,
        ln_bias: bool,
        max_classes: int,
        group_size: int = len(GROUP_OFFSETS),
    ):
        super().__init__()
        if group_size != len(GROUP_OFFSETS):
            raise ValueError(
                f"only feature groups of size {len(GROUP_OFFSETS)} are supported, got {group_size}"
            )
        self.max_classes = max_classes
        # A buffer, not a tensor built per call: no host-to-device copy (CUDA-graph capturable).
        # Made on the host even when the model is built on ``meta`` (its weights then come from
        # a checkpoint; this buffer is in none).
        offsets = torch.tensor(GROUP_OFFSETS, device="cpu")
        self.register_buffer("group_offsets", offsets, persistent=False)
        self.in_linear = nn.Linear(group_size, dim)
        self.tf_col = SetTransformer(num_blocks, dim, num_heads, ff_dim, num_inds, ln_bias)
        #: Per-instance chunking threshold (tests lower it).
        self.max_cells = COLUMN_STAGE_MAX_CELLS
        self.y_encoder = nn.Linear(max_classes if max_classes > 0 else 1, dim)

    def cells(
        self, X: Tensor, n_features: Tensor | None = None, groups: slice | None = None
    ) -> Tensor:
        """Group features and embed every cell: ``(B, T, H) -> (B, H, T, E)``.

        ``n_features`` (padded serving, 0-d tensor): the real feature count, clamped into
        ``[1, H]``. Groups take their offsets modulo it, so real groups never read padded
        features and equal the unpadded groups; the groups past it are padding (masked in the
        row stage).
        """
        offsets = self.group_offsets
        # Clamped into [1, H]: every index stays inside X whatever the tensor holds (AOTInductor
        # autotunes the compiled kernels with random inputs; n = 0 or < 0 read out of bounds).
        modulus = X.shape[-1] if n_features is None else n_features.clamp(1, X.shape[-1])
        positions = torch.arange(X.shape[-1], device=X.device)[:, None] + offsets
        if n_features is not None and n_features.dim() == 1:  # a count per table
            index = positions % modulus[:, None, None]  # (B, H, 3)
            tables = torch.arange(X.shape[0], device=X.device)[:, None, None]
            grouped = X.transpose(1, 2)[tables, index]  # (B, H, 3, T)
        else:
            index = positions % modulus
            if groups is not None:  # these feature groups only (offloaded calls)
                index = index[groups]
            grouped = X.transpose(1, 2)[:, index]  # (B, H, 3, T)
        return sentinel_linear(self.in_linear, grouped.transpose(-1, -2))

    def _group_chunks(self, cells: Tensor) -> list:
        """Slices of the feature-group axis of ``cells (B, H, T, E)``, each at most
        ``max_cells`` cells."""
        batch, groups, rows = cells.shape[:3]
        return chunk_slices(groups, batch * rows, chunk_budget(self.max_cells, cells.device))

    def _set_transformer(
        self, cells: Tensor, n_train: int, n_keys: Tensor | None, row_prefix: Tensor | None = None
    ) -> tuple[Tensor, list[KeyValue]]:
        """``tf_col`` over chunks of feature groups (groups never interact in this stage):
        cells ``(B, H, T, E)`` out, or with ``row_prefix`` the row stage's tokens."""
        chunks = self._group_chunks(cells)
        if len(chunks) == 1 and len(self.tf_col.blocks):
            return self.tf_col(cells, n_train, n_keys, row_prefix)
        parts = [self.tf_col(cells[:, c], n_train, n_keys) for c in chunks]
        out = torch.cat([p[0] for p in parts], dim=1)
        summaries = [
            tuple(torch.cat([p[1][block][i] for p in parts], dim=1) for i in range(2))
            for block in range(len(parts[0][1]))
        ]
        return to_rows(out, row_prefix), summaries

    def label_embedding(self, y: Tensor) -> Tensor:
        """``(B, N)`` labels (class indices or standardised targets) -> ``(B, N, E)``."""
        if self.max_classes > 0:
            return F.linear(
                F.one_hot(y.long(), self.max_classes).float(),
                self.y_encoder.weight,
                self.y_encoder.bias,
            )
        return self.y_encoder(y.unsqueeze(-1))

    def _with_labels(self, cells: Tensor, y: Tensor, n_real: Tensor | None = None) -> Tensor:
        n_train = y.shape[1]
        labelled = cells[:, :, :n_train] + self.label_embedding(y)[:, None]
        if n_real is not None:
            # Padded train rows keep their (sentinel) cells, so a column whose real cells are
            # all sentinels is still skipped by the ISAB blocks, as without padding.
            real = torch.arange(n_train, device=cells.device) < n_real[..., None]
            if real.dim() == 2:  # a count per table: (B, N) -> (B, 1, N)
                real = real[:, None]
            labelled = torch.where(real[..., None], labelled, cells[:, :, :n_train])
        return torch.cat([labelled, cells[:, :, n_train:]], dim=2)

    def forward(
        self,
        X: Tensor,
        y_train: Tensor,
        n_train: Tensor | None = None,
        n_features: Tensor | None = None,
        num_classes: int | None = None,
        row_prefix: Tensor | None = None,
    ) -> Tensor:
        """Embeddings ``(B, T, H, E)``; more than ``max_classes`` classes use mixed-radix digits.

        Padded serving: ``y_train`` covers the train bucket, ``n_train`` / ``n_features`` are
        0-d tensors with the real counts and ``num_classes`` is passed in (reading it from the
        labels would synchronise with the host).

        ``row_prefix`` ``(P, E)``: the output is the row stage's input instead, ``(B, T, P + H,
        E)``, every row led by these tokens (its CLS tokens). Where the fused feed-forward
        serves the last block, it writes that layout itself: no pass transposes the cells and
        concatenates them with the prefix.
        """
        cells = self.cells(X, n_features)
        rows = y_train.shape[1]
        if num_classes is None:
            num_classes = int(y_train.max().item()) + 1 if self.max_classes > 0 else 0
        if num_classes <= self.max_classes:
            labelled = self._with_labels(cells, y_train, n_train)
            out = self._set_transformer(labelled, rows, n_train, row_prefix)[0]
            return out.transpose(1, 2) if row_prefix is None else out
        bases = mixed_radix_bases(num_classes, self.max_classes)
        out = torch.zeros_like(cells)
        for digit in mixed_radix_digits(y_train, bases):
            labelled = self._with_labels(cells, digit, n_train)
            out = out + self._set_transformer(labelled, rows, n_train)[0]
        return _as_rows(out / len(bases), row_prefix)

    def offloaded(
        self, X: Tensor, y_train: Tensor, num_classes: int, store, row_parts: Sequence[slice]
    ) -> list[Tensor]:
        """The stage's output in a tensor of ``store`` (:mod:`.offload`), computed and written
        a chunk of feature groups at a time (at most ``max_cells`` cells of a chunk on the
        device): the numbers of :meth:`forward`, whose groups never interact.

        Returns a block per slice of rows of ``row_parts`` (the row stage's chunks:
        consecutive slices covering the rows, as :func:`.layers.chunk_slices` makes them), each
        ``(H, B, rows, E)`` and contiguous in the store: every write of a chunk of groups and
        every read of a block is then one contiguous run of memory, which a CUDA device copies
        to and from pinned memory directly (a strided slice of the host tensor is first
        gathered by the host into unpinned memory, and the copy waits for it)."""
        batch, rows, features = X.shape
        n_train = y_train.shape[1]
        spans = [range(rows)[part] for part in row_parts]
        bases = None
        if num_classes > self.max_classes:
            bases = mixed_radix_bases(num_classes, self.max_classes)
            digits = list(mixed_radix_digits(y_train, bases))
        blocks = None
        for groups in chunk_slices(features, batch * rows, self.max_cells):
            cells = self.cells(X, groups=groups)
            if bases is None:
                part = self.tf_col(self._with_labels(cells, y_train), n_train)[0]
            else:
                part = torch.zeros_like(cells)
                for digit in digits:
                    part = part + self.tf_col(self._with_labels(cells, digit), n_train)[0]
                part = part / len(bases)
            if blocks is None:
                width = part.shape[-1]
                flat = store((features * batch * rows * width,), part.dtype)
                cells_per_row = features * batch * width
                blocks = [
                    flat[span.start * cells_per_row : span.stop * cells_per_row].view(
                        features, batch, len(span), width
                    )
                    for span in spans
                ]
            for block, span in zip(blocks, spans):
                rows_of_part = part[:, :, span.start : span.stop].transpose(0, 1).contiguous()
                block[groups].copy_(rows_of_part, non_blocking=True)
        return blocks

    def build_cache(
        self,
        X_train: Tensor,
        y_train: Tensor,
        n_train: Tensor | None = None,
        n_features: Tensor | None = None,
        row_prefix: Tensor | None = None,
    ) -> tuple[Tensor, list[KeyValue]]:
        """Train-only pass: train embeddings ``(B, N, H, E)`` (``row_prefix``: as
        :meth:`forward`) and the column K/V cache."""
        out, summaries = self._set_transformer(
            self._with_labels(self.cells(X_train, n_features), y_train, n_train),
            y_train.shape[1],
            n_train,
            row_prefix,
        )
        return (out.transpose(1, 2) if row_prefix is None else out), summaries

    def forward_cached(
        self,
        X_test: Tensor,
        summaries: Sequence[KeyValue],
        n_features: Tensor | None = None,
        row_prefix: Tensor | None = None,
    ) -> Tensor:
        """Test-only pass against the column cache: ``(B, M, H) -> (B, M, H, E)``
        (``row_prefix``: as :meth:`forward`)."""
        cells = self.cells(X_test, n_features)
        chunks = self._group_chunks(cells)
        if len(chunks) == 1 and len(self.tf_col.blocks):
            out = self.tf_col.forward_cached(cells, summaries, row_prefix)
            return out.transpose(1, 2) if row_prefix is None else out
        parts = [
            self.tf_col.forward_cached(cells[:, c], [(k[:, c], v[:, c]) for k, v in summaries])
            for c in chunks
        ]
        return _as_rows(torch.cat(parts, dim=1), row_prefix)


def _as_rows(cells: Tensor, row_prefix: Tensor | None) -> Tensor:
    """Cells ``(B, H, T, E)`` as the column stage hands them on: ``(B, T, H, E)``, or with
    ``row_prefix`` the row stage's tokens (:func:`tabserve.kernels.layout.to_rows`)."""
    return cells.transpose(1, 2) if row_prefix is None else to_rows(cells, row_prefix)
