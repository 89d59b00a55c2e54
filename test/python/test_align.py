"""AlignCategories against scikit-learn's OrdinalEncoder and pandas; compile; state_dict."""

import io
import pickle
import subprocess
import sys
from unittest import mock

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
from cuda_helpers import requires_cuda
from sklearn.preprocessing import OrdinalEncoder
from tabserve.align import AlignCategories, CategoryTypeError, NotFittedError, _sizes_dynamic
from tabserve.tables import CategoricalColumn, Table, mark_dynamic
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda])]

LONG = "long label " * 60  # 660 bytes


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with Dynamo's caches empty, as a fresh serving process does: compiled
    entries of AlignCategories.forward from earlier tests would otherwise count towards the
    recompile limit of the next (seen on the H200, where the CUDA tests run after the CPU ones)."""
    torch._dynamo.reset()
    yield


def label_pool(rng, size: int) -> list:
    """Distinct labels: ASCII, non-ASCII, empty, long, and long ones differing only inside."""
    special = ["", "é", "日本語", "ß", "🙂x", "a\x00b", LONG + "1", LONG + "2", "Z", "z"]
    labels = [f"{rng.choice(['red', 'blue', 'grün', 'x'])}{i}" for i in range(size)]
    labels[: min(size, len(special))] = special[: min(size, len(special))]
    return labels


def random_frames(seed: int, columns: int = 12, train_rows: int = 300, test_rows: int = 150):
    """Train and test frames of object columns (NaN = missing, as scikit-learn expects), with
    unseen test labels, a column that is all missing in train, one all missing in test."""
    rng = np.random.default_rng(seed)
    train, test = {}, {}
    for j in range(columns):
        pool = label_pool(rng, int(rng.integers(1, 60)))
        seen = pool[: max(1, int(len(pool) * 0.7))]
        null_rate = [0.0, 0.1, 0.5][j % 3]

        def draw(values, rows, empty=False):
            picked = np.array(values, dtype=object)[rng.integers(0, len(values), rows)]
            picked[rng.random(rows) < (1.0 if empty else null_rate)] = np.nan
            return pd.Series(picked, dtype=object)

        train[f"c{j}"] = draw(seen, train_rows, empty=(j == 1))
        test[f"c{j}"] = draw(pool, test_rows, empty=(j == 2))
    return pd.DataFrame(train), pd.DataFrame(test)


def ordinal_reference(train: pd.DataFrame, test: pd.DataFrame) -> np.ndarray:
    encoder = OrdinalEncoder(
        dtype=np.int64, handle_unknown="use_encoded_value", unknown_value=-1, encoded_missing_value=-1
    )
    return encoder.fit(train).transform(test)


def appearance_reference(train: pd.DataFrame, test: pd.DataFrame) -> np.ndarray:
    columns = []
    for c in train.columns:
        codes = {label: i for i, label in enumerate(pd.unique(train[c].dropna()))}
        columns.append([codes.get(v, -1) if isinstance(v, str) else -1 for v in test[c]])
    return np.array(columns, dtype=np.int64).T


@pytest.mark.parametrize("seed", range(6))
def test_value_order_matches_ordinal_encoder(seed):
    train, test = random_frames(seed)
    align = AlignCategories().fit(Table.from_pandas(train))
    for frame in (train, test):
        codes = align(Table.from_pandas(frame))
        assert codes.dtype == torch.int64
        np.testing.assert_array_equal(codes.numpy(), ordinal_reference(train, frame))


@pytest.mark.parametrize("seed", range(3))
def test_appearance_order_matches_pandas(seed):
    train, test = random_frames(100 + seed)
    align = AlignCategories(sort_by="appearance").fit(Table.from_pandas(train))
    np.testing.assert_array_equal(align(Table.from_pandas(test)).numpy(), appearance_reference(train, test))
    assert align.categories("c0") == list(pd.unique(train["c0"].dropna()))


def test_numeric_categories_match_ordinal_encoder():
    rng = np.random.default_rng(7)

    def frame(rows, ints, floats):
        f = rng.choice(floats, rows)
        f[rng.random(rows) < 0.2] = np.nan
        return pd.DataFrame(
            {
                "cat_int": pd.Categorical(rng.choice(ints, rows)),
                "int": rng.choice(ints, rows),
                "float": f,
                "boolean": pd.array(rng.choice([True, False], rows), dtype="boolean"),
            }
        )

    train = frame(200, [-5, 0, 3, 2**40, 7], [-0.0, 0.25, -1e300, 3.5, 1e-300])
    test = frame(100, [-5, 1, 3, 2**40 + 1, 8], [0.0, 0.25, 2.0, 3.5, 1e-300])
    table = lambda f: Table.from_pandas(f, categorical=["int", "float"])  # noqa: E731
    align = AlignCategories().fit(table(train))
    assert align.column_kinds == ("integer", "integer", "float", "integer")
    reference = ordinal_reference(train.astype({"boolean": object}), test.astype({"boolean": object}))
    np.testing.assert_array_equal(align(table(test)).numpy(), reference)


def test_numeric_kinds_align_with_each_other():
    fitted_ints = AlignCategories().fit(Table.from_pandas(pd.DataFrame({"a": [3, 1, 2]}), categorical=["a"]))
    query = lambda values: Table.from_pandas(pd.DataFrame({"a": values}), categorical=["a"])  # noqa: E731
    assert fitted_ints(query([1.0, 2.5, np.nan, 3.0, -0.0])).flatten().tolist() == [0, -1, -1, 2, -1]
    assert fitted_ints(query([True, False])).flatten().tolist() == [0, -1]
    fitted_floats = AlignCategories().fit(Table.from_pandas(pd.DataFrame({"a": [0.0, 1.5]}), categorical=["a"]))
    assert fitted_floats(query([0, 1, 2])).flatten().tolist() == [0, -1, -1]
    assert fitted_floats(query([-0.0, 1.5, np.nan])).flatten().tolist() == [0, 1, -1]


def test_duplicate_labels_in_batch_vocabulary():
    align = AlignCategories().fit(Table.from_pandas(pd.DataFrame({"s": ["b", "a", "b", "c"]})))
    dictionary = pa.array(["c", "a", "c", "zz", "a", None])
    codes = pa.array([0, 1, 2, 3, 4, None, 5], pa.int8())
    column = CategoricalColumn.from_arrow(pa.DictionaryArray.from_arrays(codes, dictionary))
    table = Table(torch.zeros(7, 0), [column], [], ["s"])
    assert align(table).flatten().tolist() == [2, 0, 2, -1, 0, -1, -1]


def test_duplicate_labels_at_fit_count_once():
    dictionary = pa.array(["b", "a", "b"])
    column = CategoricalColumn.from_arrow(pa.DictionaryArray.from_arrays(pa.array([0, 1, 2, 1]), dictionary))
    align = AlignCategories().fit(Table(torch.zeros(4, 0), [column], [], ["s"]))
    assert align.categories("s") == ["a", "b"]
    assert align(Table(torch.zeros(4, 0), [column], [], ["s"])).flatten().tolist() == [1, 0, 1, 0]


def test_empty_vocabularies_and_zero_rows():
    train = pd.DataFrame({"empty": pd.Series([None] * 5, dtype=object), "s": list("abcab")})
    align = AlignCategories().fit(Table.from_pandas(train))
    assert align.categories("empty") == []
    test = pd.DataFrame({"empty": ["a", None, "x"], "s": pd.Series([None] * 3, dtype=object)})
    assert align(Table.from_pandas(test)).tolist() == [[-1, -1]] * 3
    assert align(Table.from_pandas(test.iloc[:0])).shape == (0, 2)


def test_fits_selected_columns_and_ignores_extra_ones():
    train, test = random_frames(1, columns=4)
    align = AlignCategories().fit(Table.from_pandas(train), columns=["c3", "c0"])
    codes = align(Table.from_pandas(test))
    np.testing.assert_array_equal(codes.numpy(), ordinal_reference(train[["c3", "c0"]], test[["c3", "c0"]]))
    assert AlignCategories().fit(Table.from_pandas(train), columns=[])(Table.from_pandas(test)).shape == (150, 0)


# -- errors ---------------------------------------------------------------------------------------


def _string_and_int_tables():
    strings = Table.from_pandas(pd.DataFrame({"a": ["x", "y"]}))
    ints = Table.from_pandas(pd.DataFrame({"a": [1, 2]}), categorical=["a"])
    return strings, ints


def _error_of(fn, table):
    with pytest.raises(Exception) as info:
        fn(table)
    return type(info.value), str(info.value)


def test_type_mismatch_raises_the_same_error_eager_and_compiled():
    """The seed's silent-(-1) trap: compiled code must raise exactly what eager code raises."""
    strings, ints = _string_and_int_tables()
    for fitted, other in ((strings, ints), (ints, strings)):
        align = AlignCategories().fit(fitted)
        compiled = torch.compile(align, fullgraph=True, backend="aot_eager")
        eager_error = _error_of(align, other)
        assert eager_error[0] is CategoryTypeError and "column 'a' holds" in eager_error[1]
        assert _error_of(compiled, other) == eager_error
        assert torch.equal(compiled(fitted), align(fitted))  # the right type still works


