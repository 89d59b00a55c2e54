"""CategoricalColumn and Table: factories against pandas / Arrow, layout, pytree, compile."""

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
import torch.utils._pytree as pytree
from cuda_helpers import requires_cuda
from tabserve.strings import StringColumn
from tabserve.tables import CategoricalColumn, Table, category_kind, mark_dynamic
from torch._dynamo.testing import CompileCounterWithBackend

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda])]


def mixed_frame(rows: int = 7) -> pd.DataFrame:
    pick = lambda values: [values[i % len(values)] for i in range(rows)]  # noqa: E731
    return pd.DataFrame(
        {
            "str": pd.Series(pick(["a", "b", None, "é", "a"]), dtype="str"),
            "obj": pd.Series(pick(["x", np.nan, "日本語", None]), dtype=object),
            "cat": pd.Categorical(pick(["u", None, "v"]), categories=["w", "v", "u"]),
            "nullable": pd.array(pick(["q", None, "r"]), dtype="string"),
            "flag": pick([True, False]),
            "boolean": pd.array(pick([True, None, False]), dtype="boolean"),
            "cat_int": pd.Categorical(pick([3, 1, None])),
            "x": np.arange(rows, dtype=np.float64),
            "n": pd.array(pick([1, None, 3]), dtype="Int64"),
        }
    )


def expected_values(series: pd.Series) -> list:
    return [None if pd.isna(v) else (bool(v) if isinstance(v, (bool, np.bool_)) else v) for v in series]


# -- CategoricalColumn ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["str", "obj", "cat", "nullable", "flag", "boolean", "cat_int"])
def test_from_pandas_round_trips_values(name):
    series = mixed_frame()[name]
    column = CategoricalColumn.from_pandas(series)
    assert column.codes.dtype == torch.int64
    assert column.to_pylist() == expected_values(series)


def test_from_pandas_category_keeps_pandas_codes_and_categories():
    series = mixed_frame()["cat"]
    column = CategoricalColumn.from_pandas(series)
    assert column.codes.tolist() == series.cat.codes.tolist()
    assert column.categories.to_pylist() == ["w", "v", "u"]


def test_normalised_dtypes_keep_batches_structurally_equal():
    # pandas picks int8 or int16 codes by vocabulary size; tabserve always gives int64.
    small = CategoricalColumn.from_pandas(pd.Series(pd.Categorical(["a", "b"])))
    large = CategoricalColumn.from_pandas(pd.Series(pd.Categorical([f"v{i}" for i in range(300)])))
    assert small.codes.dtype == large.codes.dtype == torch.int64
    ints = [CategoricalColumn.from_pandas(pd.Series(v)) for v in ([1, 2], np.array([1, 2], np.int8))]
    assert {c.categories.dtype for c in ints} == {torch.int64}
    floats = CategoricalColumn.from_pandas(pd.Series([1.5, np.nan], dtype=np.float32))
    assert floats.categories.dtype == torch.float64 and floats.codes.tolist() == [0, -1]


def test_kinds():
    frame = mixed_frame()
    assert CategoricalColumn.from_pandas(frame["str"]).kind == "string"
    assert CategoricalColumn.from_pandas(frame["boolean"]).kind == "integer"
    assert CategoricalColumn.from_pandas(frame["cat_int"]).kind == "integer"
    assert CategoricalColumn.from_pandas(pd.Series([0.5, 1.5])).kind == "float"
    with pytest.raises(TypeError, match="categories must be"):
        category_kind([1, 2])


def test_from_arrow_dictionary_with_null_entries_and_duplicates():
    dictionary = pa.array(["a", None, "b", "a"])
    array = pa.DictionaryArray.from_arrays(pa.array([0, 1, None, 2, 3], pa.int32()), dictionary)
    column = CategoricalColumn.from_arrow(array)
    assert column.codes.tolist() == [0, -1, -1, 2, 3]
    assert column.categories.valid is None  # never referenced null entries: no mask needed
    assert column.to_pylist() == ["a", None, None, "b", "a"]


def test_from_arrow_nan_float_dictionary_entries_become_null():
    array = pa.DictionaryArray.from_arrays(pa.array([0, 1, 2]), pa.array([1.5, float("nan"), 2.0]))
    assert CategoricalColumn.from_arrow(array).codes.tolist() == [0, -1, 2]


def test_from_arrow_chunked_unifies_dictionaries():
    chunks = pa.chunked_array(
        [pa.array(["a", "b"]).dictionary_encode(), pa.array(["c", "a", None]).dictionary_encode()]
    )
    assert CategoricalColumn.from_arrow(chunks).to_pylist() == ["a", "b", "c", "a", None]


def test_from_arrow_plain_arrays_are_encoded():
    assert CategoricalColumn.from_arrow(pa.array(["x", None, "x"])).codes.tolist() == [0, -1, 0]
    assert CategoricalColumn.from_arrow(pa.array([None, None])).to_pylist() == [None, None]
    assert len(CategoricalColumn.from_arrow(pa.array([None, None])).categories) == 0
    with pytest.raises(TypeError, match="cannot dictionary-encode"):
        CategoricalColumn.from_arrow(pa.array([[1], [2]]))


