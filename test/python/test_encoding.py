"""TabICLEncoder against tabicl 2.2.0's TransformToNumerical (the reference's categorical step)."""

import io
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from cuda_helpers import requires_cuda
from tabserve.encoding import TabICLEncoder, encode_categoricals, tabicl_columns

TransformToNumerical = pytest.importorskip("tabicl._sklearn.preprocessing").TransformToNumerical


def tabicl_frame(rows: int, seed: int, unseen: bool = False) -> pd.DataFrame:
    """Every dtype family tabicl's selector distinguishes, with missing values of each kind."""
    rng = np.random.default_rng(seed)
    pick = lambda values: [values[i] for i in rng.integers(0, len(values), rows)]  # noqa: E731
    extra = ["new", "日本"] if unseen else []
    return pd.DataFrame(
        {
            "str": pd.Series(pick(["a", "b", "é", None, "long " * 80] + extra), dtype="str"),
            "obj": pd.Series(pick(["x", np.nan, "y", None, "ß"] + extra), dtype=object),
            "cat": pd.Categorical(pick(["u", None, "v", "w"] + extra), categories=["w", "v", "u", *extra, "unused"]),
            "flag": pick([True, False]),  # numpy bool: tabicl drops it
            "boolean": pd.array(pick([True, None, False]), dtype="boolean"),
            "cat_int": pd.Categorical(pick([3, 1, None, 7] + ([9] if unseen else []))),
            "cat_float": pd.Categorical(pick([3.5, 1.0, None])),
            "obj_int": pd.Series(pick([1, 2, None, 5] + ([6] if unseen else [])), dtype=object),
            "obj_bool": pd.Series(pick([True, False, None]), dtype=object),
            "obj_none_only": pd.Series([None] * rows, dtype=object),
            "i": rng.integers(0, 5, rows),
            "f": np.where(rng.random(rows) < 0.2, np.nan, rng.random(rows)),
            "nullable_int": pd.array(pick([1, None, 3]), dtype="Int64"),
            "all_nan": np.full(rows, np.nan),
            "when": pd.to_datetime(["2020-01-01"] * rows),  # dropped
        }
    )


def reference(train: pd.DataFrame, frames) -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transform = TransformToNumerical().fit(train)
        return [transform.transform(frame) for frame in frames]


@pytest.mark.parametrize("seed", range(4))
def test_matches_tabicl_transform_to_numerical(seed):
    train, test = tabicl_frame(80, seed), tabicl_frame(50, seed + 100, unseen=True)
    expected = reference(train, [train, test])
    encoder = TabICLEncoder().fit(train)
    # Which columns are categorical follows pandas' select_dtypes, as in the reference: a numpy
    # bool column is dropped under pandas 3.1 and selected under 3.0 (seen on the H200 machine).
    assert encoder.categorical_names == tabicl_columns(train)[0]
    for frame, want in zip((train, test), expected):
        got = encoder.transform(frame)
        assert got.dtype == torch.float64 and got.shape == want.shape
        np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("seed", range(2))
def test_columns_are_selected_like_scikit_learns_column_selector(seed):
    from sklearn.compose import make_column_selector

    frame = tabicl_frame(30, seed)
    frame[7] = np.arange(30)  # an integer column name
    frame["empty_cat"] = pd.Categorical([None] * 30, categories=["a"])
    for empty in (frame, frame.iloc[:0]):
        want = [
            tuple(map(str, make_column_selector(dtype_include=include)(empty)))
            for include in (["string", "object", "category", "boolean"], "number")
        ]
        assert list(tabicl_columns(empty)) == want


def test_none_in_object_columns_is_a_category_like_scikit_learn():
    train = pd.DataFrame({"o": pd.Series(["b", None, "a", np.nan], dtype=object)})
    test = pd.DataFrame({"o": pd.Series([None, np.nan, "a", "c"], dtype=object)})
    (want,) = reference(train, [test])
    assert want.ravel().tolist() == [2, -1, 0, -1]
    np.testing.assert_array_equal(TabICLEncoder().fit(train).transform(test).numpy(), want)


def test_pd_na_in_string_dtype_is_missing():
    # tabicl 2.2.0 raises here (sklearn cannot sort pd.NA); tabserve treats it as missing.
    frame = pd.DataFrame({"s": pd.array(["b", None, "a"], dtype="string")})
    assert TabICLEncoder().fit(frame).transform(frame).ravel().tolist() == [1, -1, 0]


def test_compiled_matches_eager_and_state_round_trips():
    train = tabicl_frame(80, 0)
    encoder = TabICLEncoder().fit(train)
    compiled = torch.compile(encoder, fullgraph=True, backend="aot_eager")
    buffer = io.BytesIO()
    torch.save(encoder.state_dict(), buffer)
    buffer.seek(0)
    loaded = TabICLEncoder()
    loaded.load_state_dict(torch.load(buffer, weights_only=True))
    for seed in range(3):
        table = encoder.to_table(tabicl_frame(30 + 10 * seed, seed + 7, unseen=True))
        expected = encoder(table)
        assert torch.equal(compiled(table), expected)
        assert torch.equal(loaded(table), expected)


