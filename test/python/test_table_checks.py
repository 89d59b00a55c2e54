"""tabserve::table_checks (one-kernel input checks of a TabICL call) against a Python reference
(sets and math.isfinite over the values), CPU and CUDA, and its use by the model's checks."""

from __future__ import annotations

import math
import random

import pytest
import tabserve  # noqa: F401  (registers torch.ops.tabserve)
import torch
from tabicl_helpers import device_params
from tabserve import ops

LABEL_DTYPES = sorted(ops.TABLE_CHECK_LABEL_DTYPES, key=str)


def reference(X: torch.Tensor, y: torch.Tensor, classification: bool) -> list[int]:
    """The summary from Python values: counts of non-finite values, then per table the labels
    that are not integers in [0, N), the distinct others and their largest."""
    x_values = X.double().flatten().tolist()
    labels = y.double().tolist()
    n = y.shape[1]
    out = [sum(not math.isfinite(v) for v in x_values), 0]
    for row in labels:
        out[1] += sum(not math.isfinite(v) for v in row)
        if not classification:
            out += [0, 0, 0]
            continue
        good = [v for v in row if math.isfinite(v) and v >= 0 and v < n and v == math.floor(v)]
        out += [len(row) - len(good), len(set(good)), int(max(good)) if good else -1]
    return out


def random_case(seed: int, dtype: torch.dtype):
    """A table and labels of ``dtype`` with a chance of each fault: NaN / inf in X or the labels,
    negative, fractional, huge (past 2^63 as float) and out-of-range labels, gaps in 0..K-1."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tables, n, test, features = rng.randint(1, 4), rng.choice([1, 2, 7, 40, 300]), 3, 5
    X = torch.randn(tables, n + test, features, generator=gen)
    if rng.random() < 0.3:
        X[rng.randrange(tables), rng.randrange(n + test), rng.randrange(features)] = rng.choice(
            [math.nan, math.inf, -math.inf]
        )
    k = rng.randint(1, min(n, 12))
    y = torch.stack([torch.randperm(n, generator=gen) % k for _ in range(tables)]).double()
    fault = rng.choice(["none", "none", "nan", "negative", "fraction", "huge", "range", "gap"])
    t, j = rng.randrange(tables), rng.randrange(n)
    if fault == "nan":
        y[t, j] = rng.choice([math.nan, math.inf])
    elif fault == "negative":
        y[t, j] = -1
    elif fault == "fraction":
        y[t, j] = 0.5
    elif fault == "huge":
        y[t, j] = 1e19
    elif fault == "range":
        y[t, j] = n + rng.randint(0, 3)
    elif fault == "gap" and k > 1:
        y[t] = torch.where(y[t] == 0, torch.ones_like(y[t]), y[t])
    if dtype == torch.bool:
        y = y.clamp(0, 1)
    elif not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        y = torch.nan_to_num(y, nan=0.0, posinf=0.0).clamp(info.min, info.max).round()
    return X, y.to(dtype)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", LABEL_DTYPES)
def test_table_checks_equal_the_python_reference(device, dtype):
    for seed in range(25):
        X, y = random_case(seed, dtype)
        for classification in (True, False):
            got = ops.table_checks(X.to(device), y.to(device), classification)
            assert got.dtype == torch.int64 and got.device.type == device
            assert got.tolist() == reference(X, y, classification), (seed, classification)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_table_checks_read_strided_tables_of_every_float_dtype(device, x_dtype):
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(3, 6, 50, generator=gen).to(x_dtype)
    X[1, 4, 7] = math.inf
    X[2, 0, 0] = math.nan
    strided = X.to(device).transpose(1, 2).contiguous().transpose(1, 2)  # features outermost
    y = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 1], [0, 0, 1, 1]], device=device)
    got = ops.table_checks(strided, y, True)
    assert got.tolist() == reference(X, y, True)
    assert got[0].item() == 2


@pytest.mark.parametrize("device", device_params())
def test_table_checks_past_the_shared_bitmap(device):
    """More train rows than a block's shared bitmap holds (393,216 labels): the global one."""
    n = 400_000
    gen = torch.Generator().manual_seed(2)
    y = torch.randint(0, 1000, (2, n), generator=gen)
    y[1, 5] = n - 1  # the last bit of the bitmap
    X = torch.zeros(2, n + 1, 1)
    got = ops.table_checks(X.to(device), y.to(device), True).tolist()
    expected = [0, 0]
    for row in y.tolist():
        expected += [0, len(set(row)), max(row)]
    assert got == expected