def test_structural_errors_are_the_same_eager_and_compiled():
    strings, _ = _string_and_int_tables()
    unfitted = AlignCategories()
    fitted = AlignCategories().fit(strings)
    other_name = Table.from_pandas(pd.DataFrame({"b": ["x"]}))
    for module, table, error, match in (
        (unfitted, strings, NotFittedError, "not fitted"),
        (fitted, other_name, ValueError, "no categorical column 'a'"),
    ):
        eager_error = _error_of(module, table)
        assert eager_error[0] is error and match in eager_error[1]
        assert _error_of(torch.compile(module, fullgraph=True, backend="aot_eager"), table) == eager_error


def test_fit_rejects_bad_input():
    strings, _ = _string_and_int_tables()
    with pytest.raises(ValueError, match="sort_by must be one of"):
        AlignCategories(sort_by="frequency")
    with pytest.raises(ValueError, match="sort_by must be one of"):
        AlignCategories().fit(strings, sort_by="random")
    with pytest.raises(TypeError, match="must be a tabserve Table"):
        AlignCategories().fit(pd.DataFrame({"a": ["x"]}))
    with pytest.raises(KeyError, match="no categorical column 'zz'"):
        AlignCategories().fit(strings, columns=["zz"])
    with pytest.raises(KeyError, match="no fitted column"):
        AlignCategories().fit(strings).categories("zz")