def test_from_pandas_rejects_mixed_types():
    with pytest.raises(TypeError, match="'m'.*cannot be dictionary-encoded"):
        CategoricalColumn.from_pandas(pd.Series(["a", 1], dtype=object, name="m"))


@pytest.mark.parametrize(
    "codes, categories, error, match",
    [
        (torch.tensor([0.0]), torch.tensor([1]), TypeError, "codes must be"),
        (torch.tensor([[0]]), torch.tensor([1]), TypeError, "codes must be"),
        (torch.tensor([0, 2]), torch.tensor([1, 2]), ValueError, r"codes must lie in \[-1, 2\)"),
        (torch.tensor([-2]), torch.tensor([1]), ValueError, "codes must lie"),
        (torch.tensor([0]), torch.tensor([[1]]), TypeError, "categories must be 1-D"),
        (torch.tensor([0]), ["a"], TypeError, "categories must be a StringColumn"),
        (torch.tensor([0]), torch.tensor([1j]), TypeError, "categories must be"),
    ],
)
def test_categorical_column_rejects_malformed_input(codes, categories, error, match):
    with pytest.raises(error, match=match):
        CategoricalColumn(codes, categories)


def test_categorical_column_rejects_mixed_devices():
    with pytest.raises(ValueError, match="categories are on meta"):
        CategoricalColumn(torch.tensor([0]), torch.tensor([1], device="meta"))


# -- Table ----------------------------------------------------------------------------------------


def test_table_from_pandas_splits_and_names_columns():
    frame = mixed_frame()
    table = Table.from_pandas(frame)
    assert table.categorical_names == ("str", "obj", "cat", "nullable", "flag", "boolean", "cat_int")
    assert table.numerical_names == ("x", "n")
    assert table.numerical.dtype == torch.float32 and table.numerical.shape == (7, 2)
    assert torch.isnan(table.numerical[1, 1]) and table.numerical[2, 1] == 3
    assert table.names == table.categorical_names + table.numerical_names
    assert table.column("obj").to_pylist() == expected_values(frame["obj"])
    assert table.column("x").tolist() == list(range(7))
    with pytest.raises(KeyError, match="no column 'zz'"):
        table.column("zz")


def test_table_from_pandas_options_and_errors():
    frame = pd.DataFrame({"a": [1, 2], "b": [0.5, 0.25]})
    table = Table.from_pandas(frame, categorical=["a"], numerical_dtype=torch.float64)
    assert table.categorical_names == ("a",) and table.numerical.dtype == torch.float64
    assert Table.from_pandas(frame[[]]).numerical.shape == (2, 0)
    with pytest.raises(TypeError, match="'d' has dtype datetime"):
        Table.from_pandas(pd.DataFrame({"d": pd.to_datetime(["2020-01-01"])}))
    with pytest.raises(ValueError, match="do not exist"):
        Table.from_pandas(frame, categorical=["zz"])
    with pytest.raises(ValueError, match="duplicate"):
        Table.from_pandas(pd.DataFrame([[1, 2]], columns=["a", "a"]))
    with pytest.raises(TypeError, match="floating dtype"):
        Table.from_pandas(frame, numerical_dtype=torch.int64)


def test_table_from_arrow_matches_from_pandas():
    frame = mixed_frame()[["str", "obj", "cat", "boolean", "x"]]
    from_arrow = Table.from_arrow(pa.Table.from_pandas(frame, preserve_index=False))
    from_pandas = Table.from_pandas(frame)
    assert from_arrow.names == from_pandas.names
    for name in from_pandas.categorical_names:
        assert from_arrow.column(name).to_pylist() == from_pandas.column(name).to_pylist()
    torch.testing.assert_close(from_arrow.numerical, from_pandas.numerical, equal_nan=True)
    with pytest.raises(TypeError, match="neither categorical nor numerical"):
        Table.from_arrow(pa.table({"l": pa.array([[1]])}))


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda c: Table(torch.zeros(2, 1, dtype=torch.int64), [], ["x"], []), TypeError, "2-D float"),
        (lambda c: Table(torch.zeros(2, 1), [], [], []), ValueError, "numerical_names holds 0"),
        (lambda c: Table(torch.zeros(2, 0), [c], [], []), ValueError, "categorical_names holds 0"),
        (lambda c: Table(torch.zeros(3, 0), [c], [], ["a"]), ValueError, "has 2 rows"),
        (lambda c: Table(torch.zeros(2, 1), [c], ["a"], ["a"]), ValueError, "unique"),
        (lambda c: Table(torch.zeros(2, 0), [torch.zeros(2)], [], ["a"]), TypeError, "CategoricalColumn"),
    ],
)
def test_table_rejects_malformed_input(build, error, match):
    column = CategoricalColumn.from_pylist(["a", "b"])
    with pytest.raises(error, match=match):
        build(column)


