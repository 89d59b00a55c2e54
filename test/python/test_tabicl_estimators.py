"""Estimator-level parity with the reference ``tabicl.TabICLClassifier`` / ``TabICLRegressor``.

Same checkpoint, same ``random_state``; the reference runs in fp32 on CPU (AMP and FA3 off).
Probabilities must agree within 1e-5; regression statistics within 1e-5 target standard deviations
(the reference maps statistics back to target units in float32). Tables are subsampled to keep the
suite fast on a 2-core CPU.
"""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn import datasets
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from tabicl_helpers import reference_checkpoint, requires_cuda
from tabserve.models.tabicl import TabICLClassifier, TabICLRegressor

tabicl = pytest.importorskip("tabicl")
ATOL = 1e-5
REFERENCE_OPTIONS = {
    "device": "cpu",
    "use_amp": False,
    "use_fa3": False,
    "allow_auto_download": False,
}


def _split(X, y, rows: int, seed: int = 0):
    order = np.random.RandomState(seed).permutation(len(y))[:rows]
    n_train = int(len(order) * 0.75)
    take = (lambda a: a.iloc[order]) if hasattr(X, "iloc") else (lambda a: a[order])
    X, y = take(X), np.asarray(y)[order]
    return (
        X[:n_train] if not hasattr(X, "iloc") else X.iloc[:n_train],
        y[:n_train],
        (X[n_train:] if not hasattr(X, "iloc") else X.iloc[n_train:]),
    )


def _classifiers(size, **params):
    path = reference_checkpoint("clf", size)
    return (
        tabicl.TabICLClassifier(model_path=str(path), **REFERENCE_OPTIONS, **params),
        TabICLClassifier(model_path=path, device="cpu", **params),
    )


def _assert_same_classifier(size, X, y, rows=160, **params):
    X_train, y_train, X_test = _split(X, y, rows)
    ref, ours = _classifiers(size, **params)
    expected = ref.fit(X_train, y_train).predict_proba(X_test)
    got = ours.fit(X_train, y_train).predict_proba(X_test)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(ours.classes_, ref.classes_)
    assert (ours.predict(X_test) == ref.predict(X_test)).mean() >= 0.99
    return ours


DATASETS = {
    "iris": datasets.load_iris,
    "wine": datasets.load_wine,
    "breast_cancer": datasets.load_breast_cancer,
    "digits": datasets.load_digits,
}


@pytest.mark.parametrize("n_estimators", [1, 8])
@pytest.mark.parametrize("name", sorted(DATASETS))
def test_classifier_matches_reference_on_sklearn_datasets(name, n_estimators):
    X, y = DATASETS[name](return_X_y=True)
    _assert_same_classifier("tiny", X, y, n_estimators=n_estimators)


@pytest.mark.parametrize("name, n_estimators", [("iris", 1), ("breast_cancer", 8)])
def test_classifier_matches_reference_full_size(name, n_estimators):
    X, y = DATASETS[name](return_X_y=True)
    _assert_same_classifier("full", X, y, rows=120, n_estimators=n_estimators)


def test_classifier_options_match_reference():
    X, y = datasets.load_wine(return_X_y=True)
    _assert_same_classifier(
        "tiny",
        X,
        y,
        n_estimators=5,
        average_logits=False,
        softmax_temperature=0.5,
        norm_methods=["power"],
        feat_shuffle_method="shift",
        class_shuffle_method="none",
    )
    _assert_same_classifier(
        "tiny", X, y, n_estimators=6, feat_shuffle_method="random", random_state=7, batch_size=4
    )


def test_many_classes_match_reference():
    rs = np.random.RandomState(1)
    X = rs.randn(260, 6)
    y = np.repeat(np.arange(13), 20)
    X[:, 0] += y * 0.5
    _assert_same_classifier("tiny", X, y, rows=260, n_estimators=2)


@pytest.mark.parametrize(
    "params", [{}, {"kv_cache": True}, {"n_estimators": 3, "average_logits": False}]
)
def test_a_single_class_is_answered_as_the_reference_answers_it(params, tmp_path):
    rs = np.random.RandomState(2)
    X, y = rs.randn(40, 5), np.full(30, "only", dtype=object)
    ref, ours = _classifiers("tiny", **params)
    expected = ref.fit(X[:30], y).predict_proba(X[30:])
    got = ours.fit(X[:30], y).predict_proba(X[30:])
    assert got.dtype == expected.dtype and got.shape == expected.shape == (10, 1)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(ours.predict(X[30:]), ref.predict(X[30:]))
    assert ours.n_classes_ == ref.n_classes_ == 1
    with pytest.raises(ValueError, match="features"):  # its input is still checked
        ours.predict_proba(X[30:, :4])
    path = tmp_path / "single.pkl"
    ours.save(path, save_training_data=False)  # tabicl saves it so too
    loaded = TabICLClassifier.load(path, device="cpu")
    np.testing.assert_array_equal(loaded.predict_proba(X[30:]), expected)
    # Packed with a table of two classes, each task answers as its own estimator does.
    other = np.arange(30) % 2
    answers = ours.fit_predict_many([(X[:30], y, X[30:]), (X[:30], other, X[30:])], "predict_proba")
    np.testing.assert_array_equal(answers[0], expected)
    alone = clone(ours).fit(X[:30], other).predict_proba(X[30:])
    np.testing.assert_allclose(answers[1], alone, atol=1e-6, rtol=0)  # the packed path's gate