# -- state -----------------------------------------------------------------------------------------


def _round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_dict_round_trip_rebuilds_the_index():
    train, test = random_frames(3, columns=5)
    align = AlignCategories(sort_by="appearance").fit(Table.from_pandas(train))
    state = _round_trip(align.state_dict())
    assert "slot_hash" not in state and "slot_row" not in state  # non-persistent, rebuilt
    assert {"vocabulary_data", "vocabulary_offsets", "vocabulary_segments", "_extra_state"} <= set(state)
    fresh = AlignCategories()
    fresh.load_state_dict(state)
    assert fresh.sort_by == "appearance" and fresh.column_names == align.column_names
    table = Table.from_pandas(test)
    assert torch.equal(fresh(table), align(table))
    # Loading into a module fitted on other columns replaces its state and index too.
    other = AlignCategories().fit(Table.from_pandas(random_frames(9, columns=2)[0]))
    other.load_state_dict(state)
    assert torch.equal(other(table), align(table))


def test_load_state_dict_into_a_module_constructed_under_compilation():
    """The seed's trap: a module built while compiling lacked its index after load_state_dict."""
    train, test = random_frames(4, columns=3)
    align = AlignCategories().fit(Table.from_pandas(train))
    with mock.patch("torch.compiler.is_compiling", return_value=True):
        built_while_compiling = AlignCategories()
    built_by_compiled_code = torch.compile(lambda: AlignCategories(), backend="eager")()
    table = Table.from_pandas(test)
    for module in (built_while_compiling, built_by_compiled_code):
        module.load_state_dict(align.state_dict())
        assert module.slot_hash.numel() > 0
        assert torch.equal(module(table), align(table))


