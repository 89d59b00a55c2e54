"""tabserve on Ray (``tabserve.ray``), on a local Ray instance of 2 CPUs: a dataset's predictions
equal the estimator's own (exact recipe, within 1e-6) and come back with their ids, in the
input's order; a many-tables job answers as ``fit_predict_many`` does, a refused task in its
slot; a worker killed in the middle of a job is restarted and its work run again, no row lost
or repeated; tabserve imports without Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tomllib

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from ray_faults import ExitOnceClassifier
from tabicl_helpers import reference_checkpoint
from tabserve.models.tabicl import TabICLClassifier, TabICLRegressor
from tabserve.ray import (
    ROW_ID,
    TaskFailure,
    fit_predict_many_dataset,
    predict_dataset,
    to_pandas_in_order,
)

ROOT = Path(__file__).resolve().parents[2]
#: The exact recipe on the CPU: a batch's answers against one call's.
EXACT = 1e-6
#: Two workers on the 2-CPU instance, with a CPU left for Ray Data's reads and numbering.
TWO_WORKERS = {"num_workers": 2, "num_cpus_per_worker": 0.5}


@pytest.fixture(scope="module", autouse=True)
def cluster():
    # Workers import ray_faults by name when they unpickle its estimators.
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    context = ray.data.DataContext.get_current()
    bars, context.enable_progress_bars = context.enable_progress_bars, False
    yield
    context.enable_progress_bars = bars
    ray.shutdown()


def _frame(rs, rows: int) -> pd.DataFrame:
    size = rs.randn(rows) * 10 + 50
    size[rs.rand(rows) < 0.15] = np.nan
    return pd.DataFrame(
        {
            "size": size,
            "colour": rs.choice(["red", "green", "blue", None], rows),
            "city": pd.Series(rs.choice(["paris", "oslo", "rome"], rows)).astype("category"),
            "weight": rs.rand(rows).astype(np.float32),
        }
    )


def _classification_data() -> tuple:
    """``(X_train, y_train, X_test)``: DataFrames of strings, NaN and categories, 3 classes."""
    rs = np.random.RandomState(0)
    X = _frame(rs, 90)
    y = np.where(np.nan_to_num(X["size"], nan=50) + 5 * (X["colour"] == "red") > 52, "high", "low")
    y[::7] = "mid"
    return X.iloc[:50], y[:50], X.iloc[50:].reset_index(drop=True)


def _classifier(cls=TabICLClassifier):
    return cls(
        model_path=reference_checkpoint("clf", "tiny"), n_estimators=4, device="cpu", kv_cache=True
    )


@pytest.fixture(scope="module")
def frame_classifier():
    """A classifier fitted on a DataFrame, and its test rows."""
    X_train, y_train, X_test = _classification_data()
    return _classifier().fit(X_train, y_train), X_test


@pytest.fixture(scope="module")
def array_regressor():
    rs = np.random.RandomState(1)
    X = rs.randn(100, 5).astype(np.float32)
    y = X[:, 0] * 3 + rs.randn(100) * 0.1 + 20
    model = TabICLRegressor(
        model_path=reference_checkpoint("reg", "tiny"), n_estimators=4, device="cpu"
    )
    return model.fit(X[:60], y[:60]), X[60:]


# ---------------------------------------------------------------------------------------------
# predict_dataset


def test_probabilities_of_a_dataframe_equal_the_estimators_in_input_order(frame_classifier):
    model, X_test = frame_classifier
    result = predict_dataset(model, X_test, method="predict_proba", batch_size=7, **TWO_WORKERS)
    got = to_pandas_in_order(result)
    assert list(got.columns) == [f"proba_{c}" for c in model.classes_]
    assert got.index.tolist() == list(range(len(X_test)))
    np.testing.assert_allclose(got.to_numpy(), model.predict_proba(X_test), rtol=0, atol=EXACT)


def test_labels_of_a_dataset_numbered_in_its_order(frame_classifier):
    model, X_test = frame_classifier
    dataset = ray.data.from_pandas(X_test).repartition(3)
    result = predict_dataset(model, dataset, batch_size=8, output_column="label", **TWO_WORKERS)
    got = to_pandas_in_order(result)
    assert got.index.tolist() == list(range(len(X_test)))
    assert got["label"].tolist() == model.predict(X_test).tolist()


def test_parquet_files_with_their_own_ids_and_renamed_features(array_regressor, tmp_path):
    model, X_test = array_regressor
    keys = np.array([f"row-{i:03d}" for i in np.random.RandomState(2).permutation(len(X_test))])
    frame = pd.DataFrame(X_test, columns=[f"f{j}" for j in range(5)]).assign(key=keys)
    paths = [tmp_path / "a.parquet", tmp_path / "b.parquet"]
    frame.iloc[:25].to_parquet(paths[0])
    frame.iloc[25:].to_parquet(paths[1])
    columns = ["f4", "f3", "f2", "f1", "f0"]  # the estimator's features, in another order
    result = predict_dataset(
        model, paths, feature_columns=columns, id_column="key", batch_size=9, **TWO_WORKERS
    )
    got = to_pandas_in_order(result, keys, id_column="key")
    assert got.index.tolist() == keys.tolist()
    np.testing.assert_allclose(
        got["prediction"].to_numpy(), model.predict(X_test[:, ::-1]), rtol=0, atol=EXACT
    )
    numbered = to_pandas_in_order(predict_dataset(model, paths, feature_columns=columns))
    np.testing.assert_allclose(
        numbered["prediction"].to_numpy(), got["prediction"].to_numpy(), rtol=0, atol=EXACT
    )


def test_a_regressors_output_types_become_columns(array_regressor):
    model, X_test = array_regressor
    frame = pd.DataFrame(X_test, columns=[f"f{j}" for j in range(5)])
    kinds = {"output_type": ["mean", "quantiles"], "alphas": [0.1, 0.9]}
    got = to_pandas_in_order(predict_dataset(model, frame, batch_size=16, **kinds))
    want = model.predict(X_test, **kinds)
    assert list(got.columns) == ["prediction_mean", "prediction_quantiles"]
    np.testing.assert_allclose(got["prediction_mean"].to_numpy(), want["mean"], rtol=0, atol=EXACT)
    quantiles = np.stack(got["prediction_quantiles"].to_numpy())
    np.testing.assert_allclose(quantiles, want["quantiles"], rtol=0, atol=EXACT)


def test_a_worker_killed_mid_job_is_restarted_and_no_row_is_lost_or_repeated(
    frame_classifier, tmp_path
):
    model, X_test = frame_classifier
    want = model.predict_proba(X_test)
    X_train, y_train, _ = _classification_data()
    dying = _classifier(ExitOnceClassifier).fit(X_train, y_train)
    dying.exit_on = float(X_test["size"].dropna().iloc[20])  # a row of the third batch of 8
    dying.exit_marker = str(tmp_path / "exited")
    result = predict_dataset(dying, X_test, method="predict_proba", batch_size=8, **TWO_WORKERS)
    got = to_pandas_in_order(result)
    assert Path(dying.exit_marker).exists()  # a worker did end its process
    assert got.index.tolist() == list(range(len(X_test)))
    np.testing.assert_allclose(got.to_numpy(), want, rtol=0, atol=EXACT)


def test_refusals_before_any_work(frame_classifier, array_regressor):
    model, X_test = frame_classifier
    with pytest.raises(ValueError, match="method must be one of"):
        predict_dataset(array_regressor[0], X_test, method="predict_proba")
    with pytest.raises(ValueError, match="num_gpus_per_worker must be 0 or 1"):
        predict_dataset(model, X_test, num_gpus_per_worker=2)
    with pytest.raises(ValueError, match="fitted on 4 features"):
        predict_dataset(model, X_test, feature_columns=["size"])
    with pytest.raises(ValueError, match="has a column 'row_id'"):
        predict_dataset(model, X_test.assign(row_id=1))
    with pytest.raises(TypeError, match="dataset must be"):
        predict_dataset(model, X_test.to_numpy())
    with pytest.raises(ValueError, match="id_column 'key' is not a column"):
        predict_dataset(model, X_test, id_column="key")
    with pytest.raises(ValueError, match="holds no rows"):
        predict_dataset(model, X_test.iloc[:0])
    from sklearn.exceptions import NotFittedError

    with pytest.raises(NotFittedError):
        predict_dataset(TabICLClassifier(), X_test)


def test_in_order_names_a_repeated_or_missing_id():
    repeated = ray.data.from_pandas(pd.DataFrame({ROW_ID: [0, 1, 1], "prediction": [1, 2, 3]}))
    with pytest.raises(ValueError, match="more than once"):
        to_pandas_in_order(repeated)
    rows = ray.data.from_pandas(pd.DataFrame({ROW_ID: [0, 1], "prediction": [1, 2]}))
    with pytest.raises(ValueError, match="not the same ids"):
        to_pandas_in_order(rows, [0, 2])


# ---------------------------------------------------------------------------------------------
# fit_predict_many_dataset


def _tasks(count: int, seed: int) -> list:
    """Small classification tasks: numeric arrays of 1-8 features, 2-5 string classes, and a
    DataFrame task."""
    rs = np.random.RandomState(seed)
    tasks = []
    for i in range(count):
        n_train, n_test, k = rs.randint(12, 80), rs.randint(1, 20), rs.randint(2, 6)
        if i == 2:
            X = _frame(rs, n_train + n_test)
        else:
            X = rs.randn(n_train + n_test, rs.randint(1, 9)).astype(np.float32)
        labels = np.array([f"class-{c}" for c in range(k)])[rs.randint(0, k, n_train)]
        labels[:k] = [f"class-{c}" for c in range(k)]  # every class present
        tasks.append((X[:n_train], labels, X[n_train:]))
    return tasks


def _template(cls=TabICLClassifier):
    return cls(model_path=reference_checkpoint("clf", "tiny"), n_estimators=2, device="cpu")


def _assert_same_answers(got: list, want: list) -> None:
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want)):
        if isinstance(b, Exception):
            assert isinstance(a, TaskFailure) and a.index == index and str(a) == str(b)
        elif b.dtype.kind == "f":
            np.testing.assert_allclose(a, b, rtol=0, atol=EXACT)
        else:
            np.testing.assert_array_equal(a, b)


def test_many_tables_answer_as_fit_predict_many_in_task_order():
    template, tasks = _template(), _tasks(9, seed=3)
    want = template.fit_predict_many(tasks, "predict_proba")
    got = list(
        fit_predict_many_dataset(
            template, iter(tasks), "predict_proba", tasks_per_call=2, num_workers=2
        )
    )
    _assert_same_answers(got, want)
    labels = list(fit_predict_many_dataset(template, tasks, tasks_per_call=4))
    assert all(np.array_equal(a, b) for a, b in zip(labels, template.fit_predict_many(tasks)))


def test_a_refused_task_is_a_record_in_its_slot_and_the_others_go_on():
    template, tasks = _template(), _tasks(6, seed=4)
    X_train, y, X_test = tasks[1]
    tasks[1] = (X_train, np.full(len(y), np.nan), X_test)  # NaN labels
    tasks[4] = (X_train, y)  # not a task
    want = template.fit_predict_many(tasks, errors="return")
    got = list(fit_predict_many_dataset(template, tasks, tasks_per_call=2, num_workers=2))
    assert [type(a) for a in got].count(TaskFailure) == 2
    assert got[1].index == 1 and got[1].error_type == "ValueError"
    assert got[4].index == 4 and got[4].error_type == "TypeError"
    assert "a task is a tuple (X_train, y_train, X_test), got tuple" in str(got[4])
    del got[4], want[4]  # the estimator's message names the task's place in its own call
    _assert_same_answers(got, want)


def test_a_many_tables_worker_killed_mid_job_is_restarted(tmp_path):
    tasks = _tasks(8, seed=5)
    want = _template().fit_predict_many(tasks, "predict_proba")
    dying = _template(ExitOnceClassifier)
    dying.exit_on = float(tasks[5][2][0, 0])  # a test row of the call that answers tasks 4 and 5
    dying.exit_marker = str(tmp_path / "exited")
    got = list(
        fit_predict_many_dataset(dying, tasks, "predict_proba", tasks_per_call=2, num_workers=2)
    )
    assert Path(dying.exit_marker).exists()
    _assert_same_answers(got, want)


def test_a_dataset_of_tasks():
    template = _template()
    tasks = [t for i, t in enumerate(_tasks(5, seed=6)) if i != 2]  # numeric arrays
    rows = [dict(zip(("X_train", "y_train", "X_test"), t)) for t in tasks]
    got = list(fit_predict_many_dataset(template, ray.data.from_items(rows), "predict_proba"))
    _assert_same_answers(got, template.fit_predict_many(tasks, "predict_proba"))


def test_many_tables_refusals_at_the_call():
    with pytest.raises(ValueError, match="method must be one of"):
        fit_predict_many_dataset(_template(), [], "predict_quantiles")
    with pytest.raises(ValueError, match="tasks_per_call"):
        fit_predict_many_dataset(_template(), [], tasks_per_call=0)
    with pytest.raises(ValueError, match="columns"):
        fit_predict_many_dataset(_template(), ray.data.from_items([{"X": 1}]))


# ---------------------------------------------------------------------------------------------
# Packaging


def test_tabserve_imports_without_ray_and_names_the_extra():
    code = (
        "import sys\n"
        "sys.modules['ray'] = None\n"
        "import tabserve\n"
        "from tabserve import TabICLClassifier\n"
        "try:\n"
        "    import tabserve.ray\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert "pip install 'tabserve[ray]'" in child.stdout


def test_fsspecs_http_filesystem_is_whole_or_marked_missing():
    # Ray Data's threads would otherwise meet it half-imported (tabserve.ray's import settles it).
    module = sys.modules["fsspec.implementations.http"]
    assert module is None or hasattr(module, "HTTPFileSystem")


def test_the_extra_is_declared_and_installed_by_setup():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirement, http = project["optional-dependencies"]["ray"]
    assert requirement.startswith("ray[data]>=") and http == "aiohttp"
    setup = (ROOT / "scripts" / "run.sh").read_text()
    assert f"'ray.data:{requirement}'" in setup and "aiohttp:aiohttp" in setup
