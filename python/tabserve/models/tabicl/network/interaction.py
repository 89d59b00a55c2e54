"""Stage 2: row-wise interaction.

Per row, 4 learned CLS tokens followed by the row's column tokens go through pre-LN blocks with
rotate-half RoPE (positions 0..3 for the CLS tokens, 4.. for the columns). The last block only
computes the CLS queries; their outputs are layer-normed and concatenated into one
``num_cls * E`` row vector. Rows never interact, so tall inputs run in row chunks
(:data:`ROW_STAGE_MAX_TOKENS`) with the same result and bounded activations.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .layers import AttentionBlock, RotaryEmbedding, chunk_budget, chunk_slices
from .stage_kernels import DEFAULT_KERNELS

#: Tokens (tables x rows x (CLS + column tokens)) the row stage processes in one pass; taller
#: inputs run in chunks of rows. Its activations (the feed-forward hidden layer is 4 x dim wide
#: per token) are the model's largest on tall, wide tables: 2**24 tokens keep them to a few GiB,
#: and every workload up to 8 x 10,240 rows x 64 features runs in one pass.
ROW_STAGE_MAX_TOKENS = 1 << 24


class RowEncoder(nn.Module):
    """Blocks plus the shared RoPE module (state_dict prefix ``row_interactor.tf_row``)."""

    def __init__(
        self,
        num_blocks: int,
        dim: int,
        num_heads: int,
        ff_dim: int,
        ln_bias: bool,
        rope_base: float,
    ):
        super().__init__()
        self.blocks = nn.ModuleList(
            AttentionBlock(dim, num_heads, ff_dim, ln_bias) for _ in range(num_blocks)
        )
        self.rope = RotaryEmbedding(dim // num_heads, rope_base)


class RowInteraction(nn.Module):
    """Column tokens ``(B, T, H, E)`` -> row representations ``(B, T, num_cls * E)``."""

    def __init__(
        self,
        num_blocks: int,
        dim: int,
        num_heads: int,
        ff_dim: int,
        num_cls: int,
        ln_bias: bool,
        rope_base: float,
    ):
        super().__init__()
        self.num_cls = num_cls
        self.tf_row = RowEncoder(num_blocks, dim, num_heads, ff_dim, ln_bias, rope_base)
        self.cls_tokens = nn.Parameter(torch.empty(num_cls, dim))
        self.out_ln = nn.LayerNorm(dim, bias=ln_bias)
        #: Per-instance chunking threshold (tests lower it).
        self.max_tokens = ROW_STAGE_MAX_TOKENS
        #: The stage's kernel choices (:class:`~.stage_kernels.StageKernels`).
        self.kernels = DEFAULT_KERNELS

    @property
    def tokens_from_column_stage(self) -> bool:
        """Whether the column stage hands this stage its tokens with the CLS tokens already in
        front (:meth:`column_prefix`), written by the column stage's last fused feed-forward."""
        return self.kernels.fused_row_tokens

    def column_prefix(self) -> Tensor | None:
        """The CLS tokens, for the column stage to put in front of every row of its output
        (``ColumnEmbedding``'s ``row_prefix``), or None where this stage prepends them."""
        return self.cls_tokens if self.tokens_from_column_stage else None

    def forward(
        self, embeddings: Tensor, n_features: Tensor | None = None, prefixed: bool = False
    ) -> Tensor:
        """``n_features`` (padded serving, 0-d tensor): the real column tokens; the tokens past
        ``num_cls + n_features`` are feature padding and are masked out as keys. They sit after
        every real token, so the real tokens keep their RoPE positions.

        ``prefixed``: ``embeddings`` are this stage's tokens ``(B, T, num_cls + H, E)``, CLS
        tokens first (the column stage's output with :meth:`column_prefix`).

        Inputs of more than ``max_tokens`` tokens run in chunks of rows (chunk bounds are shapes:
        a compiled or captured graph holds them fixed)."""
        batch, rows, columns = embeddings.shape[:3]
        tokens = columns if prefixed else columns + self.num_cls
        budget = chunk_budget(self.max_tokens, embeddings.device)
        chunks = chunk_slices(rows, batch * tokens, budget)
        if len(chunks) == 1:
            return self._rows(embeddings, n_features, prefixed)
        return torch.cat(
            [self._rows(embeddings[:, c], n_features, prefixed) for c in chunks], dim=1
        )

    def _rows(self, embeddings: Tensor, n_features: Tensor | None, prefixed: bool) -> Tensor:
        batch, rows = embeddings.shape[:2]
        n_keys = None if n_features is None else n_features + self.num_cls
        tokens = embeddings
        if not prefixed:
            cls = self.cls_tokens.to(embeddings.dtype).expand(batch, rows, *self.cls_tokens.shape)
            tokens = torch.cat([cls, embeddings], dim=2)
        rope = self.tf_row.rope
        *inner, last = self.tf_row.blocks
        for block in inner:
            tokens = block(tokens, rope=rope, n_keys=n_keys)
        cls_out = last(tokens[..., : self.num_cls, :], tokens, rope=rope, n_keys=n_keys)
        return self.out_ln(cls_out).flatten(-2)
