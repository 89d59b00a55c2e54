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
from tabserve.models.tabicl.network.model import TabICLv2Cache
from tabserve.models.tabicl.sklearn.devices import choose_split, moved_to, resolve_devices, row_blocks

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


def _busiest(chunks, devices, rows_per_call):
    """Member-rows of the busiest device, counted by hand for the tests below."""
    per_device = [sum(chunks[i::devices]) for i in range(devices)]
    return max(per_device) * rows_per_call


def test_the_split_follows_the_busiest_device():
    # One-shot, 8 members in 4 chunks of 2 on 2 devices, 500 train and 100 test rows: members
    # give each device 4 members over 600 rows; rows 8 members over 550.
    assert _busiest([2, 2, 2, 2], 2, 600) < 8 * 550
    assert choose_split("auto", [2, 2, 2, 2], 2, 500, 100, None, cached=False) == "members"
    # KV-cached, two chunks of 4 on 3 devices, 9,000 test rows: members leave the third device
    # idle (4 x 9,000 on the busiest), rows give every device 8 x 3,000.
    assert 8 * 3000 < _busiest([4, 4], 3, 9000)
    assert choose_split("auto", [4, 4], 3, 500, 9000, None, cached=True) == "rows"
    # The same without the cache: each device runs the 500 train rows again, still fewer.
    assert choose_split("auto", [4, 4], 3, 500, 9000, None, cached=False) == "rows"
    # ... but not for 30 test rows: 8 x (500 + 10) > 4 x (500 + 30).
    assert choose_split("auto", [4, 4], 3, 500, 30, None, cached=False) == "members"
    # Test-row chunks of 1,000 run the train rows once per chunk: members 4 x (9 x 5,000 +
    # 9,000) = 216,000 against rows 8 x (3 x 5,000 + 3,000) = 144,000.
    assert choose_split("auto", [4, 4], 3, 5000, 9000, 1000, cached=False) == "rows"
    # Fewer members than devices: rows.
    assert choose_split("auto", [1], 2, 100, 50, None, cached=False) == "rows"
    # Forced, except where a device would get no row; one device never splits.
    assert choose_split("rows", [2, 2, 2, 2], 2, 500, 100, None, cached=False) == "rows"
    assert choose_split("members", [4, 4], 3, 500, 9000, None, cached=True) == "members"
    assert choose_split("rows", [1], 4, 100, 3, None, cached=False) == "members"
    assert choose_split("rows", [8], 1, 100, 300, None, cached=False) == "members"
    assert row_blocks(10, 3) == [(0, 4), (4, 7), (7, 10)] and row_blocks(2, 2) == [(0, 1), (1, 2)]


def _recording_spread(monkeypatch) -> list:
    calls = []
    original = spreading.spread

    def recording(jobs, devices, engines):
        calls.append(len(jobs))
        return original(jobs, devices, engines)

    monkeypatch.setattr("tabserve.models.tabicl.sklearn.estimators.spread", recording)
    return calls


@pytest.mark.parametrize("kv_cache", [False, True, "repr"])
@pytest.mark.parametrize("chunk_rows", [None, 7])
def test_a_prediction_split_by_rows_answers_as_one_device(kv_cache, chunk_rows, monkeypatch):
    X, y, X_test = _data(2)
    params = {"kv_cache": kv_cache, "test_chunk_rows": chunk_rows}
    expected = _classifier("cpu", **params).fit(X, y).predict_proba(X_test)
    two = _classifier(TWO_CPUS, device_split="rows", **params).fit(X, y)
    calls = _recording_spread(monkeypatch)
    np.testing.assert_allclose(two.predict_proba(X_test), expected, atol=1e-6, rtol=0)
    assert calls == [2]  # one block of rows per device, every member in it
    calls.clear()
    np.testing.assert_allclose(
        two.set_params(device_split="members").predict_proba(X_test), expected, atol=1e-6, rtol=0
    )
    assert calls and calls[0] >= 2 and len(calls) == (1 if chunk_rows is None else 3)