def _positional_inputs():
    rs = np.random.RandomState(3)
    X = rs.randn(50, 3)
    strings = rs.choice(["u", "v", "w"], 50).astype(object)
    named = pd.DataFrame(X, columns=["a", "b", "c"])
    mixed = named.assign(s=strings)
    return {
        "named frame, then an array": (named[:36], X[36:]),
        "unnamed frame, then a list": (pd.DataFrame(X[:36]), X[36:].tolist()),
        "unnamed frame, then other labels": (
            pd.DataFrame(X[:36]),
            pd.DataFrame(X[36:], columns=[7, 8, 9]),
        ),
        "frame with strings, then an object array": (mixed[:36], mixed[36:].to_numpy(dtype=object)),
    }


@pytest.mark.parametrize("case", sorted(_positional_inputs()))
@pytest.mark.filterwarnings("ignore:X does not have valid feature names")
def test_a_frame_fitted_estimator_reads_other_inputs_by_position_as_the_reference(case):
    X_train, X_test = _positional_inputs()[case]
    y = np.arange(36) % 3
    ref, ours = _classifiers("tiny", n_estimators=2)
    expected = ref.fit(X_train, y).predict_proba(X_test)
    got = ours.fit(X_train, y).predict_proba(X_test)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("axis, temperature", [(-1, 0.9), (0, 2.0), (1, 0.5)])
def test_softmax_is_the_references(axis, temperature):
    logits = np.random.RandomState(4).randn(7, 5).astype(np.float32) * 30
    for ours, ref in (
        (TabICLClassifier, tabicl.TabICLClassifier),
        (TabICLRegressor, tabicl.TabICLRegressor),
    ):
        expected = ref.softmax(logits, axis=axis, temperature=temperature)
        got = ours.softmax(logits, axis=axis, temperature=temperature)
        assert got.dtype == expected.dtype
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("norm", ["quantile", "power"])
def test_float32_input_is_answered_as_the_reference_answers_its_float64_values(norm):
    rs = np.random.RandomState(5)
    X = np.column_stack([rs.randint(0, 4, 60), rs.randn(60), rs.randn(60) * 50])
    X[rs.rand(60, 3) < 0.15] = np.nan  # imputed means: tied train values too
    X = X.astype(np.float32)
    y = np.arange(45) % 3
    ref, ours = _classifiers("tiny", n_estimators=4, norm_methods=[norm])
    expected = ref.fit(X[:45].astype(np.float64), y).predict_proba(X[45:].astype(np.float64))
    got = ours.fit(X[:45], y).predict_proba(X[45:])
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


def _python_ordered_frame(rows: int = 60, seed: int = 6):
    import datetime
    import decimal

    rs = np.random.RandomState(seed)
    days = [datetime.date(2024, 1, 1 + int(d)) for d in rs.randint(0, 6, rows)]
    days[3], days[-1], days[-2] = None, datetime.date(2030, 1, 1), None  # None; unseen at test
    prices = [decimal.Decimal(int(p)) / 4 for p in rs.randint(0, 5, rows)]
    prices[5] = np.nan
    binned = pd.cut(rs.randn(rows), [-1.5, -0.5, 0.5, 1.5])  # NaN outside the bins
    stamps = pd.to_datetime(["2021-03-01", "2020-01-01", "2022-07-04"])[rs.randint(0, 3, rows)]
    return pd.DataFrame(
        {
            "day": pd.Series(days, dtype=object),
            "price": pd.Series(prices, dtype=object),
            "bin": binned,
            "stamp": pd.Categorical(stamps),
            "x": rs.randn(rows),
        }
    )


def test_categories_only_python_orders_are_encoded_as_the_reference_encodes_them(tmp_path):
    frame = _python_ordered_frame()
    y = np.arange(45) % 3
    ref, ours = _classifiers("tiny", n_estimators=2)
    expected = ref.fit(frame[:45], y).predict_proba(frame[45:])
    got = ours.fit(frame[:45], y).predict_proba(frame[45:])
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    ours.save(tmp_path / "ranks.pkl")
    loaded = TabICLClassifier.load(tmp_path / "ranks.pkl", device="cpu")
    np.testing.assert_array_equal(loaded.predict_proba(frame[45:]), got)