def test_encode_categoricals_and_errors():
    train, test = tabicl_frame(40, 1), tabicl_frame(20, 2, unseen=True)
    train_x, test_x, encoder = encode_categoricals(train, test, dtype=torch.float32)
    want_train, want_test = reference(train, [train, test])
    np.testing.assert_array_equal(train_x.numpy(), want_train.astype(np.float32))
    np.testing.assert_array_equal(test_x.numpy(), want_test.astype(np.float32))
    with pytest.raises(KeyError, match="lacks the fitted columns"):
        encoder.transform(test.drop(columns=["obj"]))
    with pytest.raises(TypeError, match="pandas DataFrame"):
        TabICLEncoder().fit(np.zeros((2, 2)))
    wrong = encoder.to_table(test)
    wrong.numerical_names = ("i", "f", "other", "x")
    with pytest.raises(ValueError, match="numerical columns"):
        encoder(wrong)


@requires_cuda
def test_matches_tabicl_on_cuda():
    train, test = tabicl_frame(80, 3), tabicl_frame(50, 4, unseen=True)
    (want,) = reference(train, [test])
    encoder = TabICLEncoder().fit(train).to("cuda")
    got = encoder.transform(test)
    assert got.device.type == "cuda"
    np.testing.assert_array_equal(got.cpu().numpy(), want)


@pytest.mark.parametrize("seed", range(3))
def test_training_means_are_simple_imputers_bit_for_bit(seed):
    from sklearn.impute import SimpleImputer

    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 300))
    holes = lambda: rng.random(rows) < 0.3  # noqa: E731
    frame = pd.DataFrame(
        {
            "f64": np.where(holes(), np.nan, rng.normal(1e3, 1e4, rows)),
            "f32": np.where(holes(), np.nan, rng.normal(0, 1, rows)).astype(np.float32),
            "u8": rng.integers(0, 255, rows).astype(np.uint8),
            "Int64": pd.array(np.where(holes(), None, rng.integers(-9, 9, rows)), dtype="Int64"),
            "Float32": pd.array(np.where(holes(), None, rng.random(rows)), dtype="Float32"),
            "all_nan": np.full(rows, np.nan),
        }
    )
    for columns in (list(frame.columns), ["f32"], ["f32", "Float32"]):
        want = SimpleImputer(keep_empty_features=True).fit(frame[columns]).statistics_
        got = TabICLEncoder().fit(frame[columns]).numerical_fill.numpy()
        np.testing.assert_array_equal(got, want.astype(np.float64))


def test_an_infinite_training_value_is_refused_like_simple_imputer():
    from sklearn.impute import SimpleImputer

    frame = pd.DataFrame({"s": ["a", "b", "c"], "x": [1.0, np.inf, 2.0]})
    with pytest.raises(ValueError, match="infinity") as want:
        SimpleImputer(keep_empty_features=True).fit(frame[["x"]])
    encoder = TabICLEncoder()
    with pytest.raises(ValueError, match="infinity") as got:
        encoder.fit(frame)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("seed", range(3))
def test_fit_transform_is_tabicls_fit_then_transform(seed):
    """The frame encoded once: tabicl's numbers for the training frame, the state of ``fit``."""
    def with_float32(frame):  # the fill keeps float32's mean
        rows = np.arange(len(frame))
        frame["f32"] = np.where(rows % 3 == 0, np.nan, 0.1 * rows).astype(np.float32)
        return frame

    train = with_float32(tabicl_frame(60 + 10 * seed, seed))
    (want,) = reference(train, [train])
    encoder = TabICLEncoder()
    got = encoder.fit_transform(train)
    np.testing.assert_array_equal(got.numpy(), want)
    fitted = TabICLEncoder().fit(train)
    state, fitted_state = encoder.state_dict(), fitted.state_dict()
    assert state.keys() == fitted_state.keys()
    for key, value in fitted_state.items():
        assert torch.equal(state[key], value) if isinstance(value, torch.Tensor) else state[key] == value
    test = with_float32(tabicl_frame(30, seed + 7, unseen=True))
    assert torch.equal(encoder.transform(test), fitted.transform(test))


def test_a_failed_fit_transform_leaves_the_encoder_as_it_was():
    train = tabicl_frame(40, 5)
    encoder = TabICLEncoder().fit(train)
    before = {k: v.clone() for k, v in encoder.state_dict().items() if isinstance(v, torch.Tensor)}
    names = (encoder.categorical_names, encoder.numerical_names)
    bad = pd.DataFrame({"s": ["a", "b", "c"], "x": [1.0, np.inf, 2.0]})
    with pytest.raises(ValueError, match="infinity"):
        encoder.fit_transform(bad)
    assert (encoder.categorical_names, encoder.numerical_names) == names
    for key, value in before.items():
        assert torch.equal(encoder.state_dict()[key], value)
    torch.testing.assert_close(encoder.transform(train), TabICLEncoder().fit(train).transform(train))


@pytest.mark.parametrize("kind", ["frame", "array"])
def test_the_estimators_table_encoder_fit_transform_is_fit_then_transform(kind):
    """What an estimator's fit encodes: the same tensor as ``fit(X).transform(X)``, bit for bit
    (a frame with a Python-ordered column among the rest; an array with NaN)."""
    import datetime

    from tabserve.models.tabicl.sklearn.preprocessing import TableEncoder

    rng = np.random.default_rng(11)
    if kind == "frame":
        X = tabicl_frame(70, 11)
        X["dates"] = pd.Series(
            [datetime.date(2020, 1, 1 + int(d)) for d in rng.integers(0, 9, len(X))], dtype=object
        )
    else:
        X = np.where(rng.random((70, 6)) < 0.2, np.nan, rng.normal(size=(70, 6))).astype(np.float32)
    encoder = TableEncoder("cpu")
    got = encoder.fit_transform(X)
    want = TableEncoder("cpu").fit(X).transform(X)
    assert got.dtype == want.dtype == torch.float64 and torch.equal(got, want)
    assert torch.equal(encoder.transform(X), want)