def test_the_regressor_splits_by_rows_too():
    X, y, X_test = _data(3, classes=0)
    path = reference_checkpoint("reg", "tiny")
    kinds = ["mean", "quantiles"]
    one = TabICLRegressor(model_path=path, device="cpu", n_estimators=4, kv_cache=True).fit(X, y)
    two = TabICLRegressor(
        model_path=path, device=TWO_CPUS, n_estimators=4, kv_cache=True, device_split="rows"
    ).fit(X, y)
    expected, got = one.predict(X_test, output_type=kinds), two.predict(X_test, output_type=kinds)
    for kind in kinds:
        np.testing.assert_allclose(got[kind], expected[kind], rtol=1e-6, atol=1e-6)


def test_auto_splits_an_uneven_cached_plan_by_rows(monkeypatch):
    # Three members in chunks of one on two devices: members give one device two of them, rows
    # give each three members over half the rows.
    X, y, X_test = _data(4)
    expected = _classifier("cpu", kv_cache=True).set_params(n_estimators=3).fit(X, y).predict_proba(X_test)
    two = _classifier(TWO_CPUS, kv_cache=True).set_params(n_estimators=3).fit(X, y)
    chunks = [c for method in two.plan_ for c in [1] * len(two.plan_[method])]
    assert two._split(len(X_test)) == "rows" == choose_split("auto", chunks, 2, 70, 20, None, True)
    calls = _recording_spread(monkeypatch)
    np.testing.assert_allclose(two.predict_proba(X_test), expected, atol=1e-6, rtol=0)
    assert calls == [2]


def test_caches_follow_the_estimator_to_another_count_of_devices():
    # Fitted on two devices the members' caches are built in chunks of half the members;
    # unpickled on one device, the prediction reads them in the same chunks.
    X, y, X_test = _data(5)
    two = _classifier(TWO_CPUS, kv_cache=True).fit(X, y)
    expected = two.predict_proba(X_test)
    one = pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(two)).set_params(device="cpu")))
    assert one.devices_ == (torch.device("cpu"),)
    members = sum(len(m) for m in two.plan_.values())
    assert len(one.cache_) == len(two.cache_) == 2 and one.cache_step_ == -(-members // 2)
    np.testing.assert_allclose(one.predict_proba(X_test), expected, atol=1e-6, rtol=0)
    # A refit without a cache keeps nothing of the cache's chunking.
    refit = two.set_params(kv_cache=False).fit(X, y)
    assert refit.cache_ is None and refit.cache_step_ is None
    np.testing.assert_allclose(refit.predict_proba(X_test), expected, atol=1e-6, rtol=0)


def test_a_cache_is_copied_to_another_device_once():
    X, y, _ = _data(6)
    clf = _classifier("cpu", kv_cache=True).fit(X, y)
    built = clf.cache_[0]
    assert clf._cache_on(0, torch.device("cpu")) is built  # where it was built: itself
    meta = torch.device("meta")
    copy = clf._cache_on(0, meta)
    assert copy is clf._cache_on(0, meta)  # kept, not copied again
    assert isinstance(copy, type(built)) and copy.n_train == built.n_train
    assert copy.icl[0][0].device == meta and copy.icl[0][0].shape == built.icl[0][0].shape
    assert not getattr(pickle.loads(pickle.dumps(clf)), "_cache_copies", {})  # never pickled


def test_moved_to_walks_caches_and_shares_what_is_already_there():
    k = torch.randn(2, 3)
    cache = TabICLv2Cache(col=[(k, k + 1)], icl=[(k * 2, k * 3)], n_train=5, n_features=3, num_classes=2)
    same = moved_to(cache, torch.device("cpu"))
    assert same.col[0][0] is k and same.n_train == 5
    moved = moved_to(cache, torch.device("meta"))
    assert moved.icl[0][1].device == torch.device("meta") and cache.icl[0][1].device == k.device


@requires_cuda
def test_a_list_naming_one_gpu_twice_answers_as_that_gpu():
    X, y, X_test = _data()
    one = _classifier("cuda", recipe="exact").fit(X, y)
    for split in ("members", "rows"):
        twice = _classifier(["cuda:0", "cuda:0"], recipe="exact", device_split=split).fit(X, y)
        np.testing.assert_allclose(twice.predict_proba(X_test), one.predict_proba(X_test), atol=1e-5, rtol=0)