def _random_case(seed: int) -> tuple:
    """A seeded table, target and argument set of the kinds users bring: NumPy or a DataFrame
    (strings with None, categories with unused levels, nullable integers and booleans, NaN,
    constant and all-missing columns, values unseen at fit), 2-25 classes or a regression
    target, and tabicl's ensemble arguments drawn at random."""
    rs = np.random.RandomState(seed)
    n_train, n_test = rs.randint(8, 90), rs.randint(1, 25)
    rows, frame = n_train + n_test, rs.rand() < 0.5
    kinds = ["normal", "integer", "missing", "constant", "empty", "large"]
    kinds += ["object", "category", "Int64", "boolean"] if frame else []
    columns = {}
    for j in range(rs.randint(1, 9)):
        kind = rs.choice(kinds)
        if kind == "normal":
            values = rs.randn(rows)
        elif kind == "integer":
            values = rs.randint(0, 4, rows).astype(float)
        elif kind == "missing":
            values = np.where(rs.rand(rows) < 0.3, np.nan, rs.randn(rows))
        elif kind == "constant":
            values = np.full(rows, 2.5)
        elif kind == "empty":
            values = np.full(rows, np.nan)
        elif kind == "large":
            values = rs.randn(rows) * 1e5 + 1e6
        elif kind == "object":
            values = pd.Series(rs.choice(["a", "b", "c", None], rows), dtype=object)
            values.iloc[-1] = "unseen"
        elif kind == "category":
            values = pd.Categorical(rs.choice(["p", "q"], rows), categories=["q", "p", "unused"])
        elif kind == "Int64":
            values = pd.array(np.where(rs.rand(rows) < 0.2, None, rs.randint(0, 9, rows)), "Int64")
        else:
            values = pd.array(np.where(rs.rand(rows) < 0.2, None, rs.rand(rows) < 0.5), "boolean")
        columns[f"{kind}_{j}"] = values
    X = pd.DataFrame(columns) if frame else np.column_stack(list(columns.values()))
    take = (lambda a, s: a.iloc[s].reset_index(drop=True)) if frame else (lambda a, s: a[s])
    regression = rs.rand() < 0.3
    if regression:
        y = rs.randn(n_train) * 10.0 ** rs.randint(-2, 3)
    else:
        classes = rs.choice([2, 3, 5, 12, 25])
        y = np.array([f"c{c}" for c in rs.randint(0, classes, n_train)], dtype=object)
    params = {"random_state": int(rs.randint(100))}
    for name, choices in (
        ("n_estimators", [1, 2, 3, 5, 8]),
        ("norm_methods", [["none"], ["power"], ["quantile", "robust"], ["quantile_rtdl", "none"]]),
        ("feat_shuffle_method", ["none", "shift", "random", "latin"]),
        ("outlier_threshold", [2.0, 10.0]),
        ("batch_size", [1, 3]),
        ("kv_cache", [True, "repr"]),
    ) + (() if regression else (
        ("class_shuffle_method", ["none", "shift", "random", "latin"]),
        ("average_logits", [False]),
        ("softmax_temperature", [0.5, 2.0]),
    )):  # fmt: skip
        if rs.rand() < 0.4:
            params[name] = choices[rs.randint(len(choices))]
    if not regression and len(set(y)) > 10:
        params.pop("kv_cache", None)  # both refuse a KV cache past 10 classes
    return take(X, slice(0, n_train)), y, take(X, slice(n_train, None)), regression, params


@pytest.mark.parametrize("seed", range(24))
def test_random_tables_and_arguments_answer_as_the_reference(seed):
    X_train, y, X_test, regression, params = _random_case(seed)
    task = "reg" if regression else "clf"
    path = reference_checkpoint(task, "tiny")
    ours, theirs = (TabICLRegressor, tabicl.TabICLRegressor) if regression else (
        TabICLClassifier, tabicl.TabICLClassifier)  # fmt: skip
    ref = theirs(model_path=str(path), **REFERENCE_OPTIONS, **params).fit(X_train, y)
    mine = ours(model_path=path, device="cpu", **params).fit(X_train, y)
    if regression:
        np.testing.assert_allclose(
            mine.predict(X_test), ref.predict(X_test), atol=ATOL * np.std(y), rtol=0
        )
    else:
        expected = ref.predict_proba(X_test)
        np.testing.assert_allclose(mine.predict_proba(X_test), expected, atol=ATOL, rtol=0)


