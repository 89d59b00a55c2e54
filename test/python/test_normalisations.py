"""The reference's other normalisations on the device (quantile, quantile_rtdl, robust) against
scikit-learn's transformers and tabicl 2.2.0's estimators, fp64 and seeded."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from sklearn import datasets
from sklearn.preprocessing import QuantileTransformer, RobustScaler
from tabicl_helpers import device_params, reference_checkpoint
from tabserve.models.tabicl import TabICLClassifier, TabICLRegressor
from tabserve.models.tabicl.sklearn.preprocessing import (
    QuantileNormal,
    RobustUnitVariance,
    _interp,
)

tabicl = pytest.importorskip("tabicl")
REFERENCE = {"device": "cpu", "use_amp": False, "use_fa3": False, "allow_auto_download": False}


def _columns(seed: int, rows: int) -> np.ndarray:
    """Columns of several shapes: normal, heavy-tailed, few distinct values (repeated
    quantiles), a constant one."""
    rng = np.random.default_rng(seed)
    return np.stack(
        [
            rng.standard_normal(rows),
            rng.standard_t(2, rows) * 5,
            rng.integers(0, 4, rows).astype(float),
            np.full(rows, 2.5),
        ],
        axis=1,
    )


def test_interp_is_numpys_with_repeated_points():
    rng = np.random.default_rng(0)
    xp = np.sort(np.r_[rng.integers(0, 5, 30), 7.0, 7.0]).astype(float)
    fp = np.linspace(0, 1, len(xp))
    x = np.r_[rng.uniform(-2, 9, 200), xp, -5.0, 12.0]
    got = _interp(torch.tensor(x)[:, None], torch.tensor(xp)[:, None], torch.tensor(fp))[:, 0]
    np.testing.assert_allclose(got.numpy(), np.interp(x, xp, fp), atol=1e-15, rtol=0)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("rows, subsample", [(300, 10_000), (12_000, 10_000), (40, 10_000)])
def test_quantile_normal_matches_scikit_learn(rows, subsample, device):
    train, test = _columns(1, rows), _columns(2, 500) * 1.5
    ref = QuantileTransformer(output_distribution="normal", subsample=subsample, random_state=42)
    with pytest.warns(UserWarning) if rows < 1000 else contextlib.nullcontext():
        ref.fit(train)
    ours = QuantileNormal(1000, subsample, 42).fit(torch.tensor(train, device=device))
    for x in (train, test):
        got = ours.transform(torch.tensor(x, device=device)).cpu().numpy()
        np.testing.assert_allclose(got, ref.transform(x), atol=1e-9, rtol=0)


@pytest.mark.parametrize("device", device_params())
def test_robust_unit_variance_matches_scikit_learn(device):
    train, test = _columns(3, 401), _columns(4, 100)
    ref = RobustScaler(unit_variance=True).fit(train)
    ours = RobustUnitVariance().fit(torch.tensor(train, device=device))
    got = ours.transform(torch.tensor(test, device=device)).cpu().numpy()
    np.testing.assert_allclose(got, ref.transform(test), atol=1e-12, rtol=0)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize(
    "norm_methods", [["quantile"], ["quantile_rtdl"], ["robust"], ["none", "power", "quantile", "robust"]]
)
def test_estimators_match_tabicl_with_every_normalisation(norm_methods, device):
    """fp32 (``recipe="exact"``) on either device against the reference on the CPU."""
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    X, y = datasets.load_wine(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    X, y = X[order], y[order]
    path = reference_checkpoint("clf", "tiny")
    params = {"norm_methods": norm_methods, "n_estimators": 4}
    ref = tabicl.TabICLClassifier(model_path=str(path), **REFERENCE, **params).fit(X[:130], y[:130])
    ours = TabICLClassifier(model_path=path, device=device, recipe="exact", **params)
    ours.fit(X[:130], y[:130])
    np.testing.assert_allclose(ours.predict_proba(X[130:]), ref.predict_proba(X[130:]), atol=1e-5, rtol=0)
    X, y = datasets.load_diabetes(return_X_y=True)
    path = reference_checkpoint("reg", "tiny")
    params = {"norm_methods": norm_methods, "n_estimators": 4}
    ref = tabicl.TabICLRegressor(model_path=str(path), **REFERENCE, **params).fit(X[:300], y[:300])
    ours = TabICLRegressor(model_path=path, device=device, recipe="exact", **params)
    ours.fit(X[:300], y[:300])
    np.testing.assert_allclose(ours.predict(X[300:]), ref.predict(X[300:]), atol=1e-5 * np.std(y), rtol=0)
