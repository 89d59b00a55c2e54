"""A fit loads the model (reads, verifies and builds the checkpoint) on a thread of its own while
it fits the members' preprocessing, where the checkpoint is still to be read; inline once it is.
Whatever the order the two finish in, a fit's answer, its errors and its undoing are those of a
fit that loaded first."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from tabicl_helpers import reference_checkpoint
from tabserve.models.tabicl import TabICLClassifier, TabICLRegressor
from tabserve.models.tabicl.network.checkpoint import forget_read_checkpoints
from tabserve.models.tabicl.sklearn import estimators, preprocessing

WAIT_S = 60.0  # a bound on the waits below, so that a fit that does not overlap fails, not hangs


def _table(seed: int = 0, rows: int = 60):
    rs = np.random.RandomState(seed)
    X = rs.randn(rows, 5).astype(np.float32)
    y = (X[:, 0] + 0.3 * rs.randn(rows) > 0).astype(int)
    return X[:40], y[:40], X[40:]


def test_an_unread_checkpoint_loads_while_the_preprocessing_fits(monkeypatch):
    """The loading thread waits for the preprocessing to start and the preprocessing for the
    loading: only a fit that runs both at once gets past them. The answer is the answer of a fit
    whose checkpoint was read before (inline)."""
    path = reference_checkpoint("clf", "tiny")
    X, y, X_test = _table()
    forget_read_checkpoints()
    preprocessing_started, loading_started = threading.Event(), threading.Event()
    load, fit = estimators._TabICLBase._load_model, preprocessing.MemberPreprocessor.fit
    threads = []

    def slow_load(self, *args):
        loading_started.set()
        threads.append(threading.current_thread().name)
        assert preprocessing_started.wait(WAIT_S)
        return load(self, *args)

    def waiting_fit(self, table):
        preprocessing_started.set()
        assert loading_started.wait(WAIT_S)
        return fit(self, table)

    monkeypatch.setattr(estimators._TabICLBase, "_load_model", slow_load)
    monkeypatch.setattr(preprocessing.MemberPreprocessor, "fit", waiting_fit)
    overlapped = TabICLClassifier(model_path=path, device="cpu", n_estimators=2).fit(X, y)
    assert threads == ["tabserve-load"]
    monkeypatch.setattr(estimators._TabICLBase, "_load_model", load)
    monkeypatch.setattr(preprocessing.MemberPreprocessor, "fit", fit)
    inline = TabICLClassifier(model_path=path, device="cpu", n_estimators=2).fit(X, y)
    np.testing.assert_array_equal(overlapped.predict_proba(X_test), inline.predict_proba(X_test))
    assert overlapped.model_ is inline.model_  # one served model per configuration


def test_a_read_checkpoint_loads_in_the_callers_thread(monkeypatch):
    path = reference_checkpoint("clf", "tiny")
    X, y, _ = _table(1)
    TabICLClassifier(model_path=path, device="cpu", n_estimators=2).fit(X, y)  # read it
    load, threads = estimators._TabICLBase._load_model, []

    def recording(self, *args):
        threads.append(threading.current_thread().name)
        return load(self, *args)

    monkeypatch.setattr(estimators._TabICLBase, "_load_model", recording)
    TabICLClassifier(model_path=path, device="cpu", n_estimators=2).fit(X, y)
    assert threads == [threading.current_thread().name]


def test_a_failed_preprocessing_waits_for_the_loading_before_the_fit_is_undone(monkeypatch):
    """The loading sets attributes (the path, the options) as it goes: a fit whose preprocessing
    fails while the loading still runs leaves a fitted estimator exactly as it was."""
    path = reference_checkpoint("clf", "tiny")
    X, y, X_test = _table(2)
    clf = TabICLClassifier(model_path=path, device="cpu", n_estimators=2).fit(X, y)
    before, answer = dict(clf.__dict__), clf.predict_proba(X_test)
    forget_read_checkpoints()
    failing = threading.Event()
    load = estimators._TabICLBase._load_model

    def late_load(self, *args):
        assert failing.wait(WAIT_S)
        return load(self, *args)

    def broken_fit(self, table):
        failing.set()
        raise RuntimeError("preprocessing broke")

    monkeypatch.setattr(estimators._TabICLBase, "_load_model", late_load)
    monkeypatch.setattr(preprocessing.MemberPreprocessor, "fit", broken_fit)
    with pytest.raises(RuntimeError, match="preprocessing broke"):
        clf.fit(*_table(3)[:2])
    assert clf.__dict__.keys() == before.keys()
    assert all(clf.__dict__[k] is v for k, v in before.items())
    np.testing.assert_array_equal(clf.predict_proba(X_test), answer)


def test_a_failed_loading_is_what_the_fit_raises(monkeypatch):
    """As when the model loaded before the preprocessing: a checkpoint of the other kind is
    the error, even where the preprocessing fails too; a failure of the preprocessing alone is
    raised as it is."""
    path = reference_checkpoint("clf", "tiny")
    X, y, _ = _table(4)
    forget_read_checkpoints()

    def broken_fit(self, table):
        raise RuntimeError("preprocessing broke")

    monkeypatch.setattr(preprocessing.MemberPreprocessor, "fit", broken_fit)
    with pytest.raises(ValueError, match="classification checkpoint; TabICLRegressor"):
        TabICLRegressor(model_path=path, device="cpu", n_estimators=2).fit(X, y.astype(float))
    with pytest.raises(RuntimeError, match="preprocessing broke"):
        TabICLClassifier(model_path=path, device="cpu", n_estimators=2).fit(X, y)