def _mixed_frame(rows: int = 180, seed: int = 0) -> tuple:
    rs = np.random.RandomState(seed)
    colour = rs.choice(["red", "green", "blue", None], rows, p=[0.4, 0.3, 0.2, 0.1])
    city = pd.Series(rs.choice(["paris", "oslo", "rome"], rows)).astype("category")
    flag = pd.array(rs.choice([True, False, None], rows), dtype="boolean")
    size = rs.randn(rows) * 10 + 50
    size[rs.rand(rows) < 0.15] = np.nan
    weight = rs.rand(rows)
    frame = pd.DataFrame(
        {
            "size": size,
            "colour": colour,
            "weight": weight,
            "city": city,
            "flag": flag,
            "name": pd.array([f"n{i % 7}" for i in range(rows)], dtype="string"),
        }
    )
    y = (np.nan_to_num(size, nan=50) > 50).astype(int) + (colour == "red")
    return frame, y


@pytest.mark.parametrize("n_estimators", [1, 8])
def test_dataframe_with_categories_and_missing_values(n_estimators):
    frame, y = _mixed_frame()
    frame.loc[frame.index[-5:], "colour"] = "purple"  # unseen at fit -> code -1, as the reference
    X_train, y_train, X_test = frame.iloc[:130], y[:130], frame.iloc[130:]
    ref, ours = _classifiers("tiny", n_estimators=n_estimators)
    expected = ref.fit(X_train, y_train).predict_proba(X_test)
    got = ours.fit(X_train, y_train).predict_proba(X_test)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    assert list(ours.feature_names_in_) == list(frame.columns)


def _assert_same_regressor(
    size, X, y, rows=160, kinds=("mean", "median", "variance", "quantiles"), **params
):
    X_train, y_train, X_test = _split(X, y, rows)
    path = reference_checkpoint("reg", size)
    ref = tabicl.TabICLRegressor(model_path=str(path), **REFERENCE_OPTIONS, **params).fit(
        X_train, y_train
    )
    ours = TabICLRegressor(model_path=path, device="cpu", **params).fit(X_train, y_train)
    expected = ref.predict(X_test, output_type=list(kinds))
    got = ours.predict(X_test, output_type=list(kinds))
    for kind in kinds:
        np.testing.assert_allclose(
            got[kind], expected[kind], atol=ATOL * np.std(y_train), rtol=0, err_msg=kind
        )
    return ours, X_test


@pytest.mark.parametrize("size, n_estimators", [("tiny", 1), ("tiny", 8), ("full", 1), ("full", 8)])
def test_regressor_matches_reference_on_diabetes(size, n_estimators):
    X, y = datasets.load_diabetes(return_X_y=True)
    ours, X_test = _assert_same_regressor(
        size, X, y, rows=80 if size == "full" else 200, n_estimators=n_estimators
    )
    assert ours.predict(X_test).shape == (len(X_test),)
    assert ours.predict(X_test, output_type="raw_quantiles").shape[0] == len(X_test)


def test_regressor_dataframe_matches_reference():
    frame, _ = _mixed_frame(seed=2)
    y = np.nan_to_num(frame["size"].to_numpy(), nan=3.0) * 2 + frame["weight"].to_numpy()
    _assert_same_regressor("tiny", frame, y, rows=150, n_estimators=4)


@pytest.mark.parametrize("mode", [True, "repr"])
def test_kv_cache_matches_uncached_and_reference(mode):
    X, y = datasets.load_breast_cancer(return_X_y=True)
    X_train, y_train, X_test = _split(X, y, 120)
    ref, ours = _classifiers("tiny", kv_cache=mode)
    plain = (
        TabICLClassifier(model_path=ours.model_path, device="cpu")
        .fit(X_train, y_train)
        .predict_proba(X_test)
    )
    cached = ours.fit(X_train, y_train).predict_proba(X_test)
    np.testing.assert_allclose(cached, plain, atol=ATOL, rtol=0)
    np.testing.assert_allclose(
        cached, ref.fit(X_train, y_train).predict_proba(X_test), atol=ATOL, rtol=0
    )
    X, y = datasets.load_diabetes(return_X_y=True)
    X_train, y_train, X_test = _split(X, y, 120)
    path = reference_checkpoint("reg", "tiny")
    cached = (
        TabICLRegressor(model_path=path, kv_cache=mode, device="cpu")
        .fit(X_train, y_train)
        .predict(X_test)
    )
    plain = TabICLRegressor(model_path=path, device="cpu").fit(X_train, y_train).predict(X_test)
    np.testing.assert_allclose(cached, plain, atol=ATOL * np.std(y_train), rtol=0)
    reference = tabicl.TabICLRegressor(model_path=str(path), kv_cache=mode, **REFERENCE_OPTIONS)
    np.testing.assert_allclose(
        cached, reference.fit(X_train, y_train).predict(X_test), atol=ATOL * np.std(y_train), rtol=0
    )


