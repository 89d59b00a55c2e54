"""The Yeo-Johnson lambda fit (``tabserve::yeo_johnson_lambdas``) against scikit-learn.

scikit-learn fits one column at a time with SciPy's bounded Brent search on the host; the operator
runs the same search for every column at once (a thread per column on the CPU, a block on the
GPU). Both evaluate the same objective, but not to the same last bit (different summation orders
and expm1 / log1p implementations), so the lambdas agree to the search's own noise floor: about
what scikit-learn itself moves when its input moves by one unit in the last place.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.optimize
import scipy.stats
import sklearn.preprocessing
import torch
from sklearn.preprocessing import PowerTransformer
from tabicl_helpers import requires_cuda
from tabserve import ops
from tabserve.models.tabicl.sklearn.preprocessing import (
    MemberPreprocessor,
    yeo_johnson,
    yeo_johnson_lambdas,
)

#: Largest |ours - sklearn| / max(1, |sklearn|) measured over the columns below: 1.1e-7 on
#: standardised, NaN-free columns (what the estimators feed), 1.6e-7 on all of them (raw scales
#: and missing values included); scikit-learn itself moves by ~2e-8 when its input moves by one
#: unit in the last place. The bounds leave room for other CPUs' vector paths.
STANDARDISED_BOUND = 4e-7
ANY_BOUND = 5e-7
ROWS = (3, 4, 7, 20, 100, 1000, 5000)


def _sklearn_lambdas(z: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return PowerTransformer(method="yeo-johnson", standardize=False).fit(z).lambdas_


def _standardise(x: np.ndarray) -> np.ndarray:
    """The estimators' input to the lambda fit: population std + 1e-6, clipped to +-100."""
    return np.clip((x - x.mean(axis=0)) / (x.std(axis=0) + 1e-6), -100, 100)


def _raw_columns(rng: np.random.Generator, n: int) -> np.ndarray:
    columns = [
        rng.normal(size=n),
        rng.normal(loc=50.0, scale=3.0, size=n),
        rng.lognormal(size=n),
        rng.lognormal(sigma=3.0, size=n),  # optimum far outside (-2, 2) once standardised
        rng.exponential(size=n),
        -rng.lognormal(sigma=1.5, size=n),  # negative-skewed
        rng.standard_t(2, size=n),  # heavy-tailed
        rng.standard_cauchy(size=n),
        rng.uniform(size=n),
        rng.poisson(2.0, size=n).astype(np.float64),
        rng.choice([0.0, 1.0], size=n, p=[0.9, 0.1]),  # two-valued, imbalanced
        rng.choice([-3.0, 7.0], size=n),  # two-valued, mixed signs
        rng.normal(size=n) * 1e-10,  # tiny scale
        rng.lognormal(size=n) * 1e6,  # huge scale
    ]
    columns = np.stack(columns, axis=1)
    columns[0, 10:12] = (0.0, -3.0)  # both values present in the two-valued columns
    columns[1, 10:12] = (1.0, 7.0)
    return columns


