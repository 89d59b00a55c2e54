"""Bad-input sweep: every public operator, class and estimator fed malformed input.

One table of cases (``REFUSED``): each names the area it hits, a call on a shared world of fitted
objects, the exception type it must raise and a regex its message must match (the argument's name
or the rule it breaks). After every case the area's good call runs again and must give exactly its
baseline result: the process and the fitted state survive the bad input. ``ACCEPTED`` holds the
odd-but-legal inputs whose result is defined (unseen categories, NaN features, unchecked malformed
offsets): they must return that result, not raise or crash. ``test_pickled_code_is_refused``
proves a checkpoint carrying code is never executed. Counts are in docs/reference/reliability.md.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pytest
import tabserve
import torch
import torch.nn.functional as F
from cuda_helpers import NO_GPU
from sklearn.exceptions import NotFittedError as SklearnNotFittedError
from tabicl_helpers import build_reference_model, checkpoint_payload, reference_checkpoint
from tabserve import (
    AlignCategories,
    BucketGrid,
    CategoricalColumn,
    StringColumn,
    StringIndex,
    TabICLEncoder,
    Table,
    ops,
)
from tabserve.align import NotFittedError
from tabserve.models.tabicl import (
    CheckpointError,
    ConfigError,
    TabICLClassifier,
    TabICLRegressor,
    TabICLv2,
)

NAN, INF = float("nan"), float("inf")
CHECKPOINT_ERRORS = (CheckpointError, ConfigError)


# ---------------------------------------------------------------------------------------------
# The world: good inputs, fitted objects, and each area's good call with its baseline


class World:
    """Good objects shared by the cases; :meth:`recheck` reruns an area's good call."""

    def __init__(self, tmp: pathlib.Path):
        self.tmp = tmp
        # Strings: a two-column packed vocabulary, its index, a query.
        self.vocabulary = StringColumn.from_pylist(["a", "bb", "ccc", None, "bb", "x", "yy"])
        self.segments = torch.tensor([0, 4, 7])
        self.slot_hash, self.slot_row = ops.string_index_build(
            self.vocabulary.data, self.vocabulary.offsets, self.vocabulary.valid, self.segments
        )
        self.query = StringColumn.from_pylist(["bb", "zz", None, "a"])
        self.index = StringIndex.from_columns(
            [StringColumn.from_pylist(["a", "bb", "ccc"]), StringColumn.from_pylist(["x", "yy"])]
        )
        # Padding ops.
        self.x = torch.randn(2, 10, 3)
        self.q = torch.randn(2, 2, 5, 8)
        self.q16 = torch.randn(2, 2, 5, 16)  # head dimension 16: small_head_attention
        self.base_mlp = (torch.randn(4, 1), torch.randn(4), torch.randn(16, 4), torch.randn(16))
        self.query_mlp = (torch.randn(4, 8), torch.randn(4), torch.randn(8, 4), torch.randn(8))
        # feed_forward / norm_linear: tokens of width 8, hidden width 16 (LayerNorm weight and
        # bias, linears).
        self.ffn = dict(
            x=torch.randn(3, 5, 8),
            norm_weight=torch.randn(8),
            norm_bias=torch.randn(8),
            w1=torch.randn(16, 8),
            b1=torch.randn(16),
            w2=torch.randn(8, 16),
            b2=torch.randn(8),
        )
        # Tables, alignment, encoding.
        self.frame = pd.DataFrame(
            {"city": ["oslo", "rome", None, "oslo"], "n": [1, 2, 3, 4], "v": [0.5, NAN, 1.5, 2.0]}
        )
        self.table = Table.from_pandas(self.frame)
        self.align = AlignCategories().fit(self.table)
        self.encoder = TabICLEncoder().fit(self.frame)
        self.grid = BucketGrid(train_rows=(8, 16), test_rows=(4, 8), features=(4, 8))
        # Models and estimators on small checkpoints (tabicl_helpers' "tiny" size).
        self.clf_path = reference_checkpoint("clf", "tiny")
        self.reg_path = reference_checkpoint("reg", "tiny")
        self.model = TabICLv2.from_checkpoint(self.clf_path)
        g = torch.Generator().manual_seed(0)
        self.X = torch.randn(1, 24, 4, generator=g)
        self.y = (torch.arange(20) % 3).float()[None]
        rng = np.random.default_rng(0)
        self.X_train, self.X_test = rng.normal(size=(40, 4)), rng.normal(size=(6, 4))
        self.y_class = np.array(["cat", "dog", "eel", "dog"] * 10)
        self.y_value = rng.normal(size=40)
        self.clf = TabICLClassifier(n_estimators=2, model_path=self.clf_path, device="cpu")
        self.clf.fit(self.X_train, self.y_class)
        self.reg = TabICLRegressor(n_estimators=2, model_path=self.reg_path, device="cpu")
        self.reg.fit(self.X_train, self.y_value)
        self._baselines = {area: good(self) for area, good in GOOD_CALLS.items()}

    def recheck(self, area: str) -> None:
        again = GOOD_CALLS[area](self)
        _assert_same(again, self._baselines[area], area)


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), where
        for x, y in zip(a, b):
            _assert_same(x, y, where)
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=where)
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=where)
    else:
        assert a == b, where