def test_sklearn_conventions():
    clf = TabICLClassifier(n_estimators=3, model_path="x.ckpt", random_state=1)
    assert clf.get_params()["n_estimators"] == 3
    assert clone(clf).set_params(n_estimators=5).n_estimators == 5
    with pytest.raises(NotFittedError):
        clf.predict(np.zeros((2, 3)))
    X, y = datasets.load_iris(return_X_y=True)
    fitted = TabICLClassifier(
        n_estimators=2, model_path=reference_checkpoint("clf", "tiny"), device="cpu"
    )
    fitted.fit(X[::3], y[::3])
    assert fitted.n_features_in_ == 4 and fitted.n_classes_ == 3
    assert fitted.score(X[1::3], y[1::3]) >= 0.0


# ----------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def fitted_classifier():
    X, y = datasets.load_iris(return_X_y=True)
    return TabICLClassifier(
        n_estimators=2, model_path=reference_checkpoint("clf", "tiny"), device="cpu"
    ).fit(X[::2], y[::2])


def test_nan_features_are_imputed_like_the_reference():
    X, y = datasets.load_wine(return_X_y=True)
    X = X.copy()
    X[np.random.RandomState(0).rand(*X.shape) < 0.1] = np.nan
    X[:, 3] = np.nan  # an all-missing column
    _assert_same_classifier("tiny", X, y, n_estimators=2)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda X, y: (np.where(X > 6, np.inf, X), y), "Input X contains infinity"),
        (lambda X, y: (X[:0], y[:0]), r"0 sample\(s\)"),
        (lambda X, y: (X, y[:-1]), "inconsistent numbers of samples"),
        (lambda X, y: (X.astype(str).astype(object) + "x", y), "could not convert string to float"),
        (lambda X, y: (X, np.where(y == 0, np.nan, y)), "NaN labels"),
    ],
    ids=["inf", "zero-rows", "length", "strings-in-numpy", "nan-labels"],
)
def test_bad_fit_input_raises(make, match):
    X, y = datasets.load_iris(return_X_y=True)
    X, y = make(X[::3], y[::3])
    with pytest.raises(ValueError, match=match):
        TabICLClassifier(
            n_estimators=1, model_path=reference_checkpoint("clf", "tiny"), device="cpu"
        ).fit(X, y)


def test_bad_predict_input_raises(fitted_classifier):
    X, _ = datasets.load_iris(return_X_y=True)
    with pytest.raises(ValueError, match="is expecting 4 features"):
        fitted_classifier.predict_proba(X[:, :3])
    with pytest.raises(ValueError, match="Input X contains infinity"):
        fitted_classifier.predict_proba(np.full((2, 4), np.inf))
    with pytest.raises(ValueError, match="Reshape your data"):
        fitted_classifier.predict_proba(X[0])
    with pytest.raises(ValueError, match="could not convert string to float"):
        fitted_classifier.predict_proba(np.array([["a", "b", "c", "d"]], dtype=object))


def test_bad_configuration_raises(tmp_path):
    X, y = datasets.load_iris(return_X_y=True)
    with pytest.raises(FileNotFoundError, match="allow_auto_download=True to download"):
        TabICLClassifier(model_path=tmp_path / "absent.ckpt", allow_auto_download=False).fit(X, y)
    with pytest.raises(ValueError, match="regression checkpoint"):
        TabICLClassifier(model_path=reference_checkpoint("reg", "tiny"), device="cpu").fit(X, y)
    with pytest.raises(ValueError, match="kv_cache is not supported"):
        TabICLClassifier(
            model_path=reference_checkpoint("clf", "tiny"), kv_cache=True, device="cpu"
        ).fit(np.arange(24.0)[:, None], np.arange(24) % 12)
    with pytest.raises(ValueError, match="numeric"):
        TabICLRegressor(model_path=reference_checkpoint("reg", "tiny"), device="cpu").fit(
            X, np.array(["a", "b", "c"])[y]
        )
    truncated = tmp_path / "broken.ckpt"
    truncated.write_bytes(reference_checkpoint("clf", "tiny").read_bytes()[:1000])
    with pytest.raises(ValueError, match="corrupted or truncated"):
        TabICLClassifier(model_path=truncated, device="cpu").fit(X, y)