@pytest.mark.parametrize("device", device_params())
def test_table_checks_reject_bad_arguments_by_name(device):
    X = torch.zeros(2, 5, 3, device=device)
    y = torch.zeros(2, 4, device=device)
    cases = [
        ((torch.zeros(5, 3, device=device), y), "X must be \\(tables, rows, features\\)"),
        ((X.long(), y), "X must be a floating-point tensor"),
        ((X, torch.zeros(8, device=device)), "y_train must be \\(tables, train rows\\)"),
        ((X, torch.zeros(3, 4, device=device)), "y_train must be \\(tables, train rows\\)"),
        ((X, y.to(torch.complex64)), "y_train must be bool"),
        ((X, torch.zeros(2, 4, dtype=torch.uint32, device=device)), "y_train must be bool"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.table_checks(*args, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_table_checks_reject_mixed_devices():
    with pytest.raises(RuntimeError, match="y_train is on cpu"):
        ops.table_checks(torch.zeros(1, 3, 2, device="cuda"), torch.zeros(1, 2), True)


def test_table_checks_fake_kernel_shapes_and_refusals():
    """Meta tensors (torch.compile's tracing) get the summary's shape, and the CPU kernel's
    argument errors."""
    X = torch.empty(3, 7, 2, device="meta")
    got = ops.table_checks(X, torch.empty(3, 5, device="meta"), True)
    assert got.shape == (2 + 3 * 3,) and got.dtype == torch.int64 and got.device.type == "meta"
    bad = [
        ((X.long(), torch.empty(3, 5, device="meta")), "floating-point"),
        ((X, torch.empty(2, 5, device="meta")), "y_train must be"),
        ((X, torch.empty(3, 5, device="meta", dtype=torch.complex64)), "y_train must be bool"),
    ]
    for args, message in bad:
        with pytest.raises(RuntimeError, match=message):
            ops.table_checks(*args, True)


def test_table_checks_opcheck():
    gen = torch.Generator().manual_seed(3)
    X = torch.randn(2, 9, 4, generator=gen)
    y = torch.randint(0, 3, (2, 6), generator=gen).float()
    torch.library.opcheck(torch.ops.tabserve.table_checks.default, (X, y, True))
    torch.library.opcheck(torch.ops.tabserve.table_checks.default, (X, y, False))


def test_the_model_accepts_through_the_operator_and_names_faults_through_aten(monkeypatch):
    """The model's checks take K from the operator when it finds nothing wrong (the ATen path
    is then never reached), and fall back to the ATen checks for every fault, which name it."""
    from tabicl_helpers import our_model
    from tabserve.models.tabicl.network import model as model_module

    model = our_model()
    gen = torch.Generator().manual_seed(4)
    X = torch.randn(2, 30, 6, generator=gen)
    y = torch.stack([torch.arange(20) % 3, torch.arange(20) % 3]).float()
    called = []
    real = ops.table_checks

    def counting(*args):
        called.append(args[2])
        return real(*args)

    monkeypatch.setattr(ops, "table_checks", counting)
    original_isfinite = torch.isfinite

    def no_aten_checks(*args, **kwargs):
        raise AssertionError("the ATen checks ran for a valid call")

    monkeypatch.setattr(torch, "isfinite", no_aten_checks)
    _, num_classes = model.check_inputs(X, y)
    assert num_classes == 3 and called == [True]
    monkeypatch.setattr(torch, "isfinite", original_isfinite)
    assert model_module.extension_ops() is ops
    for labels, message in [
        (y - 1, "non-negative integers"),
        (torch.stack([y[0], y[1] % 2]), "same number of classes"),
        (torch.stack([y[0] * 2, y[1] * 2]), "exactly 0..K-1"),
    ]:
        with pytest.raises(ValueError, match=message):
            model.check_inputs(X, labels)
    X[0, 3, 1] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        model.check_inputs(X, y)


def _deferred_and_read_first(model, X, y, **kwargs):
    """The model's output with its checks' verdict read after the network is queued, then
    read first (``defer_checks`` off), from the same model."""
    model.defer_checks, model._last_call_many_classes = True, False
    deferred = model(X, y, **kwargs)
    model.defer_checks = False
    try:
        read_first = model(X, y, **kwargs)
    finally:
        model.defer_checks = True
    return deferred, read_first


@pytest.mark.parametrize("task", ["clf", "reg"])
def test_forward_queues_the_network_before_it_reads_the_verdict(monkeypatch, task):
    from tabicl_helpers import our_model, random_table

    model = our_model(task, "tiny")
    X, y = random_table(21, 2, 40, 7, 5, 0 if task == "reg" else 4)
    events = []
    raw, verdict = model.forward_raw, model._classes_from_verdict
    monkeypatch.setattr(model, "forward_raw", lambda *a: events.append("network") or raw(*a))
    monkeypatch.setattr(
        model, "_classes_from_verdict", lambda s: events.append("verdict") or verdict(s)
    )
    deferred, read_first = _deferred_and_read_first(model, X, y, return_logits=False)
    # Read first, the verdict comes before the network (and the network runs once per call).
    assert events == ["network", "verdict", "verdict", "network"]
    assert torch.equal(deferred, read_first)
    assert deferred.shape == (2, 7, model.config.num_quantiles if task == "reg" else 4)


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (lambda y: y - 1, "non-negative integers"),  # -1 would index before the one-hot
        (lambda y: y * 1e19, "non-negative integers|exactly 0..K-1"),  # wraps as int64
        (lambda y: y + 20, "exactly 0..K-1"),  # past max_classes
        (lambda y: torch.where(y == 1, math.nan, y), "NaN"),
        (lambda y: y + 0.5, "non-negative integers"),
        (lambda y: torch.stack([y[0], y[1] % 2]), "same number of classes"),
    ],
)
def test_deferred_checks_raise_what_reading_first_raises(monkeypatch, labels, message):
    """Each bad table raises the read-first path's error after the network ran on labels moved
    inside the one-hot's width (an index outside it fails the CPU kernel with another error)."""
    from tabicl_helpers import our_model, random_table

    model = our_model("clf", "tiny")
    X, y = random_table(22, 2, 30, 4, 3, 3)
    bad = labels(y)
    seen = []
    raw = model.forward_raw
    monkeypatch.setattr(model, "forward_raw", lambda X, y: seen.append(y.clone()) or raw(X, y))
    model.defer_checks, model._last_call_many_classes = True, False
    with pytest.raises(ValueError, match=message):
        model(X, bad)
    assert len(seen) == 1 and seen[0].min() >= 0 and seen[0].max() <= model.config.max_classes - 1
    valid = torch.isfinite(bad) & (bad >= 0) & (bad < model.config.max_classes)
    assert torch.equal(seen[0][valid], bad[valid])  # labels in range are left as they are
    model.defer_checks = False
    try:
        with pytest.raises(ValueError, match=message):
            model(X, bad)
    finally:
        model.defer_checks = True
    X[1, 2, 0] = math.inf
    with pytest.raises(ValueError, match="X contains NaN"):
        model(X, y)


def test_a_table_of_many_classes_runs_again_and_the_next_call_reads_first(monkeypatch):
    from tabicl_helpers import our_model, random_table

    model = our_model("clf", "tiny")
    many_X, many_y = random_table(23, 2, 40, 5, 4, 13)  # > max_classes: the class hierarchy
    X, y = random_table(24, 2, 30, 4, 4, 3)
    calls = []
    raw = model.forward_raw
    monkeypatch.setattr(model, "forward_raw", lambda *a: calls.append(1) or raw(*a))
    deferred, read_first = _deferred_and_read_first(model, many_X, many_y)
    assert torch.equal(deferred, read_first) and deferred.shape == (2, 5, 13)
    assert len(calls) == 1  # only the deferred call ran the one-output network, in vain
    model.defer_checks = True
    model(many_X, many_y)  # follows a table of many classes: reads first
    assert len(calls) == 1 and model._last_call_many_classes
    model(X, y)  # reads first once more, then defers again
    model(X, y)
    assert len(calls) == 3 and not model._last_call_many_classes
