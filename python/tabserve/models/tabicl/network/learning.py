"""Stage 3: dataset-wise in-context learning, output heads and the many-class hierarchy.

Row vectors of train rows get a label embedding; 12 pre-LN blocks (QASSMax, ``n`` = train rows)
let every row attend to the train rows only; LayerNorm + a 2-layer GELU MLP give 10 class logits or
999 quantiles. Test rows never attend to each other, so they can be processed against cached train
K/V (the ICL cache) with the same result.

More than ``max_classes`` classes: the reference's class hierarchy. Classes (sorted) are split into
at most ``max_classes`` contiguous groups, recursively; each tree node runs one ICL pass on its train
rows, and class probabilities are products of group probabilities along the path. The tables of a
batch walk the tree together (one pass per node for all of them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .layers import AttentionBlock, KeyValue
from .stage_kernels import DEFAULT_KERNELS

#: Softmax temperature used inside the class hierarchy (fixed in the reference).
HIERARCHY_TEMPERATURE = 0.9
#: Added to hierarchical probabilities before taking logs for logit output.
HIERARCHY_LOG_EPS = 1e-6


class ICLEncoder(nn.Module):
    """Stack of ICL blocks (state_dict prefix ``icl_predictor.tf_icl``)."""

    def __init__(self, num_blocks: int, dim: int, num_heads: int, ff_dim: int, ln_bias: bool):
        super().__init__()
        self.blocks = nn.ModuleList(
            AttentionBlock(dim, num_heads, ff_dim, ln_bias, qassmax=True) for _ in range(num_blocks)
        )


def class_groups(num_classes: int, max_classes: int) -> Tensor:
    """Group index of each of ``num_classes`` sorted classes: contiguous, balanced, <= max groups.

    Sizes are assigned greedily as ``ceil(remaining / groups_left)``: 25 -> [9, 8, 8].
    """
    num_groups = min(math.ceil(num_classes / max_classes), max_classes)
    sizes = []
    remaining = num_classes
    for groups_left in range(num_groups, 0, -1):
        sizes.append(math.ceil(remaining / groups_left))
        remaining -= sizes[-1]
    return torch.repeat_interleave(torch.arange(num_groups), torch.tensor(sizes))


class InContextLearner(nn.Module):
    """ICL transformer + head (state_dict prefix ``icl_predictor``).

    ``out_dim`` is ``max_classes`` (classification) or the number of quantiles (regression,
    ``max_classes == 0``).
    """

    def __init__(
        self,
        num_blocks: int,
        dim: int,
        num_heads: int,
        ff_dim: int,
        ln_bias: bool,
        max_classes: int,
        out_dim: int,
    ):
        super().__init__()
        self.max_classes = max_classes
        self.tf_icl = ICLEncoder(num_blocks, dim, num_heads, ff_dim, ln_bias)
        self.ln = nn.LayerNorm(dim, bias=ln_bias)
        self.y_encoder = nn.Linear(max_classes if max_classes > 0 else 1, dim)
        self.decoder = nn.Sequential(
            nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, out_dim)
        )
        #: The stage's kernel choices (:class:`~.stage_kernels.StageKernels`).
        self.kernels = DEFAULT_KERNELS

    @property
    def one_pass(self) -> bool:
        """The unpadded :meth:`forward` with train and test rows through each block in one pass
        (queries: every row; keys: the train rows) instead of the train rows' cache first and
        the test rows after it: one attention call per block instead of two, and no test-row
        launches of their own. Same maths."""
        return self.kernels.icl_one_pass

    def label_embedding(self, y: Tensor) -> Tensor:
        """``(B, N)`` labels -> ``(B, N, D)``."""
        if self.max_classes > 0:
            return F.linear(
                F.one_hot(y.long(), self.max_classes).float(),
                self.y_encoder.weight,
                self.y_encoder.bias,
            )
        return self.y_encoder(y.unsqueeze(-1))

    def build_cache(
        self, R_train: Tensor, y_train: Tensor, n_train: Tensor | None = None
    ) -> list[KeyValue]:
        """K/V of the labelled train rows at every block: ``(B, heads, N, head_dim)`` pairs.

        Padded serving: ``n_train`` (0-d tensor) real rows of the ``N``-row train bucket are keys.
        """
        x = R_train + self.label_embedding(y_train)
        blocks = self.tf_icl.blocks
        cache = []
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                x, kv = block(x, kv_rows=x.shape[-2], return_kv=True, n_keys=n_train)
            else:  # the last block's train outputs are never used
                kv = block.key_value(x)
            cache.append(kv)
        return cache

    def forward_cached(
        self, R_test: Tensor, cache: Sequence[KeyValue], n_train: Tensor | None = None
    ) -> Tensor:
        """Raw head outputs ``(B, M, out_dim)`` of test rows against the ICL cache (of which the
        first ``n_train`` rows are real, when given)."""
        x = R_test
        for block, kv in zip(self.tf_icl.blocks, cache):
            x = block(x, cached_kv=kv, n_keys=n_train)
        return self.decoder(self.ln(x))

    def forward(self, R: Tensor, y_train: Tensor, n_train: Tensor | None = None) -> Tensor:
        """Raw head outputs ``(B, M, out_dim)`` for the test rows of ``R (B, N + M, D)``."""
        rows = y_train.shape[1]
        if self.one_pass and n_train is None:
            return self._forward_one_pass(R, y_train)
        cache = self.build_cache(R[:, :rows], y_train, n_train)
        return self.forward_cached(R[:, rows:], cache, n_train)

    def _forward_one_pass(self, R: Tensor, y_train: Tensor) -> Tensor:
        """:meth:`forward` unpadded with every row a query of each block but the last (whose
        train outputs nothing reads): the keys and values are the train rows', as the cache's."""
        rows = y_train.shape[1]
        x = torch.cat([R[:, :rows] + self.label_embedding(y_train), R[:, rows:]], dim=1)
        *first, last = self.tf_icl.blocks
        for block in first:
            x = block(x, kv_rows=rows)
        x = last(x[:, rows:], x[:, :rows])
        return self.decoder(self.ln(x))

    def hierarchical_probs(self, R: Tensor, y_train: Tensor) -> Tensor:
        """Class probabilities ``(B, M, K)`` through the class hierarchy.

        Every table has the classes 0..K-1 (the model checks the labels), so the tables walk the
        tree together: each node is one ICL pass over all of them, every table's train rows of
        the node packed to the front and padded to the largest count, the counts passed as the
        number of keys (padded rows are never keys: each table's answer is the one it would get
        alone).
        """
        n_train = y_train.shape[1]
        labels = y_train.long()
        classes = torch.unique(labels)
        return self._hierarchy(R[:, :n_train], labels, None, R[:, n_train:], classes, len(classes))

    def _hierarchy(
        self,
        R_train: Tensor,
        y: Tensor,
        counts: Tensor | None,
        R_test: Tensor,
        classes: Tensor,
        num_classes: int,
    ) -> Tensor:
        """Probabilities ``(B, M, num_classes)`` from the subtree whose sorted classes are
        ``classes``, for tables ``R_train (B, N, D)`` whose first ``counts[b]`` rows are table
        b's train rows of the subtree (all N when ``counts`` is None), labelled ``y (B, N)``
        (any of ``classes`` in the padded rows), and their test rows ``R_test (B, M, D)``."""
        tables, rows = y.shape
        out = torch.zeros(tables, R_test.shape[1], num_classes, device=R_test.device)
        local = torch.searchsorted(classes, y)
        if len(classes) <= self.max_classes:
            out[:, :, classes] = self._node_probs(R_train, local, counts, R_test, len(classes))
            return out
        on_host = class_groups(len(classes), self.max_classes)  # sizes read without a sync
        sizes = torch.bincount(on_host).tolist()
        num_groups = len(sizes)
        groups = on_host.to(y.device)
        node_labels = groups[local]
        group_probs = self._node_probs(R_train, node_labels, counts, R_test, num_groups)
        real = torch.ones_like(y, dtype=torch.bool)
        if counts is not None:
            real = torch.arange(rows, device=y.device)[None] < counts[:, None]
        # (G, B, N): each group's rows of each table
        group_ids = torch.arange(num_groups, device=y.device)[:, None, None]
        member = (node_labels[None] == group_ids) & real
        child_counts = member.sum(2)
        width = int(child_counts.max())  # the one host read of this node
        # Each table's rows of the group, in their order, first; then other rows (padding).
        order = torch.argsort((~member).to(torch.int8), dim=2, stable=True)[:, :, :width]
        padded = torch.arange(width, device=y.device) >= child_counts[:, :, None]
        if max(sizes) <= self.max_classes and num_groups * (width + R_test.shape[1]) <= 2 * (
            rows + R_test.shape[1]
        ):
            # Every child is a leaf: one ICL pass for all of them, the groups' tables stacked
            # along the batch (padded rows are never keys, so each answer is the one its
            # node's own pass gives), at most twice the rows of this node's pass.
            starts = [sum(sizes[:g]) for g in range(num_groups)]
            first = torch.tensor(starts, device=y.device)
            child_local = torch.gather(local[None].expand(num_groups, -1, -1), 2, order)
            child_local = (child_local - first[:, None, None]).masked_fill(padded, 0)
            child_R = torch.gather(
                R_train[None].expand(num_groups, -1, -1, -1),
                2,
                order[..., None].expand(-1, -1, -1, R_train.shape[-1]),
            )
            probs = self._node_probs(
                child_R.flatten(0, 1),
                child_local.flatten(0, 1),
                child_counts.flatten(),
                R_test.repeat(num_groups, 1, 1),
                self.max_classes,
                sizes=sizes,
            ).unflatten(0, (num_groups, tables))
            for g, (start, size) in enumerate(zip(starts, sizes)):
                child_classes = classes[start : start + size]
                out[:, :, child_classes] = probs[g, :, :, :size] * group_probs[:, :, g : g + 1]
            return out
        for g in range(num_groups):
            child_classes = classes[groups == g]
            child_y = torch.gather(y, 1, order[g]).masked_fill(padded[g], int(child_classes[0]))
            rows_of_g = order[g][..., None].expand(-1, -1, R_train.shape[-1])
            child_R = torch.gather(R_train, 1, rows_of_g)
            uniform = bool((child_counts[g] == width).all())
            child = self._hierarchy(
                child_R,
                child_y,
                None if uniform else child_counts[g],
                R_test,
                child_classes,
                num_classes,
            )
            out += child * group_probs[:, :, g : g + 1]
        return out

    def _node_probs(
        self,
        R_train: Tensor,
        labels: Tensor,
        counts: Tensor | None,
        R_test: Tensor,
        num_labels: int,
        sizes: Sequence[int] | None = None,
    ) -> Tensor:
        """Softmax over each table's first ``num_labels`` logits; ``sizes``: the tables come in
        ``len(sizes)`` equal runs, run ``g`` over its first ``sizes[g]`` logits (0 past them)."""
        logits = self(torch.cat([R_train, R_test], dim=1), labels, counts)[:, :, :num_labels]
        if sizes is None:
            return torch.softmax(logits / HIERARCHY_TEMPERATURE, dim=-1)
        runs = len(logits) // len(sizes)
        limit = torch.tensor(sizes, device=logits.device).repeat_interleave(runs)
        beyond = torch.arange(num_labels, device=logits.device) >= limit[:, None, None]
        logits = (logits / HIERARCHY_TEMPERATURE).masked_fill(beyond, -torch.inf)
        return torch.softmax(logits, dim=-1)