@pytest.mark.cuda
@requires_cuda
def test_cuda_estimators_match_reference():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    X, y = datasets.load_breast_cancer(return_X_y=True)
    X_train, y_train, X_test = _split(X, y, 400)
    path = reference_checkpoint("clf", "full")
    ref = tabicl.TabICLClassifier(
        model_path=str(path), device="cuda", use_amp=False, use_fa3=False, allow_auto_download=False
    ).fit(X_train, y_train)
    ours = TabICLClassifier(model_path=path, device="cuda", recipe="exact").fit(X_train, y_train)
    np.testing.assert_allclose(
        ours.predict_proba(X_test), ref.predict_proba(X_test), atol=ATOL, rtol=0
    )


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("task", ["clf", "reg"])
def test_cuda_estimators_on_dataframes_match_reference(task):
    """A DataFrame with string, pandas ``category`` and boolean columns, NaN and categories
    unseen at fit, string class labels (classifier) or a continuous target (regressor), on CUDA
    in fp32: the reference's answers, as on the CPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    frame, y = _mixed_frame(seed=4)
    frame.loc[frame.index[-5:], "colour"] = "purple"  # unseen at fit
    X_train, X_test = frame.iloc[:130], frame.iloc[130:]
    path = reference_checkpoint(task, "tiny")
    reference = {**REFERENCE_OPTIONS, "device": "cuda", "model_path": str(path), "n_estimators": 4}
    ours = {"device": "cuda", "model_path": path, "n_estimators": 4, "recipe": "exact"}
    if task == "clf":
        labels = np.array(["low", "mid", "high"])[y]
        ref = tabicl.TabICLClassifier(**reference).fit(X_train, labels[:130])
        ours = TabICLClassifier(**ours).fit(X_train, labels[:130])
        assert list(ours.classes_) == list(ref.classes_)
        np.testing.assert_allclose(
            ours.predict_proba(X_test), ref.predict_proba(X_test), atol=ATOL, rtol=0
        )
        assert (ours.predict(X_test) == ref.predict(X_test)).all()
    else:
        target = np.nan_to_num(frame["size"].to_numpy(), nan=3.0) * 2 + frame["weight"].to_numpy()
        ref = tabicl.TabICLRegressor(**reference).fit(X_train, target[:130])
        ours = TabICLRegressor(**ours).fit(X_train, target[:130])
        np.testing.assert_allclose(
            ours.predict(X_test), ref.predict(X_test), atol=ATOL * np.std(target), rtol=0
        )



def test_fresh_estimators_share_one_served_model_per_configuration(tmp_path, monkeypatch):
    """Fresh estimators (clones, as cross-validation makes) of one checkpoint, device and preset
    get the same served model: the file is read once and the network built once, without
    random initialisation; another configuration, a rewritten file or a cleared cache gets a
    new one; the predictions are the same either way."""
    import shutil

    from sklearn.base import clone
    from tabserve.models.tabicl.network import checkpoint
    from tabserve.models.tabicl.serving import model_cache
    from tabserve.models.tabicl.serving.options import ServingOptions

    model_cache.clear_model_cache()
    path = tmp_path / "clf.ckpt"
    shutil.copy(reference_checkpoint("clf", "tiny"), path)
    reads = []
    original = checkpoint.load_checkpoint
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda p: reads.append(p) or original(p))
    for name in ("kaiming_uniform_", "uniform_", "normal_", "ones_", "zeros_"):
        init = getattr(torch.nn.init, name)

        def on_meta_only(tensor, *args, __init=init, **kwargs):  # initialising costs nothing
            assert tensor.is_meta, "a weight was initialised in memory before being loaded"
            return __init(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.nn.init, name, on_meta_only)
    X, y = datasets.load_iris(return_X_y=True)
    first = TabICLClassifier(n_estimators=2, model_path=path, device="cpu").fit(X, y)
    second = clone(first).fit(X[::2], y[::2])
    assert second.model_ is first.model_ and len(reads) == 1
    np.testing.assert_array_equal(clone(first).fit(X, y).predict_proba(X), first.predict_proba(X))
    other = clone(first).set_params(recipe=ServingOptions(buckets=True)).fit(X, y)
    assert other.model_ is not first.model_ and len(reads) == 1
    info = model_cache.cache_info()
    assert (info["checkpoints"], info["served_models"]) == (1, 2)
    shutil.copy(reference_checkpoint("clf", "tiny"), path)  # rewritten: a new identity
    os.utime(path, ns=(0, 0))
    assert clone(first).fit(X, y).model_ is not first.model_ and len(reads) == 2
    model_cache.clear_model_cache()
    assert model_cache.cache_info()["served_models"] == 0
    assert clone(first).fit(X, y).model_ is not first.model_ and len(reads) == 3
    model_cache.clear_model_cache()


def test_dataframe_with_integer_column_names_matches_reference():
    """``pd.DataFrame(array)`` names its columns 0, 1, ...: fitted and predicted by position of
    those names, as the reference does."""
    X, y = datasets.load_iris(return_X_y=True)
    frame = pd.DataFrame(X)
    X_train, y_train, X_test = frame.iloc[:120], y[:120], frame.iloc[120:]
    ref, ours = _classifiers("tiny", n_estimators=2)
    expected = ref.fit(X_train, y_train).predict_proba(X_test)
    np.testing.assert_allclose(ours.fit(X_train, y_train).predict_proba(X_test), expected, atol=ATOL, rtol=0)


def test_a_dataframe_with_infinity_is_refused_as_the_reference_refuses_it():
    frame, y = _mixed_frame(rows=60, seed=3)
    numeric = frame.select_dtypes("number").columns[0]
    bad = frame.iloc[40:].copy()
    bad.loc[bad.index[1], numeric] = -np.inf
    ref, ours = _classifiers("tiny", n_estimators=2)
    errors = []
    for estimator in (ref, ours):
        with pytest.raises(ValueError) as fit_error:
            clone(estimator).fit(bad, y[40:])
        estimator.fit(frame.iloc[:40], y[:40])
        with pytest.raises(ValueError) as predict_error:
            estimator.predict_proba(bad)
        errors.append((str(fit_error.value), str(predict_error.value)))
    assert errors[0] == errors[1]
    assert "Input X contains infinity" in errors[1][1]
    finite = frame.iloc[40:]
    np.testing.assert_allclose(
        ours.predict_proba(finite), ref.predict_proba(finite), atol=ATOL, rtol=0
    )  # the refused call left the fitted estimator whole


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("task", ["clf", "reg"])
def test_cuda_default_serves_at_once_then_compiled_within_the_gate(task, monkeypatch):
    """With no recipe a CUDA estimator serves recipe='auto': its first answer comes before any
    compile (the ready preset), the later ones from the compiled preset once the background
    has built it, both within the default's accuracy gate of tabicl in fp32 (2e-2 of a
    probability, or of the target's spread). The calls' time on the ready preset does not
    decide here (COMPILE_AFTER_MS = 0): the second call queues the compile however fast the
    device answered the first."""
    from tabserve.models.tabicl.serving import background

    monkeypatch.setattr(background, "COMPILE_AFTER_MS", 0.0)

    frame, y = _mixed_frame(rows=400, seed=6)
    X_train, X_test = frame.iloc[:300], frame.iloc[300:]
    path = reference_checkpoint(task, "full")
    reference = {**REFERENCE_OPTIONS, "device": "cuda", "model_path": str(path)}
    if task == "clf":
        ref = tabicl.TabICLClassifier(**reference).fit(X_train, y[:300])
        expected, spread = ref.predict_proba(X_test), 1.0
        make = lambda: TabICLClassifier(model_path=path, device="cuda").fit(X_train, y[:300])  # noqa: E731
        answer = lambda est: est.predict_proba(X_test)  # noqa: E731
    else:
        target = np.nan_to_num(frame["size"].to_numpy(), nan=3.0) * 2 + frame["weight"].to_numpy()
        ref = tabicl.TabICLRegressor(**reference).fit(X_train, target[:300])
        expected, spread = ref.predict(X_test), float(np.std(target[:300]))
        make = lambda: TabICLRegressor(model_path=path, device="cuda").fit(X_train, target[:300])  # noqa: E731
        answer = lambda est: est.predict(X_test)  # noqa: E731
    first = make()
    np.testing.assert_allclose(answer(first), expected, atol=2e-2 * spread, rtol=0)
    if isinstance(first.model_, background.CompilingTabICL):
        # the call recurs: its compile is queued, and the ready preset answers meanwhile
        second = make()
        assert second.model_ is first.model_  # shared, with what it compiles
        np.testing.assert_allclose(answer(second), expected, atol=2e-2 * spread, rtol=0)
        assert background.background_compiles() > 0
        assert background.wait_for_compiles(timeout=900)
        third = make()
        np.testing.assert_allclose(answer(third), expected, atol=2e-2 * spread, rtol=0)
        # the compiled preset took the call over, or was timed slower and left it to ready
        decided = [s for s in third.model_._state.values() if s in ("compiled", "declined")]
        assert decided and third.model_.timings


@pytest.mark.parametrize("settings", [{}, {"auto_offload_threshold": 0.3, "cpu_safety_factor": 0.6,
                                       "disk_safety_factor": 0.5, "disk_min_free_mb": 5_000.0}])  # fmt: skip
@pytest.mark.parametrize(
    "mode, has_disk",
    [(m, d) for m in ("auto", "gpu", "cpu", "disk") for d in (True, False) if d or m != "disk"],
)
def test_where_a_gpu_call_keeps_its_column_output_is_tabicls_choice(mode, has_disk, settings):
    """offload_target against tabicl 2.2.0's own rule (InferenceManager._resolve_offload_mode)
    over outputs around every threshold: the device's free memory, the host's, the disk's
    ("disk" without a folder is refused before any call); tabicl's defaults, and the thresholds
    an inference_config's column stage sets."""
    from tabicl._model.inference import InferenceManager
    from tabserve.models.tabicl.sklearn.reference_args import offload_target, reference_settings

    manager = InferenceManager(enc_name="tf_col", out_dim=128)
    folder = "/x" if has_disk else None
    manager.configure(offload=mode, device="cpu", disk_offload_dir=folder, **settings)
    estimator = TabICLClassifier(device="cpu", inference_config={"COL_CONFIG": dict(settings)})
    rule = reference_settings(estimator).offload_rule
    names = {"GPU": "device", "CPU": "cpu", "DISK": "disk"}
    mib = 1 << 20
    device_free, host_free, disk_free = 40_000, 60_000, 90_000  # MiB
    edges = (
        device_free * rule.device_share, device_free, host_free * rule.host_share,
        (disk_free - rule.disk_reserve / mib) * rule.disk_share,
    )  # fmt: skip
    outputs = sorted({1, 200_000} | {max(1, int(e) + d) for e in edges for d in (-1, 0, 1)})
    for output in outputs:
        for free in (device_free, 0):
            want, _ = manager._resolve_offload_mode(output, free, host_free, disk_free)
            got = offload_target(
                mode, output * mib, free * mib, host_free * mib,
                disk_free * mib if has_disk else None, rule,
            )  # fmt: skip
            assert got == names[want.name], (mode, has_disk, output, free)