def test_load_state_dict_reports_bad_state():
    align = AlignCategories().fit(Table.from_pandas(random_frames(5, columns=2)[0]))
    state = align.state_dict()
    with pytest.raises(RuntimeError, match="Missing key"):
        AlignCategories().load_state_dict({k: v for k, v in state.items() if k != "vocabulary_data"})
    broken = dict(state, vocabulary_segments=torch.zeros(5, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="names 2 columns"):
        AlignCategories().load_state_dict(broken)
    with pytest.raises(ValueError, match="unsupported AlignCategories state"):
        AlignCategories().set_extra_state({"version": 99})


@requires_cuda
def test_state_dict_moves_between_devices():
    train, test = random_frames(6, columns=6)
    on_cpu = AlignCategories().fit(Table.from_pandas(train))
    expected = on_cpu(Table.from_pandas(test))
    on_gpu = AlignCategories().to("cuda")
    on_gpu.load_state_dict(on_cpu.state_dict())
    assert on_gpu.slot_hash.device.type == "cuda"
    assert torch.equal(on_gpu(Table.from_pandas(test, device="cuda")).cpu(), expected)
    fitted_on_gpu = AlignCategories().to("cuda").fit(Table.from_pandas(train, device="cuda"))
    back = AlignCategories()
    back.load_state_dict(fitted_on_gpu.state_dict())
    assert torch.equal(back(Table.from_pandas(test)), expected)
    assert torch.equal(on_cpu.to("cuda")(Table.from_pandas(test, device="cuda")).cpu(), expected)


# -- compile ---------------------------------------------------------------------------------------


def _compile_batches(count: int = 35):
    """Batches whose rows and every column's vocabulary size (and bytes) differ pairwise:
    categories include unused ones so sizes are exactly as planned."""
    rng = np.random.default_rng(11)
    pool = label_pool(rng, 120)
    train = pd.DataFrame(
        {
            "s0": rng.choice(pool[:50], 400),
            "s1": rng.choice(pool[20:90], 400),
            "i": rng.integers(0, 40, 400),
            "f": rng.integers(0, 30, 400) / 4,
            "empty": pd.Series([None] * 400, dtype=object),
        }
    ).astype({"s0": object, "s1": object})
    batches = []
    for b in range(count):
        rows, k = 10 + 5 * b, 3 + 2 * b
        frame = pd.DataFrame(
            {
                "s0": pd.Categorical(rng.choice(pool[:k], rows), categories=pool[:k]),
                "s1": pd.Categorical(rng.choice(pool[5 : 5 + k], rows), categories=pool[5 : 5 + k]),
                "i": pd.Categorical(rng.integers(0, k, rows), categories=range(k)),
                "f": pd.Categorical(rng.integers(0, k, rows) / 4, categories=np.arange(k) / 4),
                "empty": pd.Categorical(rng.choice(pool[60 : 60 + k], rows), categories=pool[60 : 60 + k]),
            }
        )
        frame.loc[rng.random(rows) < 0.1, "s0"] = np.nan
        batches.append(frame)
    return train, batches


def _with_numeric_categories(frame: pd.DataFrame) -> Table:
    return Table.from_pandas(frame, categorical=["i", "f"])


def _fitted_and_compiled(train: pd.DataFrame):
    """AlignCategories fitted on ``train``, compiled whole with a counting inductor backend
    (Dynamo's counters cleared): (module, compiled module, counter)."""
    align = AlignCategories().fit(_with_numeric_categories(train))
    counter = CompileCounterWithBackend("inductor")
    counters.clear()
    return align, torch.compile(align, fullgraph=True, backend=counter), counter


def test_compiled_one_graph_over_35_batches_matches_eager_and_sklearn():
    train, batches = _compile_batches()
    table = _with_numeric_categories
    align, compiled, counter = _fitted_and_compiled(train)
    as_object = lambda f: f.astype(object).where(f.notna(), np.nan)  # noqa: E731
    for frame in batches:
        batch = table(frame)
        got = compiled(batch)
        assert torch.equal(got, align(batch))
        np.testing.assert_array_equal(got.numpy(), ordinal_reference(as_object(train), as_object(frame)))
    assert counter.frame_count <= 2  # the static first graph, then one dynamic graph
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == counter.frame_count


@requires_cuda
def test_compiled_on_cuda_matches_eager():
    train, batches = _compile_batches(8)
    align = AlignCategories().to("cuda").fit(Table.from_pandas(train, categorical=["i", "f"], device="cuda"))
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(align, fullgraph=True, backend=counter)
    for frame in batches:
        batch = Table.from_pandas(frame, categorical=["i", "f"], device="cuda")
        assert torch.equal(compiled(batch), align(batch))
    assert counter.frame_count <= 2


#: (rows, categories per column) of a stream of batches: the second batch changes only the row
#: count, so vocabulary sizes Dynamo saw constant then change later; then one row, one
#: category per column and empty vocabularies (sizes Dynamo specialises unless marked).
SIZE_STREAM = ((12, 4), (20, 4), (33, 9), (7, 13), (1, 2), (25, 1), (16, 0), (40, 6))


def _size_stream_batches():
    rng = np.random.default_rng(23)
    pool = label_pool(rng, 40)
    rows = 200
    train = pd.DataFrame(
        {
            "s": pd.Series(rng.choice(pool[:30], rows), dtype=object),
            "i": rng.integers(0, 10, rows),
            "f": rng.integers(0, 10, rows) / 4,
        }
    )
    batches = []
    for rows, k in SIZE_STREAM:
        picks = rng.integers(0, max(k, 1), rows).astype(float)
        picks[(rng.random(rows) < 0.2) | (k == 0)] = np.nan  # every row null without categories

        def column(categories):
            values = [np.nan if np.isnan(p) else categories[int(p)] for p in picks]
            return pd.Categorical(values, categories=categories)

        batches.append(
            pd.DataFrame(
                {
                    "s": column(pd.Index(pool[3 : 3 + k], dtype=object)),
                    "i": column(pd.Index(np.arange(k, dtype=np.int64) + 2)),
                    "f": column(pd.Index(np.arange(k, dtype=np.float64) / 4)),
                }
            )
        )
    return train, batches


def test_compiled_recompiles_at_most_once_over_changing_vocabulary_sizes():
    # No mark_dynamic and no dynamic=True: the module keeps the batch sizes dynamic itself.
    train, batches = _size_stream_batches()
    align, compiled, counter = _fitted_and_compiled(train)
    sizes = set()
    first = _with_numeric_categories(batches[0])
    align(first)
    assert _sizes_dynamic(align, (first,)) is None  # eager use: nothing traced, nothing marked
    for frame in batches:
        batch = _with_numeric_categories(frame)
        sizes.add((batch.codes.shape[0], batch.columns[0].categories.data.shape[0]))
        assert torch.equal(compiled(batch), align(batch))
        # Marked once, at the call after the static graph's: the dynamic graph serves the rest.
        assert align._traced and align._sizes_marked == (len(sizes) > 1)
        tensors = [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
        assert not any(hasattr(t, "_dynamo_unbacked_indices") for t in tensors)  # marks on aliases
    assert len(sizes) == len(SIZE_STREAM)  # rows and label bytes differ from batch to batch
    assert counter.frame_count <= 2  # at most one recompile
    assert not counters["graph_break"]
    assert _sizes_dynamic(align, (batch,)) is None  # the dynamic graph serves: the hook stops


def test_compiled_graph_takes_the_codes_matrix_not_a_codes_tensor_per_column():
    # Every tensor a compiled function takes costs a guard and a size read per call: the graph
    # reads the table's one codes matrix, never a column's own codes.
    train, batches = _compile_batches(count=2)
    table = lambda f: Table.from_pandas(f, categorical=["i", "f"])
    align = AlignCategories().fit(table(train))
    inputs = []

    def backend(gm, example_inputs):
        inputs.extend(n.name for n in gm.graph.nodes if n.op == "placeholder")
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(align, fullgraph=True, backend=backend)
    for frame in batches:
        batch = mark_dynamic(table(frame))
        assert torch.equal(compiled(batch), align(batch))
    codes_inputs = {name for name in inputs if "codes" in name}
    assert codes_inputs == {"l_table_codes"}, inputs


def test_a_state_that_fails_to_load_leaves_the_module_as_it_was():
    train, test = random_frames(7, columns=3)
    fitted = AlignCategories().fit(Table.from_pandas(train))
    table = Table.from_pandas(test)
    expected = fitted(table)
    other = AlignCategories().fit(Table.from_pandas(random_frames(8, columns=3)[0])).state_dict()
    offsets = other["vocabulary_offsets"].clone()
    offsets[1] = offsets[-1] + 5  # past the data: the index build refuses it
    too_many = dict(other, vocabulary_segments=torch.zeros(9, dtype=torch.int64))
    for bad, error, match in (
        (dict(other, vocabulary_offsets=offsets), RuntimeError, "offsets"),
        (too_many, RuntimeError, "names 3 columns"),
    ):
        with pytest.raises(error, match=match):
            fitted.load_state_dict(bad)
        assert torch.equal(fitted(table), expected)
        assert fitted.column_names == tuple(train.columns)


def test_a_pickled_module_aligns_the_same_in_a_fresh_process(tmp_path):
    frame = pd.DataFrame({"s": ["b", "a", None, "c"], "i": [3, 1, 2, 3]})
    align = AlignCategories().fit(Table.from_pandas(frame, categorical=["s", "i"]))
    batch = pd.DataFrame({"s": ["c", "z", "a"], "i": [2, 9, 3]})
    (tmp_path / "align.pkl").write_bytes(pickle.dumps(align))
    code = f"""
import pickle, sys, pandas as pd
from tabserve.tables import Table
align = pickle.loads(open({str(tmp_path / "align.pkl")!r}, "rb").read())
batch = pd.DataFrame({{"s": ["c", "z", "a"], "i": [2, 9, 3]}})
print(align(Table.from_pandas(batch, categorical=["s", "i"])).tolist())
print(len(align._forward_pre_hooks))
"""
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300, check=False)
    assert child.returncode == 0, child.stderr[-2000:]
    expected = align(Table.from_pandas(batch, categorical=["s", "i"])).tolist()
    assert expected == [[2, 1], [-1, -1], [0, 2]]  # value order: a b c; 1 2 3
    assert child.stdout.split("\n")[:2] == [str(expected), "1"]
