"""When a served model captures a CUDA graph: at a key's second call (served.CAPTURING_CALL), the
first running the same kernels uncaptured; a background warm-up's call counts as a first call,
and warm_up captures at once. Run with the CPU stand-in for the graphs (test_padded_inference._ReplayOnCPU)."""

from __future__ import annotations

import copy

import torch
from tabicl_helpers import our_model, random_table
from tabserve.models.tabicl.serving import served as serving
from tabserve.models.tabicl.serving.options import ServingOptions
from tabserve.models.tabicl.serving.served import ServedTabICL
from test_padded_inference import GRID, _ReplayOnCPU


def _served(monkeypatch) -> tuple:
    monkeypatch.setattr(serving, "_BucketGraph", _ReplayOnCPU)
    model = our_model("clf", "tiny")
    served = ServedTabICL(copy.deepcopy(model), ServingOptions(buckets=True), GRID)
    served.options = served.options.replace(cuda_graphs=True)  # the CUDA check passed
    return model, served


def test_a_key_is_captured_at_its_second_call_and_replayed_after(monkeypatch):
    model, served = _served(monkeypatch)
    X, y = random_table(3, 2, 10, 5, 5, 3)
    other = random_table(4, 2, 12, 6, 6, 3)  # the same bucket and batch: the same key
    expected = model(X, y)
    first = served(X, y)
    assert (served.captures, len(served._graphs)) == (0, 0)
    second = served(*other)
    assert (served.captures, len(served._graphs)) == (1, 1)
    third = served(X, y)
    assert served.captures == 1  # replayed
    for got in (first, third):
        assert (got - expected).abs().max().item() <= 1e-6
    assert (second - model(*other)).abs().max().item() <= 1e-6
    # A new key (three tables: another batch) starts its own count.
    X3, y3 = random_table(5, 3, 10, 5, 5, 3)
    served(X3, y3)
    assert served.captures == 1
    served(X3, y3)
    assert served.captures == 2


def test_cached_predictions_count_their_own_calls(monkeypatch):
    """A KV cache's predictions are keys of their own: the build and the first predict of a
    cache run uncaptured, the second predict captures, the third replays."""
    model, served = _served(monkeypatch)
    X, y = random_table(6, 2, 10, 5, 5, 3)
    cache = served.build_cache(X[:, :10], y)
    expected = model.forward_with_cache(X[:, 10:], model.build_cache(X[:, :10], y))
    answers = [served.forward_with_cache(X[:, 10:], cache) for _ in range(3)]
    assert served.captures == 1 and len(served._cached_graphs) == 1
    for got in answers:
        assert (got - expected).abs().max().item() <= 1e-6


def test_a_warm_up_call_counts_so_the_callers_next_call_captures(monkeypatch):
    _, served = _served(monkeypatch)
    X, y = random_table(7, 2, 10, 5, 5, 3)
    with serving.without_captures():
        served(X, y)
    assert served.captures == 0
    served(X, y)
    assert served.captures == 1


def test_the_counted_keys_are_bounded(monkeypatch):
    monkeypatch.setattr(serving, "MAX_COUNTED_KEYS", 2)
    _, served = _served(monkeypatch)
    served._calls = serving._RecentGraphs(serving.MAX_COUNTED_KEYS)
    tables = [random_table(8, batch, 10, 5, 5, 3) for batch in (1, 2, 3)]
    for X, y in tables:  # three keys called once: the first is forgotten
        served(X, y)
    assert len(served._calls) == 2
    served(*tables[0])  # counted as a first call again
    assert served.captures == 0
    served(*tables[2])
    assert served.captures == 1 and torch.is_tensor(served(*tables[2]))


def test_a_warm_up_captures_each_bucket_at_once(monkeypatch):
    """warm_up is for capturing: its one call per bucket captures (and nothing else's count
    changes: a later call of another thread still counts from its first)."""
    _, served = _served(monkeypatch)
    buckets = served.grid.buckets()[:3]
    assert served.warm_up(buckets, tables=2) == 3
    assert served.captures == 3 and len(served._graphs) == 3
    X, y = random_table(9, 2, 10, 5, 5, 3)
    served(X, y)  # a bucket the warm-up did not reach: its first call
    assert served.captures == 3
    served(X, y)
    assert served.captures == 4