def _scaled_error(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    return np.abs(got - expected) / np.maximum(1.0, np.abs(expected))


def _bound(z: np.ndarray, expected: np.ndarray) -> float:
    """ANY_BOUND, or four times what scikit-learn itself moves where that is more. Where the
    objective is flat (a few rows, or columns at 1e-10 scales) its rounding decides the last
    digits: scikit-learn moves by up to 1.1e-5 when the same rows come in reverse order or each
    value moves by one unit in the last place, NumPy's expm1 differs in its last bits between
    CPUs' vector paths, and the GPU's block reductions sum in yet another order (on the H200 up
    to 2.4 times scikit-learn's own movement)."""
    moved = [_sklearn_lambdas(z[::-1].copy()), _sklearn_lambdas(np.nextafter(z, np.inf))]
    return max(ANY_BOUND, 4 * max(_scaled_error(m, expected).max() for m in moved))


def _fit(z: np.ndarray) -> np.ndarray:
    return yeo_johnson_lambdas(torch.from_numpy(np.array(z))).numpy()


@pytest.mark.parametrize("n", ROWS)
def test_lambdas_match_sklearn_on_standardised_columns(n):
    z = _standardise(_raw_columns(np.random.default_rng(n), n))
    expected, got = _sklearn_lambdas(z), _fit(z)
    assert got.dtype == np.float64 and got.shape == (z.shape[1],)
    assert _scaled_error(got, expected).max() <= STANDARDISED_BOUND


def _raw_and_standardised_with_missing(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = _raw_columns(rng, n)
    z = np.concatenate([raw, _standardise(raw)], axis=1)
    z[rng.uniform(size=z.shape) < 0.15] = np.nan
    z[0], z[1, : z.shape[1] // 2] = 0.5, 0.25  # no column left all-NaN or single-valued
    return z


@pytest.mark.parametrize("n", ROWS)
def test_lambdas_match_sklearn_on_raw_scales_and_missing_values(n):
    z = _raw_and_standardised_with_missing(1000 + n, n)
    expected, got = _sklearn_lambdas(z), _fit(z)
    assert _scaled_error(got, expected).max() <= ANY_BOUND


def test_optima_outside_the_starting_bracket_are_found():
    rng = np.random.default_rng(7)
    z = np.stack(
        [
            _standardise(rng.lognormal(sigma=3.0, size=2000)),  # lambda ~ -10
            _standardise(-rng.lognormal(sigma=3.0, size=2000)),  # lambda ~ 16
            rng.normal(size=2000) * 1e-9,  # nearly linear transform: lambda ~ 2e7
            _standardise(rng.lognormal(sigma=0.25, size=2000)),
        ],
        axis=1,
    )
    expected, got = _sklearn_lambdas(z), _fit(z)
    assert (np.abs(expected[:3]) > 5).all() and np.abs(expected[3]) < 2
    assert _scaled_error(got, expected).max() <= ANY_BOUND
    rel = np.abs(got - expected) / np.abs(expected)
    assert rel.max() <= ANY_BOUND


@pytest.mark.parametrize("n", (2, 3, 4, 5))
def test_long_searches_on_few_tiny_rows(n):
    """Two to five rows at scales ~1e-10: bounds ~ +-1e11, SciPy's longest searches (up to ~70
    evaluations where most columns need ~17)."""
    rng = np.random.default_rng(40 + n)
    z = rng.normal(size=(n, 12)) * np.logspace(-12, -8, 12)
    z[:, ::3] = np.abs(z[:, ::3])  # all positive, all negative and mixed signs
    z[:, 1::3] = -np.abs(z[:, 1::3])
    expected, got = _sklearn_lambdas(z), _fit(z)
    assert (np.abs(expected) > 1e3).any()
    assert _scaled_error(got, expected).max() <= _bound(z, expected)


def test_any_strides_and_an_empty_table():
    rng = np.random.default_rng(13)
    z = torch.from_numpy(_standardise(_raw_columns(rng, 300)))
    strided = torch.from_numpy(np.asfortranarray(z.numpy()))[:, ::2]
    torch.testing.assert_close(yeo_johnson_lambdas(strided), yeo_johnson_lambdas(z)[::2].contiguous(), rtol=0, atol=0)
    assert yeo_johnson_lambdas(torch.empty(5, 0, dtype=torch.float64)).shape == (0,)
    np.testing.assert_array_equal(yeo_johnson_lambdas(torch.empty(0, 3, dtype=torch.float64)).numpy(), [1.0] * 3)


def test_degenerate_columns_follow_sklearn():
    z = np.array(
        [
            [3.0, 0.0, 0.0, np.nan, 2.0, -1.0],
            [3.0, 0.0, np.nan, np.nan, 2.0, -1.0],
            [3.0, 0.0, 0.0, np.nan, np.nan, -1.0],
            [3.0, 0.0, 0.0, np.nan, 2.0, -2.0],
        ]
    )
    got = _fit(z)
    # constant, all zero, all zero but missing, all missing (sklearn raises): identity lambda
    np.testing.assert_array_equal(got[:4], [1.0, 1.0, 1.0, 1.0])
    np.testing.assert_array_equal(_sklearn_lambdas(z[:, :3]), [1.0, 1.0, 1.0])
    # constant apart from a missing value: sklearn does not call it constant and searches a
    # likelihood made of rounding noise; any lambda is as good, and the transform stays constant
    assert np.isfinite(got[4])
    y = yeo_johnson(torch.from_numpy(z[[0, 1, 3], 4:5]), torch.from_numpy(got[4:5])).numpy()
    assert np.ptp(y) <= 1e-12 * np.abs(y).max()
    assert _scaled_error(got[5:], _sklearn_lambdas(z[:, 5:])).max() <= ANY_BOUND
    # a single row: constant, lambda 1
    np.testing.assert_array_equal(_fit(np.array([[0.3, -2.0]])), [1.0, 1.0])


def test_transform_with_fitted_lambdas_matches_sklearn():
    rng = np.random.default_rng(3)
    z = _standardise(_raw_columns(rng, 1500))
    sk = PowerTransformer(method="yeo-johnson", standardize=False).fit(z)
    fitted = yeo_johnson_lambdas(torch.from_numpy(z))
    new = _standardise(_raw_columns(rng, 500))
    for rows in (z, new):
        expected = sk.transform(rows)
        got = yeo_johnson(torch.from_numpy(rows), fitted).numpy()
        scale = expected.std(axis=0)
        assert (np.abs(got - expected).max(axis=0) / scale).max() <= 3e-7  # measured 7e-8


def test_member_preprocessor_matches_the_reference_pipeline():
    from tabicl._sklearn.preprocessing import PreprocessingPipeline

    rng = np.random.default_rng(5)
    train, test = _raw_columns(rng, 800), _raw_columns(rng, 200)
    reference = PreprocessingPipeline(normalization_method="power").fit(train)
    ours = MemberPreprocessor("power").fit(torch.from_numpy(train))
    assert _scaled_error(ours.lambdas_.numpy(), reference.normalizer_.lambdas_).max() <= (
        STANDARDISED_BOUND
    )
    # measured 7e-8 (train) and 5e-8 (test)
    np.testing.assert_allclose(ours.train_.numpy(), reference.X_transformed_, rtol=0, atol=3e-7)
    np.testing.assert_allclose(
        ours.transform(torch.from_numpy(test)).numpy(),
        reference.transform(test),
        rtol=0,
        atol=3e-7,
    )


def _forbid(*_args, **_kwargs):
    raise AssertionError("called during the lambda fit")


def test_fit_uses_neither_sklearn_nor_scipy(monkeypatch):
    rng = np.random.default_rng(9)
    X = torch.from_numpy(_raw_columns(rng, 300))
    expected = MemberPreprocessor("power").fit(X).lambdas_
    monkeypatch.setattr(sklearn.preprocessing, "PowerTransformer", _forbid)
    for name in ("brent", "fminbound", "minimize_scalar"):
        monkeypatch.setattr(scipy.optimize, name, _forbid)
    for name in ("yeojohnson", "yeojohnson_normmax", "yeojohnson_llf"):
        monkeypatch.setattr(scipy.stats, name, _forbid)
    monkeypatch.setattr(scipy.stats._morestats.optimize, "fminbound", _forbid)
    monkeypatch.setattr(scipy.stats._morestats.optimize, "brent", _forbid)
    got = MemberPreprocessor("power").fit(X).lambdas_
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_fit_does_not_read_tensor_values_on_the_host(monkeypatch):
    rng = np.random.default_rng(10)
    raw = _raw_columns(rng, 400)
    z = np.concatenate([_standardise(raw), raw], axis=1)
    z[rng.uniform(size=z.shape) < 0.1] = np.nan
    z = torch.from_numpy(z)
    expected = yeo_johnson_lambdas(z)
    for name in ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, _forbid)
    got = yeo_johnson_lambdas(z)
    monkeypatch.undo()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_rejects_other_dtypes_and_shapes():
    with pytest.raises(RuntimeError, match="z must be float64"):
        yeo_johnson_lambdas(torch.ones(4, 2, dtype=torch.float32))
    for shape in ((4,), (2, 3, 4)):
        with pytest.raises(RuntimeError, match="z must be 2-D"):
            yeo_johnson_lambdas(torch.ones(shape, dtype=torch.float64))
        with pytest.raises(RuntimeError, match="z must be 2-D"):
            yeo_johnson_lambdas(torch.ones(shape, dtype=torch.float64, device="meta"))


def test_opcheck_and_one_compiled_graph():
    rng = np.random.default_rng(14)
    z = torch.from_numpy(_standardise(_raw_columns(rng, 64)))
    torch.library.opcheck(torch.ops.tabserve.yeo_johnson_lambdas.default, (z,))
    torch._dynamo.reset()
    fit = torch.compile(ops.yeo_johnson_lambdas, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fit(z), yeo_johnson_lambdas(z), rtol=0, atol=0)


@requires_cuda
def test_cuda_fit_matches_cpu_without_synchronising():
    rng = np.random.default_rng(12)
    raw = _raw_columns(rng, 2000)
    z = torch.from_numpy(np.concatenate([_standardise(raw), raw], axis=1))
    z_gpu = z.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = yeo_johnson_lambdas(z_gpu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.device == z_gpu.device
    expected = _sklearn_lambdas(z.numpy())
    assert _scaled_error(got.cpu().numpy(), expected).max() <= _bound(z.numpy(), expected)
    # the same search on both devices: only the sums' order differs
    assert _scaled_error(got.cpu().numpy(), _fit(z.numpy())).max() <= _bound(z.numpy(), expected)


@requires_cuda
@pytest.mark.parametrize("n", ROWS)
def test_cuda_fit_matches_sklearn_with_missing_values(n):
    z = _raw_and_standardised_with_missing(2000 + n, n)
    got = yeo_johnson_lambdas(torch.from_numpy(z).cuda()).cpu().numpy()
    expected = _sklearn_lambdas(z)
    assert _scaled_error(got, expected).max() <= _bound(z, expected)
    degenerate = np.array([[3.0, 0.0, np.nan], [3.0, 0.0, np.nan], [3.0, np.nan, np.nan]])
    np.testing.assert_array_equal(yeo_johnson_lambdas(torch.from_numpy(degenerate).cuda()).cpu().numpy(), [1.0] * 3)


def _tables_of_many_shapes(seed: int = 0) -> list:
    """Heavy-tailed columns on many scales, a constant column, a one-row table and one whose
    test rows lie far outside its train range (the transform's overflow path)."""
    rs = np.random.RandomState(seed)
    tables = []
    for i, (n, m, h) in enumerate([(40, 10, 5), (1, 3, 4), (120, 30, 9), (7, 1, 1), (64, 16, 12)]):
        X = rs.standard_t(2, size=(n + m, h)) * 10 ** rs.uniform(-2, 3, size=h)
        if h > 2:
            X[:, 1] = 3.0
        if i == 2:
            X[n:, 0] *= 1e6
        t = torch.tensor(X, dtype=torch.float64)
        tables.append((t[:n], t[n:]))
    return tables


@pytest.mark.parametrize("method", ["none", "power"])
def test_many_tables_preprocessed_at_once_are_each_tables_own(method):
    from tabserve.models.tabicl.sklearn.preprocessing import preprocess_many

    tables = _tables_of_many_shapes()
    for i, ((train, test), got) in enumerate(zip(tables, preprocess_many(tables, method, 4.0))):
        alone = MemberPreprocessor(method, 4.0).fit(train)
        want = torch.cat([alone.train_, alone.transform(test)])
        assert got.shape == want.shape and torch.isfinite(got).all(), i
        # the lambdas' search moves within its tolerance when sums run in another order
        torch.testing.assert_close(got, want, atol=1e-6 if method == "power" else 1e-12, rtol=0)
    with pytest.raises(ValueError, match="preprocess_many runs"):
        preprocess_many(tables, "quantile", 4.0)