GOOD_CALLS: dict[str, Callable[[World], Any]] = {
    "strings": lambda w: (
        ops.string_lookup(
            w.vocabulary.data,
            w.vocabulary.offsets,
            w.segments,
            w.slot_hash,
            w.slot_row,
            w.query.data,
            w.query.offsets,
            w.query.valid,
            0,
        ),
        w.index.lookup(w.query, 0),
        w.index.lookup_columns([w.query, w.query]),
    ),
    "padding": lambda w: (
        ops.pad_to_bucket(w.x, 6, 8, 8, 4),
        ops.pad_labels(w.x[:, :6, 0], 8),
        ops.prefix_attention(w.q, w.q, w.q, torch.tensor(3)),
        ops.qassmax_scale(w.q, torch.tensor(3), w.base_mlp, w.query_mlp),
    ),
    "attention": lambda w: (
        ops.small_head_attention(w.q16, w.q16, w.q16),
        ops.small_head_attention(w.q16, w.q16, w.q16, torch.tensor([3, 5])),
    ),
    "feed_forward": lambda w: (
        ops.feed_forward(**w.ffn, compute_dtype=torch.bfloat16),
        ops.feed_forward(**w.ffn, compute_dtype=torch.float32, update=w.ffn["x"].half()),
    ),
    "norm_linear": lambda w: (
        ops.norm_linear(*(w.ffn[k] for k in _NORM_LINEAR), compute_dtype=torch.bfloat16),
        ops.norm_linear(*(w.ffn[k] for k in _NORM_LINEAR), compute_dtype=torch.float32),
    ),
    "flash_attention": lambda w: (
        ops.flash_attention(w.q, w.q, w.q),
        ops.flash_attention(w.q, w.q, w.q, fp8=True),
    ),
    "tables": lambda w: (w.align(w.table), w.encoder.transform(w.frame)),
    "buckets": lambda w: (w.grid.bucket_for(5, 3, 4), w.grid.plan(5, 20, 4)),
    "model": lambda w: w.model(w.X, w.y),
    "classifier": lambda w: (
        w.clf.predict_proba(w.X_test),
        w.clf.predict(w.X_test),
        w.clf.n_features_in_,
    ),
    "regressor": lambda w: (w.reg.predict(w.X_test), w.reg.y_mean_, w.reg.n_features_in_),
    "checkpoint": lambda w: TabICLv2.from_checkpoint(w.clf_path)(w.X, w.y),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return World(tmp_path_factory.mktemp("bad-input"))


# ---------------------------------------------------------------------------------------------
# Helpers the cases share


def _table_args(w: World) -> dict:
    """The vocabulary and its built table, as the lookup operators take them."""
    return {
        "vocabulary_data": w.vocabulary.data,
        "vocabulary_offsets": w.vocabulary.offsets,
        "vocabulary_segments": w.segments,
        "slot_hash": w.slot_hash,
        "slot_row": w.slot_row,
    }


def lookup(w: World, **change) -> torch.Tensor:
    """string_lookup on the good arguments with some of them replaced."""
    query = {"query_data": w.query.data, "query_offsets": w.query.offsets}
    return ops.string_lookup(**{**_table_args(w), **query, "query_valid": w.query.valid, **change})


def build(w: World, **change):
    """string_index_build on the good vocabulary with some arguments replaced."""
    args = {
        "vocabulary_data": w.vocabulary.data,
        "vocabulary_offsets": w.vocabulary.offsets,
        "vocabulary_valid": w.vocabulary.valid,
        "vocabulary_segments": w.segments,
    }
    args.update(change)
    return ops.string_index_build(**args)


def lookup_multi(w: World, **change):
    """string_lookup_multi of the good query in both columns, some arguments replaced."""
    queries = {"query_data": [w.query.data] * 2, "query_offsets": [w.query.offsets] * 2}
    return ops.string_lookup_multi(
        **{**_table_args(w), **queries, "query_valid": [w.query.valid] * 2, **change}
    )


def dictionary(w: World, **change):
    """dictionary_lookup of the good query in both columns over 3 rows of codes, some replaced."""
    queries = {"query_data": [w.query.data] * 2, "query_offsets": [w.query.offsets] * 2}
    codes = torch.tensor([[0, 1], [3, -1], [2, 9]])
    return ops.dictionary_lookup(
        **{
            **_table_args(w),
            **queries,
            "query_valid": [w.query.valid] * 2,
            "codes": codes,
            **change,
        }
    )


def attention(w: World, q=None, k=None, v=None, n=None, **kw):
    """prefix_attention on the good arguments (3 keys of 5) with some of them replaced."""
    q = w.q if q is None else q
    k, v = w.q if k is None else k, w.q if v is None else v
    return ops.prefix_attention(q, k, v, torch.tensor(3) if n is None else n, **kw)


def small_heads(w: World, q=None, k=None, v=None, n=None, **kw):
    """small_head_attention on the good arguments (head dim 16, 5 keys) with some replaced."""
    q = w.q16 if q is None else q
    k, v = (w.q16 if t is None else t for t in (k, v))
    return ops.small_head_attention(q, k, v, n, **kw)


def flash(w: World, q=None, k=None, v=None, fp8: bool = False):
    """flash_attention on the good arguments (head dim 8, 5 keys) with some replaced."""
    q, k, v = (w.q if t is None else t for t in (q, k, v))
    return ops.flash_attention(q, k, v, fp8)


def ffn(w: World, eps: float = 1e-5, compute_dtype=torch.bfloat16, **replaced):
    """feed_forward on the good arguments with some of them replaced."""
    return ops.feed_forward(**{**w.ffn, **replaced}, eps=eps, compute_dtype=compute_dtype)


#: norm_linear's tensor arguments among the feed_forward world's (its projection: linear1).
_NORM_LINEAR = ("x", "norm_weight", "norm_bias", "w1", "b1")


def norm_lin(w: World, eps: float = 1e-5, compute_dtype=torch.bfloat16, **replaced):
    """norm_linear on the good arguments (linear1 as the projection) with some replaced."""
    args = {**{k: w.ffn[k] for k in _NORM_LINEAR}, **replaced}
    return ops.norm_linear(*args.values(), eps=eps, compute_dtype=compute_dtype)


def offsets(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def save(w: World, payload, name: str) -> pathlib.Path:
    path = w.tmp / name
    torch.save(payload, path)
    return path


def edited_checkpoint(w: World, name: str, edit: Callable[[dict], None]) -> pathlib.Path:
    payload = checkpoint_payload(build_reference_model("clf", "tiny", seed=5))
    edit(payload)
    return save(w, payload, name)


def truncated_checkpoint(w: World) -> pathlib.Path:
    data = w.clf_path.read_bytes()
    path = w.tmp / "truncated.ckpt"
    path.write_bytes(data[: len(data) * 2 // 3])
    return path


def frame(**columns) -> pd.DataFrame:
    return pd.DataFrame(columns)


def with_inf(X: np.ndarray) -> np.ndarray:
    X = X.copy()
    X[1, 2] = INF
    return X


def fresh_clf(w: World, **params) -> TabICLClassifier:
    return TabICLClassifier(
        **{"n_estimators": 1, "model_path": w.clf_path, "device": "cpu", **params}
    )


def fresh_reg(w: World, **params) -> TabICLRegressor:
    return TabICLRegressor(
        **{"n_estimators": 1, "model_path": w.reg_path, "device": "cpu", **params}
    )


# ---------------------------------------------------------------------------------------------
# The sweep


@dataclass(frozen=True)
class Case:
    area: str  # a key of GOOD_CALLS: rerun and compared with its baseline afterwards
    name: str
    call: Callable[[World], Any]
    error: type | tuple
    match: str  # regex the message must match: the argument's name or the broken rule
    cuda: bool = False


C = Case
U8, I32 = torch.uint8, torch.int32
# One case per line, a table to read down (ruff format would explode it into 1,000 lines).
# fmt: off
REFUSED = [
    # -- torch.ops.tabserve string operators ---------------------------------------------------
    C("strings", "build: data float", lambda w: build(w, vocabulary_data=w.vocabulary.data.float()), RuntimeError, "vocabulary_data must be a uint8"),
    C("strings", "build: data 2-D", lambda w: build(w, vocabulary_data=w.vocabulary.data[None]), RuntimeError, "vocabulary_data must be 1-D"),
    C("strings", "build: offsets int32", lambda w: build(w, vocabulary_offsets=w.vocabulary.offsets.int()), RuntimeError, "vocabulary_offsets must be an int64"),
    C("strings", "build: offsets empty", lambda w: build(w, vocabulary_offsets=offsets()), RuntimeError, "vocabulary_offsets must be 1-D with rows \\+ 1 >= 1"),
    C("strings", "build: negative offset", lambda w: build(w, vocabulary_offsets=offsets(-1, 1, 3, 6, 6, 8, 9, 11), vocabulary_valid=None), RuntimeError, r"vocabulary_offsets\[0\] = -1 is invalid"),
    C("strings", "build: decreasing offsets", lambda w: build(w, vocabulary_offsets=offsets(0, 3, 1, 6, 6, 8, 9, 11), vocabulary_valid=None), RuntimeError, r"vocabulary_offsets\[2\] = 1 is invalid"),
    C("strings", "build: offset past data", lambda w: build(w, vocabulary_offsets=offsets(0, 1, 3, 6, 6, 8, 9, 99), vocabulary_valid=None), RuntimeError, r"vocabulary_offsets\[7\] = 99 is invalid.*vocabulary_data"),
    C("strings", "build: valid wrong length", lambda w: build(w, vocabulary_valid=torch.ones(3, dtype=torch.bool)), RuntimeError, r"vocabulary_valid must have shape \[7\]"),
    C("strings", "build: valid uint8", lambda w: build(w, vocabulary_valid=torch.ones(7, dtype=U8)), RuntimeError, "vocabulary_valid must be a bool"),
    C("strings", "build: segments not ending at rows", lambda w: build(w, vocabulary_segments=offsets(0, 4, 9)), RuntimeError, "vocabulary_segments must start at 0 and end at the number of vocabulary rows"),
    C("strings", "build: segments unsorted", lambda w: build(w, vocabulary_segments=offsets(0, 5, 3, 7)), RuntimeError, "vocabulary_segments must be non-decreasing"),
    C("strings", "build: segments too short", lambda w: build(w, vocabulary_segments=offsets(0)), RuntimeError, "vocabulary_segments must be 1-D with columns \\+ 1 >= 2"),
    C("strings", "build: segments float", lambda w: build(w, vocabulary_segments=w.segments.float()), RuntimeError, "vocabulary_segments must be an int64"),
    C("strings", "build: hash_bits 65", lambda w: build(w, hash_bits=65), RuntimeError, r"hash_bits must be in \[0, 64\]"),
    C("strings", "build: hash_bits -1", lambda w: build(w, hash_bits=-1), RuntimeError, r"hash_bits must be in \[0, 64\]"),
    C("strings", "build: meta data with cpu offsets", lambda w: build(w, vocabulary_data=w.vocabulary.data.to("meta")), RuntimeError, "vocabulary_offsets is on cpu but vocabulary_data is on meta"),
    C("strings", "lookup: query offsets decreasing", lambda w: lookup(w, query_offsets=offsets(0, 2, 1, 3, 3), query_valid=None), RuntimeError, r"query_offsets\[2\] = 1 is invalid"),
    C("strings", "lookup: query offsets past data", lambda w: lookup(w, query_offsets=offsets(0, 2, 4, 4, 50), query_valid=None), RuntimeError, r"query_offsets\[4\] = 50 is invalid.*query_data"),
    C("strings", "lookup: query offsets negative", lambda w: lookup(w, query_offsets=offsets(-3, 2, 4, 4, 5), query_valid=None), RuntimeError, r"query_offsets\[0\] = -3"),
    C("strings", "lookup: query data int64", lambda w: lookup(w, query_data=w.query.data.long()), RuntimeError, "query_data must be a uint8"),
    C("strings", "lookup: query valid wrong length", lambda w: lookup(w, query_valid=torch.ones(9, dtype=torch.bool)), RuntimeError, r"query_valid must have shape \[4\]"),
    C("strings", "lookup: column out of range", lambda w: lookup(w, column=2), RuntimeError, r"column must be in \[0, 2\)"),
    C("strings", "lookup: negative column", lambda w: lookup(w, column=-1), RuntimeError, r"column must be in \[0, 2\)"),
    C("strings", "lookup: table not a power of two", lambda w: lookup(w, slot_hash=w.slot_hash[:5], slot_row=w.slot_row[:5]), RuntimeError, "slot_row must have a power-of-two length"),
    C("strings", "lookup: table halves differ", lambda w: lookup(w, slot_hash=w.slot_hash[:8]), RuntimeError, "slot_hash and slot_row must be 1-D of the same length"),
    C("strings", "lookup: empty table", lambda w: lookup(w, slot_hash=offsets(), slot_row=offsets()), RuntimeError, "power-of-two length"),
    C("strings", "lookup: table float", lambda w: lookup(w, slot_hash=w.slot_hash.double()), RuntimeError, "slot_hash and slot_row must be int64"),
    C("strings", "lookup: query on meta", lambda w: lookup(w, query_data=w.query.data.to("meta"), query_offsets=w.query.offsets.to("meta"), query_valid=None), RuntimeError, "query_data is on meta but vocabulary_data is on cpu"),
    C("strings", "lookup_multi: one query for two columns", lambda w: lookup_multi(w, query_data=[w.query.data], query_offsets=[w.query.offsets], query_valid=[None]), RuntimeError, r"one entry per vocabulary column \(2\), got 1"),
    C("strings", "lookup_multi: lists of different lengths", lambda w: lookup_multi(w, query_valid=[None]), RuntimeError, "query_valid must each hold one entry"),
    C("strings", "lookup_multi: bad offsets in column 1", lambda w: lookup_multi(w, query_offsets=[w.query.offsets, offsets(0, 9, 1, 2, 3)]), RuntimeError, r"query_offsets\[1\] = 9"),
    C("strings", "dictionary: codes int32", lambda w: dictionary(w, codes=torch.zeros(3, 2, dtype=I32)), RuntimeError, "codes must be an int64"),
    C("strings", "dictionary: codes 1-D", lambda w: dictionary(w, codes=offsets(0, 1)), RuntimeError, "codes must be 2-D"),
    C("strings", "dictionary: one code column for two", lambda w: dictionary(w, codes=offsets(0, 1)[:, None]), RuntimeError, r"one column per query column \(2\)"),
    C("strings", "dictionary: code_columns too short", lambda w: dictionary(w, code_columns=[0]), RuntimeError, "code_columns must hold one entry per query column"),
    C("strings", "dictionary: code column past codes", lambda w: dictionary(w, code_columns=[0, 2]), RuntimeError, r"code_columns\[1\] must be in \[0, 2\)"),
    C("strings", "dictionary: codes on meta", lambda w: dictionary(w, codes=torch.zeros(3, 2, dtype=torch.long, device="meta")), RuntimeError, "codes is on meta"),
    C("strings", "dictionary: bad offsets in column 0", lambda w: dictionary(w, query_offsets=[offsets(0, 9, 1, 2, 3), w.query.offsets]), RuntimeError, r"query_offsets\[1\] = 9"),
    # -- torch.ops.tabserve padding operators --------------------------------------------------
    C("padding", "pad_to_bucket: 2-D x", lambda w: ops.pad_to_bucket(w.x[0], 6, 8, 8, 4), RuntimeError, "x must be a 3-D"),
    C("padding", "pad_to_bucket: negative n_train", lambda w: ops.pad_to_bucket(w.x, -1, 8, 16, 4), RuntimeError, "n_train must be in"),
    C("padding", "pad_to_bucket: n_train past rows", lambda w: ops.pad_to_bucket(w.x, 11, 16, 8, 4), RuntimeError, "n_train must be in"),
    C("padding", "pad_to_bucket: train bucket too small", lambda w: ops.pad_to_bucket(w.x, 6, 4, 8, 4), RuntimeError, "train_bucket"),
    C("padding", "pad_to_bucket: test bucket too small", lambda w: ops.pad_to_bucket(w.x, 6, 8, 2, 4), RuntimeError, "test_bucket"),
    C("padding", "pad_to_bucket: feature bucket too small", lambda w: ops.pad_to_bucket(w.x, 6, 8, 8, 2), RuntimeError, "feature_bucket"),
    C("padding", "pad_labels: bucket too small", lambda w: ops.pad_labels(w.x[:, :6, 0], 3), RuntimeError, "train_bucket"),
    C("padding", "pad_labels: 0-d labels", lambda w: ops.pad_labels(torch.tensor(1.0), 3), RuntimeError, "y_train"),
    C("padding", "prefix_attention: n_keys 0", lambda w: attention(w, n=torch.tensor(0)), RuntimeError, r"n_keys must be in \[1, 5\]"),
    C("padding", "prefix_attention: n_keys past keys", lambda w: attention(w, n=torch.tensor([3, 6])), RuntimeError, r"n_keys must be in \[1, 5\]"),
    C("padding", "prefix_attention: n_keys float", lambda w: attention(w, n=torch.tensor(3.0)), RuntimeError, "n_keys must be an int32 or int64"),
    C("padding", "prefix_attention: n_keys wrong shape", lambda w: attention(w, n=torch.tensor([1, 2, 3])), RuntimeError, "n_keys must be 0-d or have shape"),
    C("padding", "prefix_attention: 3-D q", lambda w: attention(w, q=w.q[0], k=w.q[0], v=w.q[0]), RuntimeError, "q, k and v must be 4-D"),
    C("padding", "prefix_attention: integer q", lambda w: attention(w, q=w.q.int(), k=w.q.int(), v=w.q.int()), RuntimeError, "q must be a floating-point"),
    C("padding", "prefix_attention: mixed dtypes", lambda w: attention(w, k=w.q.double()), RuntimeError, "k has dtype Double"),
    C("padding", "prefix_attention: unknown backend", lambda w: attention(w, backend="fast"), RuntimeError, "backend must be one of"),
    C("padding", "prefix_attention: n_keys on meta", lambda w: attention(w, n=torch.tensor(3, device="meta")), RuntimeError, "n_keys is on meta but q is on cpu"),
    C("padding", "qassmax_scale: weight shape", lambda w: ops.qassmax_scale(w.q, torch.tensor(3), (*w.base_mlp[:2], torch.randn(5, 4), w.base_mlp[3]), w.query_mlp), RuntimeError, "base_weight2"),
    C("padding", "qassmax_scale: integer q", lambda w: ops.qassmax_scale(w.q.int(), torch.tensor(3), w.base_mlp, w.query_mlp), RuntimeError, "q must be a floating-point"),
    C("padding", "qassmax_scale: n_keys 2-D", lambda w: ops.qassmax_scale(w.q, torch.ones(1, 1, dtype=torch.long), w.base_mlp, w.query_mlp), RuntimeError, "n_keys must be 0-d"),
    # -- small_head_attention --------------------------------------------------------------------
    C("attention", "small_head_attention: head_dim 8", lambda w: small_heads(w, q=w.q, k=w.q, v=w.q), RuntimeError, "q must have head_dim 16"),
    C("attention", "small_head_attention: v head_dim 8", lambda w: small_heads(w, v=w.q), RuntimeError, "v must have head_dim 16"),
    C("attention", "small_head_attention: 3-D q", lambda w: small_heads(w, q=w.q16[0]), RuntimeError, "q, k and v must be 4-D"),
    C("attention", "small_head_attention: integer q", lambda w: small_heads(w, q=w.q16.int(), k=w.q16.int(), v=w.q16.int()), RuntimeError, "q must be a floating-point"),
    C("attention", "small_head_attention: mixed dtypes", lambda w: small_heads(w, v=w.q16.double()), RuntimeError, "v has dtype Double"),
    C("attention", "small_head_attention: other batch", lambda w: small_heads(w, k=w.q16[:1]), RuntimeError, "k must have q's batch and heads"),
    C("attention", "small_head_attention: v keys differ", lambda w: small_heads(w, v=w.q16[:, :, :4]), RuntimeError, "v must have as many keys as k"),
    C("attention", "small_head_attention: no keys", lambda w: small_heads(w, k=w.q16[:, :, :0], v=w.q16[:, :, :0]), RuntimeError, "at least one key"),
    C("attention", "small_head_attention: n_keys 0", lambda w: small_heads(w, n=torch.tensor(0)), RuntimeError, r"n_keys must be in \[1, 5\]"),
    C("attention", "small_head_attention: n_keys past keys", lambda w: small_heads(w, n=torch.tensor([3, 6])), RuntimeError, r"got 6 at batch entry 1"),
    C("attention", "small_head_attention: n_keys float", lambda w: small_heads(w, n=torch.tensor(3.0)), RuntimeError, "n_keys must be an int32 or int64"),
    C("attention", "small_head_attention: n_keys wrong shape", lambda w: small_heads(w, n=torch.tensor([1, 2, 3])), RuntimeError, "n_keys must be 0-d or have shape"),
    C("attention", "small_head_attention: n_keys on meta", lambda w: small_heads(w, n=torch.tensor(3, device="meta")), RuntimeError, "n_keys is on meta but q is on cpu"),
    # -- feed_forward ----------------------------------------------------------------------------
    C("feed_forward", "feed_forward: integer x", lambda w: ffn(w, x=w.ffn["x"].int()), ValueError, "x must be a floating-point tensor"),
    C("feed_forward", "feed_forward: 0-d x", lambda w: ffn(w, x=torch.tensor(1.0)), ValueError, "x must be a floating-point tensor"),
    C("feed_forward", "feed_forward: w1 of another width", lambda w: ffn(w, w1=torch.randn(16, 7)), ValueError, r"w1 must be \(hidden, 8\)"),
    C("feed_forward", "feed_forward: norm_weight shape", lambda w: ffn(w, norm_weight=torch.randn(9)), ValueError, "norm_weight must have shape"),
    C("feed_forward", "feed_forward: norm_bias shape", lambda w: ffn(w, norm_bias=torch.randn(1, 8)), ValueError, "norm_bias must have shape"),
    C("feed_forward", "feed_forward: b1 shape", lambda w: ffn(w, b1=torch.randn(8)), ValueError, "b1 must have shape"),
    C("feed_forward", "feed_forward: w2 transposed", lambda w: ffn(w, w2=torch.randn(16, 8)), ValueError, "w2 must have shape"),
    C("feed_forward", "feed_forward: b2 shape", lambda w: ffn(w, b2=torch.randn(16)), ValueError, "b2 must have shape"),
    C("feed_forward", "feed_forward: integer w2", lambda w: ffn(w, w2=torch.ones(8, 16, dtype=torch.long)), ValueError, "w2 must be floating point"),
    C("feed_forward", "feed_forward: w1 on meta", lambda w: ffn(w, w1=torch.randn(16, 8, device="meta")), ValueError, "w1 is on meta but x is on cpu"),
    C("feed_forward", "feed_forward: update of another shape", lambda w: ffn(w, update=torch.randn(1, 5, 8)), ValueError, r"update must have shape \(3, 5, 8\)"),
    C("feed_forward", "feed_forward: integer update", lambda w: ffn(w, update=torch.ones(3, 5, 8, dtype=torch.int32)), ValueError, "update must be floating point"),
    C("feed_forward", "feed_forward: compute_dtype int", lambda w: ffn(w, compute_dtype=torch.int32), ValueError, "compute_dtype must be float16, bfloat16 or float32"),
    C("feed_forward", "feed_forward: negative eps", lambda w: ffn(w, eps=-1e-5), ValueError, "eps must be finite and >= 0"),
    C("feed_forward", "feed_forward: infinite eps", lambda w: ffn(w, eps=INF), ValueError, "eps must be finite and >= 0"),
    # -- norm_linear -----------------------------------------------------------------------------
    C("norm_linear", "norm_linear: integer x", lambda w: norm_lin(w, x=w.ffn["x"].int()), ValueError, "x must be a floating-point tensor"),
    C("norm_linear", "norm_linear: weight of another width", lambda w: norm_lin(w, w1=torch.randn(16, 7)), ValueError, r"weight must be \(out_features, 8\)"),
    C("norm_linear", "norm_linear: 1-D weight", lambda w: norm_lin(w, w1=torch.randn(8)), ValueError, r"weight must be \(out_features, 8\)"),
    C("norm_linear", "norm_linear: bias shape", lambda w: norm_lin(w, b1=torch.randn(8)), ValueError, r"bias must have shape \(16,\)"),
    C("norm_linear", "norm_linear: norm_weight shape", lambda w: norm_lin(w, norm_weight=torch.randn(16)), ValueError, "norm_weight must have shape"),
    C("norm_linear", "norm_linear: norm_bias shape", lambda w: norm_lin(w, norm_bias=torch.randn(7)), ValueError, "norm_bias must have shape"),
    C("norm_linear", "norm_linear: integer bias", lambda w: norm_lin(w, b1=torch.ones(16, dtype=torch.long)), ValueError, "bias must be floating point"),
    C("norm_linear", "norm_linear: weight on meta", lambda w: norm_lin(w, w1=torch.randn(16, 8, device="meta")), ValueError, "weight is on meta but x is on cpu"),
    C("norm_linear", "norm_linear: compute_dtype float64", lambda w: norm_lin(w, compute_dtype=torch.float64), ValueError, "compute_dtype must be float16, bfloat16 or float32"),
    C("norm_linear", "norm_linear: NaN eps", lambda w: norm_lin(w, eps=NAN), ValueError, "eps must be finite and >= 0"),
    # -- flash_attention -------------------------------------------------------------------------
    C("flash_attention", "flash_attention: integer q", lambda w: flash(w, q=w.q.int()), ValueError, "q must be a floating-point tensor"),
    C("flash_attention", "flash_attention: 1-D k", lambda w: flash(w, k=w.q[0, 0, 0]), ValueError, "k must be a floating-point tensor"),
    C("flash_attention", "flash_attention: mixed dtypes", lambda w: flash(w, v=w.q.double(), fp8=True), ValueError, "v is torch.float64 but q is torch.float32"),
    C("flash_attention", "flash_attention: v keys differ", lambda w: flash(w, v=w.q[:, :, :4]), ValueError, "v must have k's shape"),
    C("flash_attention", "flash_attention: other batch", lambda w: flash(w, k=w.q[:1], v=w.q[:1]), ValueError, "with q's leading shape and dim"),
    C("flash_attention", "flash_attention: other head dim", lambda w: flash(w, k=w.q16, v=w.q16), ValueError, "with q's leading shape and dim"),
    C("flash_attention", "flash_attention: no keys", lambda w: flash(w, k=w.q[:, :, :0], v=w.q[:, :, :0]), ValueError, "at least one key"),
    C("flash_attention", "flash_attention: k on meta", lambda w: flash(w, k=w.q.to("meta")), ValueError, "k is on meta but q is on cpu"),
    C("flash_attention", "flash_attention: CUDA v for a CPU q", lambda w: flash(w, v=w.q.cuda()), ValueError, "v is on cuda:0 but q is on cpu", cuda=True),
    C("attention", "small_head_attention: rotary tables too short", lambda w: small_heads(w, rotary=(torch.ones(4, 16), torch.ones(4, 16))), RuntimeError, r"rotary_cos must be \[L, 16\] with L >= max\(Lq, Lk\) = 5"),
    C("attention", "small_head_attention: rotary tables float64", lambda w: small_heads(w, rotary=(torch.ones(5, 16, dtype=torch.float64), torch.ones(5, 16))), RuntimeError, "rotary_cos must be float32"),
    # -- StringColumn / StringIndex ------------------------------------------------------------
    C("strings", "StringColumn: data int64", lambda w: StringColumn(torch.zeros(3, dtype=torch.long), offsets(0, 3)), TypeError, "data must be a 1-D uint8"),
    C("strings", "StringColumn: offsets int32", lambda w: StringColumn(torch.zeros(3, dtype=U8), torch.tensor([0, 3], dtype=I32)), TypeError, "offsets must be a 1-D int64"),
    C("strings", "StringColumn: empty offsets", lambda w: StringColumn(torch.zeros(3, dtype=U8), offsets()), ValueError, "offsets must hold rows \\+ 1 >= 1"),
    C("strings", "StringColumn: decreasing offsets", lambda w: StringColumn(torch.zeros(3, dtype=U8), offsets(0, 2, 1)), ValueError, "offsets"),
    C("strings", "StringColumn: offsets past data", lambda w: StringColumn(torch.zeros(3, dtype=U8), offsets(0, 4)), ValueError, "offsets"),
    C("strings", "StringColumn: valid wrong length", lambda w: StringColumn(torch.zeros(3, dtype=U8), offsets(0, 3), torch.ones(2, dtype=torch.bool)), ValueError, "valid"),
    C("strings", "StringColumn: mixed devices", lambda w: StringColumn(torch.zeros(3, dtype=U8), offsets(0, 3).to("meta")), ValueError, "offsets is on meta but data is on cpu"),
    C("strings", "StringColumn.from_pylist: numbers", lambda w: StringColumn.from_pylist(["a", 3]), TypeError, r"values\[1\] must be str, bytes or None, got int"),
    C("strings", "StringIndex: not a StringColumn", lambda w: StringIndex(["a", "b"]), TypeError, "vocabulary must be a StringColumn"),
    C("strings", "StringIndex.from_columns: none", lambda w: StringIndex.from_columns([]), ValueError, "at least one StringColumn"),
    C("strings", "StringIndex.lookup: list query", lambda w: w.index.lookup(["a"]), TypeError, "query must be a StringColumn"),
    C("strings", "StringIndex.lookup: column out of range", lambda w: w.index.lookup(w.query, 5), RuntimeError, r"column must be in \[0, 2\)"),
    C("strings", "StringIndex.lookup_columns: too few", lambda w: w.index.lookup_columns([w.query]), ValueError, r"one StringColumn per vocabulary column \(2\), got 1"),
    C("strings", "StringIndex.lookup: query on meta", lambda w: w.index.lookup(w.query.to("meta")), ValueError, "query is on meta but the index is on cpu"),
    # -- CategoricalColumn / Table --------------------------------------------------------------
    C("tables", "CategoricalColumn: float codes", lambda w: CategoricalColumn(torch.zeros(3), torch.arange(2)), TypeError, "codes must be a 1-D int32 or int64"),
    C("tables", "CategoricalColumn: code past categories", lambda w: CategoricalColumn(offsets(0, 1, 2), torch.arange(2)), ValueError, "codes"),
    C("tables", "CategoricalColumn: code below -1", lambda w: CategoricalColumn(offsets(0, -2), torch.arange(2)), ValueError, "codes"),
    C("tables", "CategoricalColumn: 2-D categories", lambda w: CategoricalColumn(offsets(0), torch.zeros(2, 2)), TypeError, "categories must be 1-D"),
    C("tables", "Table: integer numerical", lambda w: Table(torch.zeros(2, 1, dtype=torch.long), (), ("a",), ()), TypeError, "numerical must be a 2-D float"),
    C("tables", "Table: rows differ", lambda w: Table(torch.zeros(3, 0), (CategoricalColumn(offsets(0), torch.arange(1)),), (), ("c",)), ValueError, "rows"),
    C("tables", "Table: duplicate names", lambda w: Table(torch.zeros(1, 2), (), ("a", "a"), ()), ValueError, "unique"),
    C("tables", "Table.from_pandas: duplicate columns", lambda w: Table.from_pandas(pd.DataFrame([[1, 2]], columns=["a", "a"])), ValueError, "duplicate column names"),
    C("tables", "Table.from_pandas: datetime column", lambda w: Table.from_pandas(frame(t=pd.to_datetime(["2024-01-01"]))), TypeError, "'t'"),
    C("tables", "Table.from_pandas: unknown categorical", lambda w: Table.from_pandas(w.frame, categorical=["nope"]), ValueError, "nope"),
    C("tables", "Table.from_pandas: complex column", lambda w: Table.from_pandas(frame(z=[1 + 2j, 3j], v=[1.0, 2.0])), TypeError, "column 'z' has dtype complex128, which is neither"),
    C("tables", "Table.from_pandas: list-valued column", lambda w: Table.from_pandas(frame(tags=[["a", "b"], ["c"]], v=[1.0, 2.0])), TypeError, "column 'tags' cannot be a categorical column"),
    C("tables", "Table.from_arrow: list-valued column", lambda w: Table.from_arrow(__import__("pyarrow").table({"tags": [["a"], ["b", "c"]]}), categorical=["tags"]), TypeError, "column 'tags' cannot be a categorical column"),
    C("tables", "Table: sparse numerical", lambda w: Table(torch.zeros(2, 1).to_sparse(), (), ("a",), ()), TypeError, "numerical must be a dense tensor, got layout torch.sparse_coo"),
    C("tables", "CategoricalColumn: sparse codes", lambda w: CategoricalColumn(offsets(0, 1).to_sparse(), torch.arange(2)), TypeError, "codes must be a dense tensor"),
    C("strings", "StringColumn: sparse data", lambda w: StringColumn(w.query.data.to_sparse(), w.query.offsets, w.query.valid), TypeError, "data must be a dense tensor"),
    # -- AlignCategories / TabICLEncoder --------------------------------------------------------
    C("tables", "AlignCategories: bad sort_by", lambda w: AlignCategories(sort_by="size"), ValueError, "sort_by must be one of"),
    C("tables", "AlignCategories: transform before fit", lambda w: AlignCategories()(w.table), NotFittedError, "not fitted"),
    C("tables", "AlignCategories.fit: a DataFrame", lambda w: AlignCategories().fit(w.frame), TypeError, "table must be a tabserve Table"),
    C("tables", "AlignCategories.fit: unknown column", lambda w: AlignCategories().fit(w.table, columns=["nope"]), KeyError, "nope"),
    C("tables", "AlignCategories: missing column", lambda w: w.align(Table.from_pandas(frame(other=["a"]))), ValueError, "no categorical column 'city'"),
    C("tables", "AlignCategories: numbers where strings were fitted", lambda w: w.align(Table.from_pandas(frame(city=[1, 2]), categorical=["city"])), tabserve.CategoryTypeError, "column 'city' holds integer categories"),
    C("tables", "TabICLEncoder.fit: an array", lambda w: TabICLEncoder().fit(np.zeros((2, 2))), TypeError, "frame must be a pandas DataFrame"),
    C("tables", "Table.from_pandas: a dict", lambda w: Table.from_pandas({"a": [1, 2]}), TypeError, "frame must be a pandas DataFrame, got dict"),
    C("tables", "TabICLEncoder: missing fitted column", lambda w: w.encoder.transform(w.frame.drop(columns=["v"])), KeyError, "'v'"),
    # -- BucketGrid ------------------------------------------------------------------------------
    C("buckets", "empty grid", lambda w: BucketGrid(train_rows=()), ValueError, "train_rows must hold at least one bucket size"),
    C("buckets", "unsorted grid", lambda w: BucketGrid(test_rows=(8, 4)), ValueError, "test_rows"),
    C("buckets", "repeated size", lambda w: BucketGrid(features=(4, 4)), ValueError, "features"),
    C("buckets", "zero size", lambda w: BucketGrid(features=(0, 4)), ValueError, r"features\[0\] must be a positive int"),
    C("buckets", "float size", lambda w: BucketGrid(train_rows=(8.5,)), ValueError, r"train_rows\[0\]"),
    C("buckets", "a scalar grid", lambda w: BucketGrid(train_rows=512), TypeError, "train_rows must be a sequence of bucket sizes"),
    C("buckets", "bucket_for: zero train rows", lambda w: w.grid.bucket_for(0, 3, 4), ValueError, "n_train must be an int >= 1"),
    C("buckets", "bucket_for: negative test rows", lambda w: w.grid.bucket_for(5, -1, 4), ValueError, "n_test must be an int >= 0"),
    C("buckets", "plan: bool features", lambda w: w.grid.plan(5, 3, True), ValueError, "n_features must be an int >= 1"),
    # -- TabICLv2 (the network) -----------------------------------------------------------------
    C("model", "X integer", lambda w: w.model(w.X.long(), w.y), TypeError, "X must be a floating-point"),
    C("model", "X a list", lambda w: w.model(w.X.tolist(), w.y), TypeError, "X must be a torch.Tensor"),
    C("model", "X 2-D", lambda w: w.model(w.X[0], w.y), ValueError, r"X must be \(tables, rows, features\)"),
    C("model", "X no features", lambda w: w.model(w.X[:, :, :0], w.y), ValueError, "X has no features"),
    C("model", "X with NaN", lambda w: w.model(torch.where(w.X > 2, NAN, w.X), w.y), ValueError, "X contains NaN or infinite"),
    C("model", "X with inf", lambda w: w.model(torch.where(w.X > 2, INF, w.X), w.y), ValueError, "X contains NaN or infinite"),
    C("model", "X on meta", lambda w: w.model(w.X.to("meta"), w.y), ValueError, "X is on meta but the model is on cpu"),
    C("model", "y_train 1-D", lambda w: w.model(w.X, w.y[0]), ValueError, r"y_train must be \(tables, train rows\)"),
    C("model", "y_train zero rows", lambda w: w.model(w.X, w.y[:, :0]), ValueError, "y_train has zero train rows"),
    C("model", "y_train longer than X", lambda w: w.model(w.X[:, :10], w.y), ValueError, "train labels for only 10 rows"),
    C("model", "y_train with NaN", lambda w: w.model(w.X, torch.where(w.y > 1, NAN, w.y)), ValueError, "y_train contains NaN"),
    C("model", "labels not integers", lambda w: w.model(w.X, w.y + 0.5), ValueError, "non-negative integers"),
    C("model", "negative labels", lambda w: w.model(w.X, w.y - 1), ValueError, "non-negative integers"),
    C("model", "labels with a gap (0, 2)", lambda w: w.model(w.X, w.y * 2), ValueError, "exactly 0..K-1"),
    C("model", "a label past int64 (1e19)", lambda w: w.model(w.X, torch.where(w.y > 1, 1e19, w.y)), ValueError, "exactly 0..K-1"),
    C("model", "quantiles from a classifier", lambda w: w.model.predict_stats(w.X, w.y), ValueError, "regression checkpoint"),
    C("model", "cache: feature count mismatch", lambda w: w.model.forward_with_cache(w.X[:, 20:, :3], w.model.build_cache(w.X[:, :20], w.y)), ValueError, "does not match the cache"),
    # -- TabICLClassifier / TabICLRegressor ---------------------------------------------------
    C("classifier", "fit: zero rows (zero classes)", lambda w: w.clf.fit(w.X_train[:0], w.y_class[:0]), ValueError, r"0 sample\(s\)"),
    C("classifier", "fit: y None", lambda w: w.clf.fit(w.X_train, None), ValueError, "requires y to be passed"),
    C("classifier", "fit: y too short", lambda w: w.clf.fit(w.X_train, w.y_class[:5]), ValueError, r"inconsistent numbers of samples: \[40, 5\]"),
    C("classifier", "fit: NaN labels", lambda w: w.clf.fit(w.X_train, np.r_[np.nan, np.ones(39)]), ValueError, "NaN labels"),
    C("classifier", "fit: infinite feature", lambda w: w.clf.fit(with_inf(w.X_train), w.y_class), ValueError, "Input X contains infinity"),
    C("classifier", "fit: no features", lambda w: w.clf.fit(w.X_train[:, :0], w.y_class), ValueError, r"0 feature\(s\)"),
    C("classifier", "fit: regression checkpoint", lambda w: w.clf.set_params(model_path=w.reg_path).fit(w.X_train, w.y_class), ValueError, "is a regression checkpoint"),
    C("classifier", "fit: missing model_path, no download", lambda w: w.clf.set_params(model_path="absent.ckpt", allow_auto_download=False).fit(w.X_train, w.y_class), FileNotFoundError, "allow_auto_download"),
    C("classifier", "fit: model_path a directory", lambda w: w.clf.set_params(model_path=w.tmp).fit(w.X_train, w.y_class), IsADirectoryError, "is a directory.*give the checkpoint file's path"),
    C("classifier", "fit: list-valued DataFrame column", lambda w: fresh_clf(w).fit(pd.DataFrame({"tags": [["a"], ["b", "c"]] * 20, "v": w.X_train[:, 0]}), w.y_class), TypeError, "column 'tags'"),
    C("classifier", "fit: n_estimators 0", lambda w: w.clf.set_params(n_estimators=0).fit(w.X_train, w.y_class), ValueError, "n_estimators must be an integer >= 1, got 0"),
    C("classifier", "fit: n_estimators 2.5", lambda w: w.clf.set_params(n_estimators=2.5).fit(w.X_train, w.y_class), ValueError, "n_estimators must be an integer >= 1, got 2.5"),
    C("classifier", "fit: n_estimators '8'", lambda w: w.clf.set_params(n_estimators="8").fit(w.X_train, w.y_class), ValueError, "n_estimators must be an integer >= 1, got '8'"),
    C("classifier", "fit: None among string labels", lambda w: w.clf.fit(w.X_train, np.r_[[None], w.y_class[1:]].astype(object)), ValueError, "y contains None among its labels"),
    C("classifier", "fit: continuous labels", lambda w: w.clf.fit(w.X_train, np.linspace(0, 1, 40)), ValueError, "Unknown label type: continuous"),
    C("classifier", "fit: complex features", lambda w: w.clf.fit(w.X_train + 1j, w.y_class), ValueError, "Complex data not supported"),
    C("classifier", "fit: complex DataFrame column", lambda w: w.clf.fit(pd.DataFrame({"a": w.X_train[:, 0] + 1j, "b": w.X_train[:, 1]}), w.y_class), ValueError, "Complex data not supported"),
    C("classifier", "fit: sparse features", lambda w: w.clf.fit(__import__("scipy.sparse").sparse.csr_matrix(w.X_train), w.y_class), TypeError, "Sparse data was passed"),
    C("classifier", "fit: bucket_grid not a BucketGrid", lambda w: w.clf.set_params(bucket_grid=(8, 16)).fit(w.X_train, w.y_class), TypeError, "bucket_grid must be a tabserve.BucketGrid"),
    C("classifier", "fit: bad kv_cache", lambda w: w.clf.set_params(kv_cache="yes").fit(w.X_train, w.y_class), ValueError, "kv_cache must be"),
    C("classifier", "predict: feature count mismatch", lambda w: w.clf.predict(w.X_test[:, :3]), ValueError, "X has 3 features, but TabICLClassifier is expecting 4 features"),
    C("classifier", "predict: 1-D X", lambda w: w.clf.predict(w.X_test[0]), ValueError, "Expected 2D array, got 1D array"),
    C("classifier", "predict: infinite feature", lambda w: w.clf.predict(with_inf(w.X_test)), ValueError, "Input X contains infinity"),
    C("classifier", "predict: other column names", lambda w: fresh_clf(w).fit(pd.DataFrame(w.X_train, columns=list("abcd")), w.y_class).predict(pd.DataFrame(w.X_test, columns=list("wxyz"))), ValueError, "feature names should match"),
    C("classifier", "predict before fit", lambda w: fresh_clf(w).predict(w.X_test), SklearnNotFittedError, "not fitted"),
    C("regressor", "fit: NaN target", lambda w: w.reg.fit(w.X_train, np.r_[np.nan, w.y_value[1:]]), ValueError, "NaN or infinite targets"),
    C("regressor", "fit: infinite target", lambda w: w.reg.fit(w.X_train, np.r_[INF, w.y_value[1:]]), ValueError, "NaN or infinite targets"),
    C("regressor", "fit: string targets", lambda w: w.reg.fit(w.X_train, w.y_class), ValueError, "regression targets must be numeric"),
    C("regressor", "fit: classification checkpoint", lambda w: w.reg.set_params(model_path=w.clf_path).fit(w.X_train, w.y_value), ValueError, "is a classification checkpoint"),
    C("regressor", "predict: feature count mismatch", lambda w: w.reg.predict(np.c_[w.X_test, w.X_test]), ValueError, "X has 8 features"),
    C("regressor", "predict: unknown output_type", lambda w: w.reg.predict(w.X_test, output_type="mode"), ValueError, "mode"),
    C("regressor", "predict: quantiles without alphas out of (0, 1)", lambda w: w.reg.predict(w.X_test, output_type="quantiles", alphas=[1.5]), ValueError, "alphas"),
    # -- checkpoints ---------------------------------------------------------------------------
    C("checkpoint", "truncated", lambda w: TabICLv2.from_checkpoint(truncated_checkpoint(w)), CheckpointError, "corrupted or truncated"),
    C("checkpoint", "absent", lambda w: TabICLv2.from_checkpoint(w.tmp / "absent.ckpt"), FileNotFoundError, "absent.ckpt"),
    C("checkpoint", "empty file", lambda w: TabICLv2.from_checkpoint(_write(w, "empty.ckpt", b"")), CheckpointError, "corrupted or truncated"),
    C("checkpoint", "missing config", lambda w: TabICLv2.from_checkpoint(edited_checkpoint(w, "noconfig.ckpt", lambda p: p.pop("config"))), CheckpointError, "expected 'config' and 'state_dict'"),
    C("checkpoint", "missing state_dict key", lambda w: TabICLv2.from_checkpoint(edited_checkpoint(w, "missing.ckpt", lambda p: p["state_dict"].pop("icl_predictor.ln.weight"))), CheckpointError, "missing"),
    C("checkpoint", "extra state_dict key", lambda w: TabICLv2.from_checkpoint(edited_checkpoint(w, "extra.ckpt", lambda p: p["state_dict"].update(surprise=torch.zeros(2)))), CheckpointError, "surprise"),
    C("checkpoint", "extra config key", lambda w: TabICLv2.from_checkpoint(edited_checkpoint(w, "extracfg.ckpt", lambda p: p["config"].update(surprise=1))), CHECKPOINT_ERRORS, "unknown checkpoint config keys"),
    C("checkpoint", "wrong shape weight", lambda w: TabICLv2.from_checkpoint(edited_checkpoint(w, "shape.ckpt", lambda p: p["state_dict"].update({"icl_predictor.ln.weight": torch.zeros(3)}))), CHECKPOINT_ERRORS, "icl_predictor.ln.weight"),
    C("checkpoint", "NaN weight", lambda w: TabICLv2.from_checkpoint(edited_checkpoint(w, "nan.ckpt", lambda p: p["state_dict"]["icl_predictor.ln.weight"].fill_(NAN))), CheckpointError, "NaN or infinite weights"),
    C("checkpoint", "integer weight", lambda w: TabICLv2.from_checkpoint(edited_checkpoint(w, "int.ckpt", lambda p: p["state_dict"].update({"icl_predictor.ln.weight": torch.ones(32, dtype=torch.long)}))), CheckpointError, "not floating-point tensors"),
    C("checkpoint", "wrong task for the estimator", lambda w: fresh_reg(w, model_path=w.clf_path).fit(w.X_train, w.y_value), ValueError, "classification checkpoint"),
    C("checkpoint", "a list, not a dict", lambda w: TabICLv2.from_checkpoint(save(w, [1, 2], "list.ckpt")), CheckpointError, "not a TabICL checkpoint"),
    # -- CUDA: wrong devices (skipped without a GPU) -------------------------------------------
    C("strings", "lookup: CPU query against a CUDA table", lambda w: _cuda_lookup(w, query_on="cpu"), RuntimeError, "query_data is on cpu", cuda=True),
    C("strings", "StringIndex: CPU query for a CUDA index", lambda w: w.index.to("cuda").lookup(w.query), ValueError, "query is on cpu but the index is on cuda", cuda=True),
    C("padding", "prefix_attention: CPU n_keys with CUDA q", lambda w: attention(w, q=w.q.cuda(), k=w.q.cuda(), v=w.q.cuda(), n=torch.tensor(3)), RuntimeError, "n_keys", cuda=True),
    C("padding", "prefix_attention: flash for fp32 on CUDA", lambda w: attention(w, q=w.q.cuda(), k=w.q.cuda(), v=w.q.cuda(), n=torch.tensor(3, device="cuda"), backend="flash"), RuntimeError, 'backend "flash" needs float16 or bfloat16', cuda=True),
    C("padding", "prefix_attention: efficient for fp16 head dim 4 on CUDA", lambda w: attention(w, q=w.q[..., :4].cuda().half(), k=w.q[..., :4].cuda().half(), v=w.q[..., :4].cuda().half(), n=torch.tensor(3, device="cuda"), backend="efficient"), RuntimeError, 'backend "efficient" needs', cuda=True),
    C("attention", "small_head_attention: fp32 on CUDA", lambda w: small_heads(w, q=w.q16.cuda(), k=w.q16.cuda(), v=w.q16.cuda()), RuntimeError, "float16 or bfloat16", cuda=True),
    C("attention", "small_head_attention: CPU rotary tables with CUDA q", lambda w: small_heads(w, q=w.q16.cuda().half(), k=w.q16.cuda().half(), v=w.q16.cuda().half(), rotary=(torch.ones(5, 16), torch.ones(5, 16))), RuntimeError, "rotary_cos is on cpu", cuda=True),
    C("padding", "qassmax_scale: CPU weights with CUDA q", lambda w: ops.qassmax_scale(w.q.cuda().half(), torch.tensor(3, device="cuda"), w.base_mlp, w.query_mlp), RuntimeError, "base_weight1 is on cpu", cuda=True),
    C("attention", "small_head_attention: CPU n_keys with CUDA q", lambda w: small_heads(w, q=w.q16.cuda().half(), k=w.q16.cuda().half(), v=w.q16.cuda().half(), n=torch.tensor(3)), RuntimeError, "n_keys", cuda=True),
    C("classifier", "yeo_johnson_lambdas: float32 z", lambda w: ops.yeo_johnson_lambdas(torch.ones(4, 2)), RuntimeError, "z must be float64"),
    C("classifier", "yeo_johnson_lambdas: 1-D z", lambda w: ops.yeo_johnson_lambdas(torch.ones(4, dtype=torch.float64)), RuntimeError, "z must be 2-D"),
    C("model", "X on CUDA, model on CPU", lambda w: w.model(w.X.cuda(), w.y.cuda()), ValueError, "X is on cuda:0 but the model is on cpu", cuda=True),
]
# fmt: on


def _write(w: World, name: str, data: bytes) -> pathlib.Path:
    path = w.tmp / name
    path.write_bytes(data)
    return path


def _cuda_lookup(w: World, query_on: str):
    v = w.vocabulary.to("cuda")
    slot_hash, slot_row = ops.string_index_build(v.data, v.offsets, v.valid, w.segments.cuda())
    return ops.string_lookup(
        v.data, v.offsets, w.segments.cuda(), slot_hash, slot_row,
        w.query.data.to(query_on), w.query.offsets.to(query_on), None,
    )  # fmt: skip


def _case_id(case: Case) -> str:
    return f"{case.area}: {case.name}"


@pytest.mark.parametrize("case", REFUSED, ids=_case_id)
def test_refused_and_state_survives(world, case):
    if case.cuda and not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    params = {"clf": world.clf.get_params(), "reg": world.reg.get_params()}
    try:
        with pytest.raises(case.error, match=case.match):
            case.call(world)
    finally:  # cases may set_params on the shared estimators; the fitted state must not move
        world.clf.set_params(**params["clf"])
        world.reg.set_params(**params["reg"])
    world.recheck(case.area)


# ---------------------------------------------------------------------------------------------
# Odd but legal input: a defined result, never an exception or a crash


def _unchecked_malformed_offsets(w: World):
    # check_offsets=False promises no out-of-bounds read, only unspecified codes in [-1, rows).
    codes = lookup(w, query_offsets=offsets(0, 99, -5, 2, 1), query_valid=None, check_offsets=False)
    assert codes.shape == (4,) and bool(((codes >= -1) & (codes < 4)).all())


def _mutated_string_column(w: World):
    # A column mutated after its checks (StringIndex trusts it): clamped, never read outside.
    column = StringColumn.from_pylist(["bb", "a"])
    column.offsets[1] = 1_000_000
    codes = w.index.lookup(column, 0)
    assert codes.shape == (2,) and bool(((codes >= -1) & (codes < 3)).all())


def _unseen_categories(w: World):
    codes = w.align(Table.from_pandas(frame(city=["paris", "oslo", None])))
    assert codes[:, 0].tolist() == [-1, w.align.categories("city").index("oslo"), -1]


def _unseen_in_encoder(w: World):
    encoded = w.encoder.transform(frame(city=["paris"], n=[7], v=[NAN]))
    assert encoded[0, 0].item() == -1 and math.isfinite(encoded[0, -1].item())


def _empty_query(w: World):
    empty = StringColumn.from_pylist([])
    assert w.index.lookup(empty, 1).shape == (0,)
    assert lookup(
        w, query_data=empty.data, query_offsets=empty.offsets, query_valid=None
    ).shape == (0,)


def _empty_vocabulary(w: World):
    index = StringIndex(StringColumn.from_pylist([]))
    assert index.lookup(w.query).tolist() == [-1, -1, -1, -1]


def _empty_table_rows(w: World):
    assert w.align(Table.from_pandas(w.frame.iloc[:0])).shape == (0, 1)


def _nan_features_are_imputed(w: World):
    X = w.X_test.copy()
    X[0, 1] = NAN
    proba = w.clf.predict_proba(X)
    assert np.isfinite(proba).all() and np.allclose(proba.sum(axis=1), 1, atol=1e-5)
    assert set(w.clf.predict(X)) <= set(w.clf.classes_)


def _nan_attention_matches_torch(w: World):
    q = w.q.clone()
    q[0, 0, 0, 0] = NAN
    expected = F.scaled_dot_product_attention(q, w.q[:, :, :3], w.q[:, :, :3])
    torch.testing.assert_close(attention(w, q=q), expected, equal_nan=True)


def _padded_attention_ignores_padding_garbage(w: World):
    k = w.q.clone()
    k[:, :, 3:] = INF  # padding past n_keys never reaches the result
    torch.testing.assert_close(attention(w, k=k), attention(w))


ACCEPTED = [
    ("strings", "unchecked malformed query offsets", _unchecked_malformed_offsets),
    ("strings", "StringColumn offsets mutated after construction", _mutated_string_column),
    ("strings", "empty query", _empty_query),
    ("strings", "empty vocabulary", _empty_vocabulary),
    ("tables", "categories unseen at fit", _unseen_categories),
    ("tables", "encoder: categories unseen at fit, NaN numerical", _unseen_in_encoder),
    ("tables", "zero-row table", _empty_table_rows),
    ("classifier", "NaN features are imputed", _nan_features_are_imputed),
    ("padding", "NaN query: as torch's SDPA", _nan_attention_matches_torch),
    ("padding", "inf keys in the padding", _padded_attention_ignores_padding_garbage),
]


@pytest.mark.parametrize("area, name, check", ACCEPTED, ids=[f"{a}: {n}" for a, n, _ in ACCEPTED])
def test_accepted_with_a_defined_result(world, area, name, check):
    check(world)
    world.recheck(area)


# ---------------------------------------------------------------------------------------------
# Checkpoint safety: code in a pickle is never run


class _WritesMarker:
    """Unpickling this calls ``Path.write_text(marker, ...)``: code execution made visible."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.write_text, (self.marker, "unpickled code ran")


@pytest.mark.parametrize("container", ["zip", "legacy"])
def test_pickled_code_is_refused(world, tmp_path, container):
    """A checkpoint whose pickle would write a marker file is refused and the file never appears,
    through TabICLv2 and through an estimator; loading it with ``weights_only=False`` (which
    tabserve never does) would create it, which proves the payload is live."""
    marker = tmp_path / f"marker-{container}"
    payload = checkpoint_payload(build_reference_model("clf", "tiny", seed=3))
    payload["config"]["embed_dim"] = _WritesMarker(marker)
    path = tmp_path / f"evil-{container}.ckpt"
    torch.save(payload, path, _use_new_zipfile_serialization=container == "zip")
    with pytest.raises(CheckpointError, match="cannot read"):
        TabICLv2.from_checkpoint(path)
    with pytest.raises(CheckpointError, match="cannot read"):
        fresh_clf(world, model_path=path).fit(world.X_train, world.y_class)
    assert not marker.exists()
    world.recheck("checkpoint")
    torch.load(path, weights_only=False)  # what loading must never do
    assert marker.read_text() == "unpickled code ran"
