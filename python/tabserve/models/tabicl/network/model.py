"""``TabICLv2``: the TabICLv2 network (column embedding -> row interaction -> in-context learning).

State_dict-compatible with ``tabicl.TabICL`` 2.2.0 for v2 checkpoints (classifier: 10 logits;
regressor: 999 quantiles, bias-free LayerNorms). Inputs are already-preprocessed tables: ``X`` is
``(B, N + M, H)`` float with the ``N`` train rows first, ``y_train`` is ``(B, N)``: class indices
``0..K-1`` stored as floats (classification) or standardised targets (regression). Tables in a
batch are independent (the estimators batch ensemble members this way).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .checkpoint import (
    CheckpointError,
    PathLike,
    load_checkpoint,
    read_checkpoint,
    save_safetensors,
)
from .config import TabICLv2Config
from .embedding import ColumnEmbedding
from .interaction import RowInteraction
from .layers import KeyValue, chunk_slices, extension_ops
from .learning import HIERARCHY_LOG_EPS, InContextLearner
from .quantiles import quantile_stats
from .transfer import device_values


def _not_finite(name: str) -> str:
    return f"{name} contains NaN or infinite values; impute / clean the table first"


#: The methods that read check verdicts on the host (see :meth:`TabICLv2.check_inputs`).
HOST_CHECKS = ("check_inputs", "settle_checks")


def eager_host_checks() -> None:
    """Marks :data:`HOST_CHECKS` to run eagerly under ``torch.compile``
    (``torch.compiler.disable``), once per process: whatever compiles the model calls it
    (:meth:`TabICLv2.compile`, a served model whose options compile)."""
    for name in HOST_CHECKS:
        method = getattr(TabICLv2, name)
        if not getattr(method, "_tabserve_eager", False):
            eager = torch.compiler.disable(method)
            eager._tabserve_eager = True
            setattr(TabICLv2, name, eager)


def padded_counts(device: torch.device, n_train: int, n_features: int) -> tuple[Tensor, Tensor]:
    """The real train-row and feature counts of a padded table as 0-d int64 tensors on
    ``device`` (what the padded entry points read instead of shapes)."""
    return (
        device_values(n_train, torch.int64, device),
        device_values(n_features, torch.int64, device),
    )


@dataclass
class TabICLv2Cache:
    """Train-side K/V of a batch of tables, built by :meth:`TabICLv2.build_cache`.

    ``col``: per ISAB block, K and V of the induced tokens, ``(B, H, heads, num_inds, head_dim)``
    (independent of the number of train rows). ``icl``: per ICL block, K and V of the train rows,
    ``(B, heads, N, head_dim)``.
    """

    col: list[KeyValue]
    icl: list[KeyValue]
    n_train: int
    n_features: int
    num_classes: int  # 0 for regression

    @property
    def batch_size(self) -> int:
        return self.icl[0][0].shape[0]

    def _map(self, fn) -> TabICLv2Cache:
        return dataclasses.replace(
            self,
            col=[(fn(k), fn(v)) for k, v in self.col],
            icl=[(fn(k), fn(v)) for k, v in self.icl],
        )

    def to(self, device=None, dtype=None) -> TabICLv2Cache:
        """Copy to another device and/or floating dtype."""
        return self._map(lambda t: t.to(device=device, dtype=dtype))

    def select(self, tables: slice) -> TabICLv2Cache:
        """The cache of a slice of the batch (views, no copy)."""
        return self._map(lambda t: t[tables])

    @staticmethod
    def concat(caches: Sequence[TabICLv2Cache]) -> TabICLv2Cache:
        """Concatenate caches of the same train table along the batch axis."""
        first = caches[0]
        stack = lambda parts: [
            tuple(torch.cat(kv, dim=0) for kv in zip(*layer)) for layer in zip(*parts)
        ]
        return dataclasses.replace(
            first, col=stack([c.col for c in caches]), icl=stack([c.icl for c in caches])
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.col + self.icl for t in kv)


@dataclass
class TabICLv2ReprCache:
    """Train-side state of a batch of tables for ``kv_cache="repr"`` (the reference's other
    cache mode): the column stage's induced K/V and the train rows' representations after the
    row stage, ``(B, N, E)``, with their labels. Smaller than :class:`TabICLv2Cache` (no K/V
    per ICL block); a prediction runs the ICL stage over train and test rows again."""

    col: list[KeyValue]
    train_repr: Tensor
    y_train: Tensor
    n_train: int
    n_features: int
    num_classes: int  # 0 for regression

    @property
    def batch_size(self) -> int:
        return self.train_repr.shape[0]


#: The KV-cache modes (the reference's ``kv_cache``): ICL K/V, or row representations.
CACHE_MODES = ("kv", "repr")


class TabICLv2(nn.Module):
    """TabICLv2 inference module. Build with :meth:`from_checkpoint`.

    Submodules (state_dict prefixes as in the reference): ``col_embedder``, ``row_interactor``,
    ``icl_predictor``. CPU and CUDA; no masks, no dropout; runs under ``torch.no_grad``.
    """

    #: Whether :meth:`forward` queues the network before it reads the input checks' verdict
    #: (:meth:`queue_checks`). What it buys: the network's compiled graph no longer depends on
    #: the class count K, which the host learns from the verdict, so a table of a new K
    #: recompiles a slice, not the network (under whole-model compile); no device idling
    #: between the checks and the network (the large workload's one-shot latency on the H200
    #: is the same either way, 120.1 ms). False (per model, or here for every model) reads the
    #: verdict first.
    defer_checks = True

    def __init__(self, config: TabICLv2Config):
        super().__init__()
        self.config = config
        ln_bias = not config.bias_free_ln
        e, ff = config.embed_dim, config.ff_factor
        self.col_embedder = ColumnEmbedding(
            e,
            config.col_num_blocks,
            config.col_nhead,
            e * ff,
            config.col_num_inds,
            ln_bias,
            config.max_classes,
            config.col_feature_group_size,
        )
        self.row_interactor = RowInteraction(
            config.row_num_blocks,
            e,
            config.row_nhead,
            e * ff,
            config.row_num_cls,
            ln_bias,
            config.row_rope_base,
        )
        d = config.icl_dim
        self.icl_predictor = InContextLearner(
            config.icl_num_blocks,
            d,
            config.icl_nhead,
            d * ff,
            ln_bias,
            config.max_classes,
            config.out_dim,
        )
        #: Whether the last call checked had more classes than one output holds (the class
        #: hierarchy): the next call then reads its verdict first rather than run a network
        #: whose output it would discard. A flag, not K: Dynamo guards on it, and a stream of
        #: tables of varying K must not recompile.
        self._last_call_many_classes = False
        self.eval()

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def from_checkpoint(cls, path: PathLike, device: str | torch.device | None = None) -> TabICLv2:
        """Load a reference ``.ckpt`` (``weights_only=True``) or a tabserve ``.safetensors`` file.

        The network is built on the ``meta`` device (no random initialisation: every weight
        comes from the file) and its weights are copied straight to ``device`` (default CPU).
        A file is read once per process while it is unchanged
        (:func:`~.checkpoint.read_checkpoint`); every call returns a model of its own.

        Raises:
            FileNotFoundError, CheckpointError (unreadable / wrong tensors), ConfigError
            (missing, contradictory or non-v2 config).
        """
        config, state_dict = read_checkpoint(path)
        with torch.device("meta"):
            model = cls(config)
        model.load_reference_state_dict(state_dict, source=str(path), device=device or "cpu")
        return model

    def load_reference_state_dict(
        self, state_dict: dict[str, Tensor], source: str = "state_dict", device=None
    ) -> None:
        """Strictly load a reference state_dict; mismatches name the config keys to check.
        A model built on ``meta`` gets copies of the tensors on ``device`` (default: where its
        buffers are), in its own dtypes; a materialised one copies them into its parameters."""
        own = self.state_dict()
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        shapes = sorted(
            k for k in set(own) & set(state_dict) if own[k].shape != state_dict[k].shape
        )
        if missing or unexpected or shapes:
            details = "; ".join(
                f"{name}: {keys[:4]}{' ...' if len(keys) > 4 else ''}"
                for name, keys in (
                    ("missing", missing),
                    ("unexpected", unexpected),
                    ("shape mismatch", shapes),
                )
                if keys
            )
            raise CheckpointError(
                f"{source}: weights contradict the config {self.config} ({details}); check bias_free_ln, "
                "max_classes, num_quantiles and the block / head counts"
            )
        if any(t.is_meta for t in own.values()):
            target = torch.device(device) if device is not None else self.col_embedder.group_offsets.device
            copies = {k: v.to(target, own[k].dtype, copy=True) for k, v in state_dict.items()}
            self.load_state_dict(copies, assign=True)
            self.to(target)  # the buffers no checkpoint holds
            return
        self.load_state_dict({k: v.to(own[k].dtype) for k, v in state_dict.items()})
        if device is not None:
            self.to(device)

    def save_safetensors(self, path: PathLike) -> Path:
        """Export weights + config to one safetensors file (config as JSON metadata)."""
        return save_safetensors(self.config, self.state_dict(), path)

    # ------------------------------------------------------------------ input checks
    @property
    def is_regressor(self) -> bool:
        return self.config.is_regression

    def _device_dtype(self):
        p = self.icl_predictor.ln.weight
        return p.device, p.dtype

    def _check_table_later(self, X: Tensor, name: str = "X") -> tuple[Tensor, Tensor]:
        """Validates a table ``(B, rows, features)`` without reading its values: returns it in
        the model's dtype and its finiteness as a 0-d device tensor, which the caller passes to
        :meth:`raise_unless_all_finite` once its kernels are queued (no host synchronisation
        before them)."""
        X = self.check_table_shape(X, name)
        return X.to(self._device_dtype()[1]), torch.isfinite(X).all()

    def check_test_rows_later(self, X_test: Tensor, cache: TabICLv2Cache) -> tuple[Tensor, Tensor]:
        """:meth:`_check_table_later` of test rows for ``cache``, whose table count and
        features they must match."""
        X_test, finite = self._check_table_later(X_test, "X_test")
        if X_test.shape[0] != cache.batch_size or X_test.shape[2] != cache.n_features:
            raise ValueError(
                f"X_test {tuple(X_test.shape)} does not match the cache ({cache.batch_size} tables, "
                f"{cache.n_features} features)"
            )
        return X_test, finite

    @staticmethod
    def raise_unless_all_finite(finite: Tensor, name: str) -> None:
        """ValueError naming ``name`` unless ``finite`` (a 0-d bool, read on the host) holds."""
        if not finite:
            raise ValueError(_not_finite(name))

    def compile(self, *args, **kwargs) -> None:
        """:meth:`torch.nn.Module.compile`, the host checks run eagerly (:func:`eager_host_checks`)."""
        eager_host_checks()
        super().compile(*args, **kwargs)

    def check_table_shape(self, X: Tensor, name: str) -> Tensor:
        """The checks of a table that need no look at its values (no host synchronisation)."""
        if not isinstance(X, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(X).__name__}")
        if not X.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {X.dtype}")
        if X.dim() != 3:
            raise ValueError(f"{name} must be (tables, rows, features), got shape {tuple(X.shape)}")
        if X.shape[2] == 0 or X.shape[0] == 0:
            raise ValueError(f"{name} has no features or no tables: shape {tuple(X.shape)}")
        device, _ = self._device_dtype()
        if X.device != device:
            raise ValueError(f"{name} is on {X.device} but the model is on {device}")
        return X

    # The checks' verdict is read on the host: Dynamo runs these two eagerly (one graph break
    # at their call) rather than trace the rest of them from the ints the verdict holds. Under
    # ``dynamic=True`` those ints become symbols, and torch 2.11's Inductor emitted a graph for
    # ``K > max_classes`` that names a symbol it never binds (a NameError at the first call of
    # a dynamic-shape compile on the H200). They are marked so by :func:`eager_host_checks`
    # when something compiles the model, not here: that import is Dynamo's (1.6 s).
    def check_inputs(self, X: Tensor, y_train: Tensor, name: str = "X") -> tuple[Tensor, int]:
        """Validate a table and its train labels; returns ``(X in the model's dtype, K)`` with
        K the number of classes (0 for regression).

        Every check that reads values is one ``tabserve::table_checks`` kernel whose verdict
        reaches the host in one transfer (:meth:`_classes_from_verdict`); only a call it finds
        fault with (or a build without the extension) runs the ATen checks
        (:meth:`_checks_in_aten`), which name the fault and also end in one transfer: on a GPU
        the checks cost one synchronisation, not the eight of checking each rule on its own
        (the H200 profile of a small table showed 8 reads and 10 stream synchronisations per
        call before that).
        """
        X = self.check_table_shape(X, name)
        self.check_label_shape(X, y_train)
        ops = extension_ops()
        accepted = None
        if ops is not None and y_train.dtype in ops.TABLE_CHECK_LABEL_DTYPES:
            summary = ops.table_checks(X, y_train, not self.is_regressor).tolist()
            accepted = self._classes_from_verdict(summary)
        num_classes = self._checks_in_aten(X, y_train, name) if accepted is None else accepted
        self._last_call_many_classes = num_classes > self.config.max_classes
        return X.to(self._device_dtype()[1]), num_classes

    def _checks_in_aten(self, X: Tensor, y_train: Tensor, name: str) -> int:
        """The value checks as ATen ops, for a call the operator found fault with or could not
        check: raises the precise error, else returns K (0 for regression)."""
        flags = [torch.isfinite(X).all(), torch.isfinite(y_train).all()]
        if self.is_regressor:
            x_finite, y_finite = torch.stack(flags).tolist()
            self._raise_unless_finite(name, x_finite, y_finite)
            return 0
        # Labels 0..K-1 in every table: the distinct labels per table (from the sorted rows)
        # and each table's largest label, in float64: a cast to int64 would wrap labels past
        # 2^63 (1e19 became a negative number and passed these checks, then failed in one_hot).
        # (float64 also takes bool labels, which have no round().)
        labels = y_train.double()
        flags.append(((labels == labels.round()) & (labels >= 0)).all())
        labels = torch.nan_to_num(labels, nan=0.0, posinf=0.0, neginf=0.0)
        ordered = labels.sort(dim=1).values
        distinct = 1 + (ordered[:, 1:] != ordered[:, :-1]).sum(dim=1)
        summary = torch.cat([torch.stack(flags).double(), distinct.double(), ordered[:, -1]])
        summary = summary.tolist()
        x_finite, y_finite, integral = summary[:3]
        tables = X.shape[0]
        counts = [int(count) for count in summary[3 : 3 + tables]]
        largest = summary[3 + tables :]
        self._raise_unless_finite(name, x_finite, y_finite)
        if not integral:
            raise ValueError("classification labels must be non-negative integers 0..K-1")
        num_classes = counts[0]
        if any(count != num_classes for count in counts):
            raise ValueError(f"all tables must have the same number of classes, got {counts}")
        if max(largest) >= num_classes:
            raise ValueError(
                f"labels of every table must be exactly 0..K-1 (K={num_classes}); re-encode them"
            )
        return num_classes

    def _classes_from_verdict(self, summary: list) -> int | None:
        """K (0 for regression) when ``tabserve::table_checks``' verdict (read to the host)
        finds nothing wrong with the call: one kernel and one transfer instead of the
        fifteen-odd ATen ops of :meth:`_checks_in_aten` (most of a small table's time before
        its replayed graph in an H200 profile of the small preset). None whenever it finds a fault: the ATen
        checks then raise the precise error."""
        if summary[0] or summary[1]:
            return None
        if self.is_regressor:
            return 0
        bad, distinct, largest = summary[2::3], summary[3::3], summary[4::3]
        num_classes = distinct[0]
        if any(bad) or any(d != num_classes for d in distinct):
            return None
        if any(label != num_classes - 1 for label in largest):
            return None
        return num_classes

    def queue_checks(self, X: Tensor, y_train: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        """For a table that passed the shape checks: ``(X in the model's dtype, its labels as
        the network reads them, the table_checks verdict on the device)``, without reading the
        verdict, when this call defers it (:attr:`defer_checks`; the extension built; labels of
        a dtype the operator takes; test rows to predict; the last call's K within one
        output). The caller queues the network, then :meth:`settle_checks` reads the verdict:
        one synchronisation, after every kernel is queued (reading it first left the device
        idle for 1.13 ms in a profiled large call on the H200, though not in unprofiled ones).
        None: read it first (:meth:`check_inputs`)."""
        ops = extension_ops()
        if (
            not self.defer_checks
            or self._last_call_many_classes
            or ops is None
            or y_train.dtype not in ops.TABLE_CHECK_LABEL_DTYPES
            or X.shape[1] == y_train.shape[1]
        ):
            return None
        verdict = ops.table_checks(X, y_train, not self.is_regressor)
        X = X.to(self._device_dtype()[1])
        return X, self._indexable_labels(y_train, X.dtype), verdict

    def _indexable_labels(self, y_train: Tensor, dtype: torch.dtype) -> Tensor:
        """The train labels in ``dtype``, made safe for the network to index with before their
        checks are read: classification labels outside ``0..max_classes - 1`` (NaN, inf,
        negative, too large) are moved inside, valid ones stay as they are. A call with such
        labels raises in :meth:`settle_checks`, so nothing computed from them is returned;
        without this a label past the one-hot width would fault the device."""
        labels = y_train.to(dtype)
        if self.is_regressor:  # regression targets are never indices
            return labels
        labels = torch.nan_to_num(labels, nan=0.0, posinf=0.0, neginf=0.0)
        return labels.clamp(0, self.config.max_classes - 1)

    def settle_checks(self, X: Tensor, y_train: Tensor, verdict: Tensor, name: str = "X") -> int:
        """Reads a queued verdict (:meth:`queue_checks`; ``X`` and ``y_train`` as the caller
        gave them): K (0 for regression), or the ATen checks' precise error."""
        accepted = self._classes_from_verdict(verdict.tolist())
        num_classes = self._checks_in_aten(X, y_train, name) if accepted is None else accepted
        self._last_call_many_classes = num_classes > self.config.max_classes
        return num_classes

    def check_label_shape(self, X: Tensor, y_train: Tensor) -> None:
        """TypeError / ValueError unless ``y_train`` is a ``(tables, train rows)`` tensor on
        ``X``'s device with at least one and at most ``X``'s rows (no look at its values)."""
        if not isinstance(y_train, Tensor):
            raise TypeError(f"y_train must be a torch.Tensor, got {type(y_train).__name__}")
        if y_train.dim() != 2 or y_train.shape[0] != X.shape[0]:
            raise ValueError(
                f"y_train must be (tables, train rows) = ({X.shape[0]}, N), got {tuple(y_train.shape)}"
            )
        if y_train.shape[1] == 0:
            raise ValueError("y_train has zero train rows; at least one labelled row is required")
        if y_train.shape[1] > X.shape[1]:
            raise ValueError(f"{y_train.shape[1]} train labels for only {X.shape[1]} rows")
        if y_train.device != X.device:
            raise ValueError(f"y_train is on {y_train.device} but X is on {X.device}")
        if not self.is_regressor and y_train.is_complex():
            raise ValueError("classification labels must be non-negative integers 0..K-1")

    @staticmethod
    def _raise_unless_finite(name: str, x_finite: bool, y_finite: bool) -> None:
        if not x_finite:
            raise ValueError(_not_finite(name))
        if not y_finite:
            raise ValueError("y_train contains NaN or infinite values")

    # ------------------------------------------------------------------ forward
    def _representations(self, X: Tensor, y_train: Tensor, num_classes: int) -> Tensor:
        # num_classes comes from the label checks: reading it again from the labels in the
        # column stage would stall the host on the GPU.
        prefix = self.row_interactor.column_prefix()
        E = self.col_embedder(X, y_train, num_classes=num_classes, row_prefix=prefix)
        return self.row_interactor(E, prefixed=prefix is not None)

    def classify(
        self, raw: Tensor, num_classes: int, return_logits: bool, temperature: float
    ) -> Tensor:
        """The classification head's read-out: the first ``num_classes`` of the raw outputs as
        logits, or their softmax at ``temperature``."""
        logits = raw[..., :num_classes]
        return logits if return_logits else torch.softmax(logits / temperature, dim=-1)

    @torch.no_grad()
    def forward(
        self,
        X: Tensor,
        y_train: Tensor,
        return_logits: bool = True,
        softmax_temperature: float = 0.9,
    ) -> Tensor:
        """Predictions for the test rows ``X[:, N:]``.

        Classification: ``(B, M, K)`` logits (or ``softmax(logits / T)`` probabilities with
        ``return_logits=False``); K > max_classes goes through mixed-radix column embedding and the
        class hierarchy (logits are then ``T * log(p + 1e-6)``). Regression: raw quantiles
        ``(B, M, num_quantiles)`` (unsorted, as the network outputs them).

        The checks that read values are queued with the network and read once it is queued
        (:meth:`queue_checks`): a bad table still raises, after its kernels ran on labels made
        safe to index with; a table of more classes than one output holds then runs again
        through the class hierarchy, and the next call reads its verdict first.

        Raises:
            TypeError: non-tensor or non-float X / y_train. ValueError: bad shapes, NaN/inf, zero
            train rows, device mismatch, labels that are not 0..K-1 in every table.
        """
        X = self.check_table_shape(X, "X")
        self.check_label_shape(X, y_train)
        queued = self.queue_checks(X, y_train)
        if queued is not None:  # the network first, then the verdict
            raw = self.forward_raw(queued[0], queued[1])
            num_classes = self.settle_checks(X, y_train, queued[2])
            if num_classes <= self.config.max_classes:
                return (
                    raw
                    if self.is_regressor
                    else self.classify(raw, num_classes, return_logits, softmax_temperature)
                )
            # More classes than one output holds: the class hierarchy below (raw discarded).
        X, num_classes = self.check_inputs(X, y_train)
        if X.shape[1] == y_train.shape[1]:  # no test rows: nothing to predict
            return self.no_predictions(X, num_classes)
        y_train = y_train.to(X.dtype)
        if num_classes > self.config.max_classes:
            R = self._representations(X, y_train, num_classes)
            return self._read_out(R, y_train, num_classes, return_logits, softmax_temperature)
        raw = self.forward_raw(X, y_train)  # the one-output network's single entry point
        if self.is_regressor:
            return raw
        return self.classify(raw, num_classes, return_logits, softmax_temperature)

    def _read_out(
        self, R: Tensor, y_train: Tensor, num_classes: int, return_logits: bool, temperature: float
    ) -> Tensor:
        """The in-context stage and the head's read-out from the row representations: the class
        hierarchy past ``max_classes`` classes, else one output."""
        if num_classes > self.config.max_classes:
            probs = self.icl_predictor.hierarchical_probs(R, y_train)
            return temperature * torch.log(probs + HIERARCHY_LOG_EPS) if return_logits else probs
        raw = self.icl_predictor(R, y_train)
        return raw if self.is_regressor else self.classify(raw, num_classes, return_logits, temperature)

    @torch.no_grad()
    def forward_offloaded(
        self,
        X: Tensor,
        y_train: Tensor,
        store,
        return_logits: bool = True,
        softmax_temperature: float = 0.9,
    ) -> Tensor:
        """As :meth:`forward`, the column stage's output kept in ``store`` (:mod:`.offload`:
        host memory or a file) instead of on the device, and streamed back to the row stage a
        chunk of rows at a time: the device holds one chunk of either stage (tabicl's
        ``offload_mode="cpu"`` / ``"disk"``). The same numbers as :meth:`forward`."""
        X, num_classes = self.check_inputs(X, y_train)
        if X.shape[1] == y_train.shape[1]:
            return self.no_predictions(X, num_classes)
        y_train = y_train.to(X.dtype)
        batch, rows, features = X.shape
        tokens = batch * (features + self.config.row_num_cls)
        parts = chunk_slices(rows, tokens, self.row_interactor.max_tokens)
        blocks = self.col_embedder.offloaded(X, y_train, num_classes, store, parts)  # (H, B, T, E)
        R = torch.cat(
            [
                self.row_interactor(block.to(X.device, non_blocking=True).permute(1, 2, 0, 3))
                for block in blocks
            ],
            dim=1,
        )
        return self._read_out(R, y_train, num_classes, return_logits, softmax_temperature)

    def no_predictions(self, X: Tensor, num_classes: int) -> Tensor:
        """The output for zero test rows: ``(B, 0, K)``, or ``(B, 0, num_quantiles)``."""
        width = self.config.num_quantiles if self.is_regressor else num_classes
        return X.new_empty((X.shape[0], 0, width))

    def require_regressor(self) -> None:
        """ValueError unless this is a regression checkpoint."""
        if not self.is_regressor:
            raise ValueError("quantile statistics need a regression checkpoint (max_classes == 0)")

    @torch.no_grad()
    def predict_stats(
        self,
        X: Tensor,
        y_train: Tensor,
        output_type: str | Sequence[str] = "mean",
        alphas: Sequence[float] | None = None,
    ) -> Tensor | dict[str, Tensor]:
        """Regression statistics of the test rows (see :func:`quantiles.quantile_stats`)."""
        self.require_regressor()
        return quantile_stats(self(X, y_train), output_type, alphas)

    # ------------------------------------------------------------------ padded (bucketed) core
    # The serving layer (:mod:`..serving.served`) checks and pads tables and calls these; they take the
    # real train-row and feature counts as 0-d device tensors so that one compiled or captured
    # graph serves every table of a bucket. No checks, no host synchronisation in here.
    def padded_representations(
        self,
        X: Tensor,
        y_train: Tensor,
        n_train: Tensor,
        n_features: Tensor,
        num_classes: int | None = None,
    ) -> Tensor:
        """Row representations ``(B, Nb + Mb, D)`` of a padded table.

        ``X (B, Nb + Mb, Hb)``: train rows at ``[0, n_train)``, test rows from ``Nb``, features at
        ``[0, n_features)``; ``y_train (B, Nb)`` with any valid label in the padded slots. The
        counts are 0-d (every table of the batch one size) or ``(B,)`` int64: tables of several
        sizes on one bucket, each attending only to its own real rows and features.
        ``num_classes`` only matters past ``max_classes`` (mixed-radix column embedding).
        """
        if num_classes is None:
            num_classes = self.config.max_classes
        prefix = self.row_interactor.column_prefix()
        E = self.col_embedder(X, y_train, n_train, n_features, num_classes, prefix)
        return self.row_interactor(E, n_features, prefixed=prefix is not None)

    def padded_forward(
        self, X: Tensor, y_train: Tensor, n_train: Tensor | None, n_features: Tensor | None
    ) -> Tensor:
        """Raw head outputs ``(B, Mb, out_dim)`` of the test block of a padded table (at most
        ``max_classes`` classes; see :meth:`padded_representations` for the layout). Counts of
        None: tables that fill the bucket, on the unmasked path (:meth:`forward_raw`'s)."""
        R = self.padded_representations(X, y_train, n_train, n_features)
        return self.icl_predictor(R, y_train, n_train)

    def padded_build_cache(
        self, X_train: Tensor, y_train: Tensor, n_train: Tensor, n_features: Tensor
    ) -> tuple[list[KeyValue], list[KeyValue]]:
        """Column and ICL K/V of a padded train block ``(B, Nb, Hb)`` (padded keys included)."""
        prefix = self.row_interactor.column_prefix()
        embeddings, col = self.col_embedder.build_cache(
            X_train, y_train, n_train, n_features, prefix
        )
        R = self.row_interactor(embeddings, n_features, prefixed=prefix is not None)
        return col, self.icl_predictor.build_cache(R, y_train, n_train)

    def padded_forward_cached(
        self,
        X_test: Tensor,
        col: Sequence[KeyValue],
        icl: Sequence[KeyValue],
        n_train: Tensor,
        n_features: Tensor,
    ) -> Tensor:
        """Raw head outputs ``(B, Mb, out_dim)`` of padded test rows against a padded cache."""
        prefix = self.row_interactor.column_prefix()
        embeddings = self.col_embedder.forward_cached(X_test, col, n_features, prefix)
        R = self.row_interactor(embeddings, n_features, prefixed=prefix is not None)
        return self.icl_predictor.forward_cached(R, icl, n_train)

    # ------------------------------------------------------------------ KV cache
    @torch.no_grad()
    def build_cache(self, X_train: Tensor, y_train: Tensor, mode: str = "kv"):
        """Run the train rows once and keep the column-stage and ICL K/V (``mode="kv"``, a
        :class:`TabICLv2Cache`), or the column-stage K/V and the train rows' representations
        (``mode="repr"``, a :class:`TabICLv2ReprCache`).

        Raises:
            ValueError: as :meth:`forward`; also for more than ``max_classes`` classes (the
            mixed-radix / hierarchical path runs several passes and cannot be cached), and for
            another ``mode``.
        """
        if mode not in CACHE_MODES:
            raise ValueError(f"mode must be one of {CACHE_MODES}, got {mode!r}")
        X_train, num_classes = self.check_inputs(X_train, y_train, "X_train")
        if y_train.shape[1] != X_train.shape[1]:
            raise ValueError(
                f"X_train has {X_train.shape[1]} rows but y_train has {y_train.shape[1]} labels"
            )
        if num_classes > self.config.max_classes:
            raise ValueError(
                f"the KV cache does not support {num_classes} classes (> max_classes={self.config.max_classes})"
            )
        y_train = y_train.to(X_train.dtype)
        prefix = self.row_interactor.column_prefix()
        embeddings, col = self.col_embedder.build_cache(X_train, y_train, row_prefix=prefix)
        R = self.row_interactor(embeddings, prefixed=prefix is not None)
        if mode == "repr":
            return TabICLv2ReprCache(col, R, y_train, y_train.shape[1], X_train.shape[2], num_classes)
        icl = self.icl_predictor.build_cache(R, y_train)
        if R.device.type == "cpu":
            # The K / V are head-split views of one projection, and each cached prediction
            # reads them whole: from contiguous copies, a 1-row prediction of the suite's quick
            # wide-rows table went from 1.19-1.21x tabicl's time to 1.01x, 100 rows from
            # 0.94-0.96x to 0.92x (2-core CPU, paired medians). CUDA's attention kernels take
            # the strides as they come (not measured there).
            icl = [(k.contiguous(), v.contiguous()) for k, v in icl]
        return TabICLv2Cache(col, icl, y_train.shape[1], X_train.shape[2], num_classes)

    @torch.no_grad()
    def forward_with_cache(
        self,
        X_test: Tensor,
        cache: TabICLv2Cache,
        return_logits: bool = True,
        softmax_temperature: float = 0.9,
    ) -> Tensor:
        """Same output as :meth:`forward` on ``[X_train; X_test]``, from test rows ``(B, M, H)`` only.

        The finiteness of ``X_test`` is read once every kernel of the prediction is queued: a
        table with NaN or inf still raises, but the device never waits on the host between the
        check and the model (on the H200 the check's read came before the launches and left
        the device idle while they began, one of the gaps of a 24 ms cached predict on the large
        workload)."""
        X_test, finite = self.check_test_rows_later(X_test, cache)
        if X_test.shape[1] == 0:
            out = self.no_predictions(X_test, cache.num_classes)
        else:
            if isinstance(cache, TabICLv2ReprCache):
                raw = self.forward_repr_cached_raw(X_test, cache)
            else:
                raw = self.forward_cached_raw(X_test, cache.col, cache.icl)
            out = (
                raw
                if self.is_regressor
                else self.classify(raw, cache.num_classes, return_logits, softmax_temperature)
            )
        self.raise_unless_all_finite(finite, "X_test")
        return out

    def forward_raw(self, X: Tensor, y_train: Tensor) -> Tensor:
        """The network's raw output ``(B, M, out_dim)`` for the test rows of ``X (B, N + M, H)``
        (in the model's dtype) with train labels ``y_train (B, N)`` in X's dtype, for tables of
        at most ``max_classes`` classes (regression included): no checks, no host work (a graph
        serving captures). The number of classes does not enter: one output serves any K up to
        ``max_classes`` (the caller keeps the first K logits)."""
        R = self._representations(X, y_train, self.config.max_classes)
        return self.icl_predictor(R, y_train)

    def forward_cached_raw(self, X_test: Tensor, col: list, icl: list) -> Tensor:
        """The network's raw output for test rows ``(B, M, H)`` (in the model's dtype) from a
        cache's column and ICL parts: no checks, no host work (a graph serving captures).
        Test rows never attend to each other: each row's output depends on that row alone."""
        prefix = self.row_interactor.column_prefix()
        embeddings = self.col_embedder.forward_cached(X_test, col, row_prefix=prefix)
        R = self.row_interactor(embeddings, prefixed=prefix is not None)
        return self.icl_predictor.forward_cached(R, icl)

    def forward_repr_cached_raw(self, X_test: Tensor, cache: TabICLv2ReprCache) -> Tensor:
        """The raw output for test rows from a representation cache: the column stage from its
        induced K/V and the row stage for the test rows, then the ICL stage over the cached
        train representations followed by the test rows'."""
        prefix = self.row_interactor.column_prefix()
        embeddings = self.col_embedder.forward_cached(X_test, cache.col, row_prefix=prefix)
        R_test = self.row_interactor(embeddings, prefixed=prefix is not None)
        R = torch.cat([cache.train_repr, R_test.to(cache.train_repr.dtype)], dim=1)
        return self.icl_predictor(R, cache.y_train)

    @torch.no_grad()
    def predict_stats_with_cache(
        self,
        X_test: Tensor,
        cache: TabICLv2Cache,
        output_type: str | Sequence[str] = "mean",
        alphas: Sequence[float] | None = None,
    ) -> Tensor | dict[str, Tensor]:
        """Regression statistics from test rows only (cached train side)."""
        self.require_regressor()
        return quantile_stats(self.forward_with_cache(X_test, cache), output_type, alphas)