@requires_cuda
def test_a_gpu_call_whose_column_output_the_device_cannot_hold_is_offloaded(monkeypatch):
    from tabserve.models.tabicl.sklearn import reference_args

    frame, y = _mixed_frame()
    X_train, y_train, X_test = frame.iloc[:130], y[:130], frame.iloc[130:]
    params = {"model_path": reference_checkpoint("clf", "tiny"), "device": "cuda", "recipe": "exact"}
    on_device = TabICLClassifier(**params).fit(X_train, y_train).predict_proba(X_test)
    pinned = []  # per store the call made: whether its memory is page-locked
    real_store = reference_args.host_store

    def host_store(shape, dtype):
        tensor = real_store(shape, dtype)
        pinned.append(tensor.is_pinned())
        return tensor

    monkeypatch.setattr(reference_args, "device_free_bytes", lambda device: 1)
    monkeypatch.setattr(reference_args, "host_store", host_store)
    got = TabICLClassifier(**params).fit(X_train, y_train).predict_proba(X_test)
    assert pinned and not any(pinned)  # "auto" kept the output in pageable host memory
    np.testing.assert_allclose(got, on_device, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["cpu", True, "disk"])
def test_offload_modes_match_the_reference_and_leave_no_files(mode, tmp_path, monkeypatch, request):
    """tabicl's offload_mode: the column stage's output on the host or in a file, streamed back
    in chunks (small chunk budgets here, so that several chunks run), the same answers."""
    from tabserve import clear_model_cache
    from tabserve.models.tabicl.network import embedding, interaction

    monkeypatch.setattr(embedding, "COLUMN_STAGE_MAX_CELLS", 2_000)
    monkeypatch.setattr(interaction, "ROW_STAGE_MAX_TOKENS", 3_000)
    clear_model_cache()  # served models built from here on take the small budgets
    request.addfinalizer(clear_model_cache)
    frame, y = _mixed_frame()
    X_train, y_train, X_test = frame.iloc[:130], y[:130], frame.iloc[130:]
    folder = tmp_path / "offload"
    params = {"offload_mode": mode, "disk_offload_dir": str(folder), "n_estimators": 4}
    ref, ours = _classifiers("tiny", **params)
    expected = ref.fit(X_train, y_train).predict_proba(X_test)
    got = ours.fit(X_train, y_train).predict_proba(X_test)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    on_device = clone(ours).set_params(offload_mode="auto").fit(X_train, y_train)
    np.testing.assert_allclose(got, on_device.predict_proba(X_test), atol=1e-6, rtol=0)
    assert list(folder.glob("*")) == []  # the disk store's files are removed after each call
    X, target = datasets.load_diabetes(return_X_y=True)
    reg = TabICLRegressor(model_path=reference_checkpoint("reg", "tiny"), device="cpu", **params)
    reg.fit(X[:150], target[:150])
    plain = clone(reg).set_params(offload_mode=False).fit(X[:150], target[:150])
    kinds = ["mean", "quantiles"]
    got, want = reg.predict(X[150:200], kinds), plain.predict(X[150:200], kinds)
    for kind in kinds:
        np.testing.assert_allclose(got[kind], want[kind], atol=1e-6 * np.std(target), rtol=0)
