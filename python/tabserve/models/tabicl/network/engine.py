"""What every way of running TabICLv2 offers: the plain network (:class:`~.model.TabICLv2`),
the served model (:class:`~..serving.served.ServedTabICL`) and the compiling one
(:class:`~..serving.background.CompilingTabICL`) each implement :class:`Engine`, and the
estimators use nothing else of them.

Shapes: ``X`` ``(tables, train rows + test rows, features)`` float, ``y_train``
``(tables, train rows)`` float (class indices, or standardised targets for regression),
``X_test`` ``(tables, test rows, features)``; the outputs are per table and test row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from .config import TabICLv2Config


@runtime_checkable
class Engine(Protocol):
    """One-shot calls, a KV cache built once and predictions from it, for classification and
    regression checkpoints alike."""

    @property
    def config(self) -> TabICLv2Config: ...

    @property
    def is_regressor(self) -> bool: ...

    def __call__(
        self, X: Tensor, y_train: Tensor, return_logits: bool = True, softmax_temperature: float = 0.9
    ) -> Tensor:
        """Classification logits or probabilities ``(tables, test rows, classes)``; for a
        regressor, the quantiles ``(tables, test rows, quantiles)``."""

    def predict_stats(
        self, X: Tensor, y_train: Tensor, output_type: str | Sequence[str] = "mean", alphas=None
    ) -> Tensor | dict[str, Tensor]:
        """A regressor's statistics of the predicted distribution (:mod:`.quantiles`)."""

    def forward_offloaded(
        self,
        X: Tensor,
        y_train: Tensor,
        store: Any,
        return_logits: bool = True,
        softmax_temperature: float = 0.9,
    ) -> Tensor:
        """As ``__call__``, the column stage's output kept in ``store`` (:mod:`.offload`) and
        streamed back to the device a chunk of rows at a time."""

    def padded_forward(
        self, X: Tensor, y_train: Tensor, n_train: Tensor | None, n_features: Tensor | None
    ) -> Tensor:
        """Raw head outputs ``(tables, test bucket, out_dim)`` of tables padded onto one bucket
        (:meth:`~.model.TabICLv2.padded_representations` gives the layout); ``n_train`` /
        ``n_features`` hold the real counts, 0-d for one size or ``(tables,)`` for tables of
        several sizes packed together, or None for tables that fill the bucket (no padding:
        the unmasked path). No checks: the caller's tables are checked already."""

    def build_cache(self, X_train: Tensor, y_train: Tensor, mode: str = "kv") -> Any:
        """The train rows' state (``mode="kv"``: K/V per block; ``"repr"``: representations),
        for the ``*_with_cache`` calls."""

    def forward_with_cache(
        self, X_test: Tensor, cache: Any, return_logits: bool = True, softmax_temperature: float = 0.9
    ) -> Tensor:
        """As ``__call__``, the train rows read from ``cache``."""

    def predict_stats_with_cache(
        self, X_test: Tensor, cache: Any, output_type: str | Sequence[str] = "mean", alphas=None
    ) -> Tensor | dict[str, Tensor]:
        """As :meth:`predict_stats`, the train rows read from ``cache``."""


__all__ = ["Engine"]
