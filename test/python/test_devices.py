"""Several devices (``device`` as a list or ``"auto"``): the work spread over them, answers of
one device, failures named, two callers at once. On the CPU a list of CPU devices runs the same
scheduling (a thread per device)."""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest
import torch
from tabicl_helpers import reference_checkpoint, requires_cuda
from tabserve.models.tabicl import TabICLClassifier, TabICLRegressor
from tabserve.models.tabicl.sklearn import devices as spreading
from tabserve.models.tabicl.sklearn.devices import resolve_devices

TWO_CPUS = ["cpu", "cpu"]


def _data(seed: int = 0, classes: int = 3):
    rs = np.random.RandomState(seed)
    X = rs.randn(90, 6).astype(np.float32)
    y = (X[:, 0] * 2 + rs.randn(90)).round().astype(int) % classes if classes else X[:, 1] * 3
    return X[:70], y[:70], X[70:]


def _classifier(device, **params) -> TabICLClassifier:
    path = reference_checkpoint("clf", "tiny")
    return TabICLClassifier(model_path=path, device=device, n_estimators=4, **params)


def test_device_lists_and_auto_resolve():
    cpu = torch.device("cpu")
    assert resolve_devices("cpu") == (cpu,)
    assert resolve_devices(TWO_CPUS) == (cpu, cpu)
    assert resolve_devices((torch.device("cpu"),)) == (cpu,)
    if not torch.cuda.is_available():
        assert resolve_devices("auto") == (cpu,) and resolve_devices(None) == (cpu,)
    for bad, words in [([], "empty list"), ([None], "a list holds devices"), (["auto"], "a list holds"),
                       ([["cpu"]], "a list holds"), ("nodevice", "must name a torch device")]:  # fmt: skip
        with pytest.raises(ValueError, match=words):
            resolve_devices(bad)
        with pytest.raises(ValueError, match=words):
            _classifier(bad).fit(*_data()[:2])


@pytest.mark.parametrize("kv_cache", [False, True])
def test_a_list_of_devices_spreads_the_members_and_answers_as_one_device(kv_cache, monkeypatch):
    X, y, X_test = _data()
    expected = _classifier("cpu", kv_cache=kv_cache).fit(X, y).predict_proba(X_test)
    calls = []
    original = spreading.spread

    def recording(jobs, devices, engines):
        calls.append((len(jobs), len(devices)))
        return original(jobs, devices, engines)

    monkeypatch.setattr("tabserve.models.tabicl.sklearn.estimators.spread", recording)
    two = _classifier(TWO_CPUS, kv_cache=kv_cache).fit(X, y)
    assert two.devices_ == (torch.device("cpu"),) * 2 and two.device_ == torch.device("cpu")
    np.testing.assert_allclose(two.predict_proba(X_test), expected, atol=1e-6, rtol=0)
    assert calls and all(devices == 2 and jobs >= 2 for jobs, devices in calls)  # each device has work


def test_the_regressor_and_many_tables_spread_too():
    X, y, X_test = _data(1, classes=0)
    path = reference_checkpoint("reg", "tiny")
    one = TabICLRegressor(model_path=path, device="cpu", n_estimators=4).fit(X, y)
    two = TabICLRegressor(model_path=path, device=TWO_CPUS, n_estimators=4).fit(X, y)
    np.testing.assert_allclose(two.predict(X_test), one.predict(X_test), rtol=1e-6)
    tasks = [_data(seed) for seed in range(4)]
    alone = _classifier("cpu").fit_predict_many(tasks, "predict_proba")
    spread = _classifier(TWO_CPUS).fit_predict_many(tasks, "predict_proba")
    for a, b in zip(alone, spread):
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=0)


def test_a_failing_device_is_named_and_the_estimator_is_left_as_it_was(monkeypatch):
    X, y, X_test = _data()
    two = _classifier(TWO_CPUS).fit(X, y)
    before = two.predict_proba(X_test)

    class Broken:
        def __call__(self, *args, **kwargs):
            raise RuntimeError("out of memory on this device")

    good = two._engines()
    monkeypatch.setattr(type(two), "_engines", lambda self: [good[0], Broken()])
    with pytest.raises(RuntimeError, match="out of memory") as raised:
        two.predict_proba(X_test)
    assert any("on device cpu" in note for note in raised.value.__notes__)
    monkeypatch.undo()
    np.testing.assert_array_equal(two.predict_proba(X_test), before)


def test_two_callers_share_a_spread_estimator():
    X, y, X_test = _data()
    two = _classifier(TWO_CPUS).fit(X, y)
    expected = two.predict_proba(X_test)
    results, errors = [], []

    def call():
        try:
            for _ in range(3):
                results.append(two.predict_proba(X_test))
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 6
    for got in results:
        np.testing.assert_array_equal(got, expected)


def test_a_spread_estimator_pickles_with_its_devices():
    X, y, X_test = _data()
    two = _classifier(TWO_CPUS).fit(X, y)
    again = pickle.loads(pickle.dumps(two))
    assert again.devices_ == two.devices_
    np.testing.assert_array_equal(again.predict_proba(X_test), two.predict_proba(X_test))


@requires_cuda
def test_a_list_naming_one_gpu_twice_answers_as_that_gpu():
    X, y, X_test = _data()
    one = _classifier("cuda", recipe="exact").fit(X, y)
    twice = _classifier(["cuda:0", "cuda:0"], recipe="exact").fit(X, y)
    np.testing.assert_allclose(twice.predict_proba(X_test), one.predict_proba(X_test), atol=1e-5, rtol=0)