def _owns_storage(tensor) -> bool:
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("device", DEVICES)
def test_every_vocabulary_owns_its_storage(device):
    """The seed's recompile trap: vocabularies as views into one shared buffer."""
    frame = mixed_frame(50)
    sliced = pa.Table.from_pandas(frame[["str", "obj"]], preserve_index=False).slice(3, 40)
    for table in (Table.from_pandas(frame, device=device), Table.from_arrow(sliced, device=device)):
        for column in table.columns:
            tensors = [column.codes]
            if isinstance(column.categories, StringColumn):
                tensors += [column.categories.data, column.categories.offsets]
            else:
                tensors.append(column.categories)
            assert all(t.device.type == device and _owns_storage(t) for t in tensors if t.numel())


def test_pytree_flatten_round_trip():
    table = Table.from_pandas(mixed_frame())
    leaves, spec = pytree.tree_flatten(table)
    assert all(leaf is None or isinstance(leaf, torch.Tensor) for leaf in leaves)  # None: no mask
    rebuilt = pytree.tree_unflatten([None if x is None else x.clone() for x in leaves], spec)
    assert isinstance(rebuilt, Table) and rebuilt.names == table.names
    for name in table.categorical_names:
        assert rebuilt.column(name).to_pylist() == table.column(name).to_pylist()
    # The category kind is structure: string and numeric categories flatten differently.
    strings = pytree.tree_structure(CategoricalColumn.from_pylist(["a"]))
    numbers = pytree.tree_structure(CategoricalColumn.from_pylist([1]))
    assert strings != numbers


def _batch(rows: int, vocabulary: int, seed: int) -> Table:
    """Every category appears, so vocabulary sizes (and bytes) are exactly as asked."""
    rng = np.random.default_rng(seed)
    values = rng.permutation(np.arange(rows) % max(vocabulary, 1))
    frame = pd.DataFrame(
        {
            "s": pd.Series([f"label{v}" for v in values], dtype=object),
            "i": pd.Categorical(values, categories=range(vocabulary + 3)),
            "x": rng.random(rows),
        }
    )
    return Table.from_pandas(frame)


def _summary(table: Table) -> torch.Tensor:
    s = table.column("s")
    return s.codes.sum() + s.categories.data.sum() + table.column("i").categories.sum() + table.numerical.sum()


def test_table_is_a_compiled_input_without_recompiles():
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(_summary, fullgraph=True, backend=counter)
    for b in range(12):
        table = _batch(rows=20 + 3 * b, vocabulary=4 + b, seed=b)
        torch.testing.assert_close(compiled(table), _summary(table))
    assert counter.frame_count <= 2  # static first graph, then one dynamic graph


def test_mark_dynamic_gives_one_graph_for_sizes_zero_and_one():
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(_summary, fullgraph=True, backend=counter)
    for rows, vocabulary in [(30, 5), (1, 1), (0, 1), (17, 9), (2, 1)]:
        table = mark_dynamic(_batch(rows, vocabulary, seed=rows))
        torch.testing.assert_close(compiled(table), _summary(table))
    assert counter.frame_count == 1


@requires_cuda
def test_from_pandas_to_cuda_and_back():
    frame = mixed_frame()
    table = Table.from_pandas(frame, device="cuda")
    assert table.device.type == "cuda" and all(c.device.type == "cuda" for c in table.columns)
    back = table.to("cpu")
    for name in table.categorical_names:
        assert back.column(name).to_pylist() == expected_values(frame[name])


def test_codes_matrix_holds_every_column_side_by_side():
    frame = mixed_frame()
    for table in (
        Table.from_pandas(frame),
        Table.from_arrow(pa.Table.from_pandas(frame, preserve_index=False)),
    ):
        n_cat = len(table.columns)
        assert table.codes.shape == (table.rows, n_cat) and table.codes.dtype == torch.int64
        assert _owns_storage(table.codes)
        for j, column in enumerate(table.columns):
            assert torch.equal(table.codes[:, j], column.codes.long())
        moved = table.to("cpu")
        assert torch.equal(moved.codes, table.codes)
        leaves, spec = pytree.tree_flatten(table)
        rebuilt = pytree.tree_unflatten(leaves, spec)
        assert rebuilt.codes is table.codes
    # The constructor derives it from the columns (int32 codes widen to int64).
    columns = (
        CategoricalColumn(torch.tensor([1, -1, 0], dtype=torch.int32), torch.tensor([5, 7])),
        CategoricalColumn.from_pylist(["x", None, "y"]),
    )
    table = Table(torch.zeros(3, 0), columns, (), ("a", "b"))
    assert table.codes.tolist() == [[1, 0], [-1, -1], [0, 1]]
    # No categorical column: [rows, 0].
    numeric = Table(torch.zeros(4, 2), (), ("p", "q"), ())
    assert numeric.codes.shape == (4, 0) and numeric.codes.dtype == torch.int64
