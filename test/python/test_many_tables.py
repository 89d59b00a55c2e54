"""Many tables in one call (``fit_predict_many`` / ``fit_predict_iter``): each task's answer is
its own estimator's (a clone fitted and predicting alone) and tabicl 2.2.0's; packing keeps its
bounds; refused tasks are reported by index without losing the others."""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.base import clone
from tabicl_helpers import our_model, random_table, reference_checkpoint, requires_cuda
from tabserve import ops
from tabserve.buckets import Bucket
from tabserve.models.tabicl import TabICLClassifier, TabICLRegressor
from tabserve.models.tabicl.serving.served import SKIP_VALUE
from tabserve.models.tabicl.sklearn import many

#: Exact path: a packed task against its own estimator.
EXACT = 1e-6


def _frame_task(rs, n_train: int, n_test: int, labels) -> tuple:
    rows = n_train + n_test
    size = rs.randn(rows) * 10 + 50
    size[rs.rand(rows) < 0.15] = np.nan
    frame = pd.DataFrame(
        {
            "size": size,
            "colour": rs.choice(["red", "green", "blue", None], rows),
            "city": pd.Series(rs.choice(["paris", "oslo", "rome"], rows)).astype("category"),
            "weight": rs.rand(rows),
        }
    )
    signal = np.nan_to_num(size, nan=50) / 10 + (frame["colour"] == "red")
    y = labels(signal[:n_train])
    return frame.iloc[:n_train], y, frame.iloc[n_train:]


def _numeric_task(rs, n_train: int, n_test: int, features: int, labels) -> tuple:
    X = rs.randn(n_train + n_test, features).astype(np.float32)
    X[rs.rand(*X.shape) < 0.05] = np.nan
    signal = np.nan_to_num(X[:n_train, 0]) * 2 + rs.randn(n_train) * 0.3
    return X[:n_train], labels(signal), X[n_train:]


def _classes(rs, k: int):
    names = np.array([f"class-{c}" for c in range(k)])
    return lambda signal: names[np.floor(signal * 1.7 + rs.rand(len(signal)) * k).astype(int) % k]


def classification_tasks(count: int = 10, seed: int = 0) -> list:
    """Numeric arrays and DataFrames with strings, NaN and categories; 2-6 string classes,
    one task of 13 (past the tiny checkpoint's 10: it runs alone)."""
    rs = np.random.RandomState(seed)
    tasks = []
    for i in range(count):
        n_train, n_test = rs.randint(12, 120), rs.randint(1, 30)
        k = 13 if i == 3 else rs.randint(2, 7)
        if i % 3 == 1:
            tasks.append(_frame_task(rs, n_train, n_test, _classes(rs, k)))
        else:
            tasks.append(_numeric_task(rs, n_train, n_test, rs.randint(1, 9), _classes(rs, k)))
    return tasks


def regression_tasks(count: int = 8, seed: int = 1) -> list:
    rs = np.random.RandomState(seed)
    tasks = []
    for i in range(count):
        n_train, n_test = rs.randint(12, 120), rs.randint(1, 30)
        scale, shift = 10 ** rs.uniform(-2, 3), rs.uniform(-100, 100)
        labels = lambda s, scale=scale, shift=shift: s * scale + shift  # noqa: E731
        if i % 3 == 1:
            tasks.append(_frame_task(rs, n_train, n_test, labels))
        else:
            tasks.append(_numeric_task(rs, n_train, n_test, rs.randint(1, 9), labels))
    return tasks


def _classifier(**params) -> TabICLClassifier:
    path = reference_checkpoint("clf", "tiny")
    return TabICLClassifier(model_path=path, device="cpu", n_estimators=4, **params)


def _regressor(**params) -> TabICLRegressor:
    path = reference_checkpoint("reg", "tiny")
    return TabICLRegressor(model_path=path, device="cpu", n_estimators=4, **params)


# ---------------------------------------------------------------------------- the network
@pytest.mark.parametrize("task", ["clf", "reg"])
def test_tables_of_several_sizes_packed_on_one_bucket_answer_as_each_alone(task):
    """Per-table counts: each table attends only to its own rows and features."""
    model = our_model(task, "tiny")
    bucket = Bucket(64, 16, 12)
    shapes = [(40, 10, 5, 3), (64, 16, 12, 2), (7, 3, 2, 4), (20, 1, 9, 5)]
    tables, labels, n_train, n_features, expected = [], [], [], [], []
    for seed, (n, m, h, k) in enumerate(shapes):
        X, y = random_table(seed, 2, n, m, h, n_classes=k if task == "clf" else 0)
        with torch.no_grad():
            expected.append(model.forward_raw(X, y.float()))
        tables.append(ops.pad_to_bucket(X, n, bucket.train_rows, bucket.test_rows, bucket.features, SKIP_VALUE))
        labels.append(ops.pad_labels(y.float(), bucket.train_rows))
        n_train += [n, n]
        n_features += [h, h]
    with torch.no_grad():
        raw = model.padded_forward(
            torch.cat(tables), torch.cat(labels), torch.tensor(n_train), torch.tensor(n_features)
        )
    for i, ((_, m, _, _), want) in enumerate(zip(shapes, expected)):
        torch.testing.assert_close(raw[2 * i : 2 * i + 2, :m], want, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- the answers
def _loop(estimator, tasks, method="predict_proba", **params):
    return [getattr(clone(estimator).fit(a, b), method)(c, **params) for a, b, c in tasks]


def test_classifier_answers_are_each_tasks_own_estimators():
    tasks = classification_tasks()
    estimator = _classifier(random_state=7)
    report: dict = {}
    got = list(many.fit_predict_iter(estimator, tasks, "predict_proba", "raise", {}, report))
    for i, (want, answer) in enumerate(zip(_loop(estimator, tasks), got)):
        assert answer.shape == want.shape, i
        np.testing.assert_allclose(answer, want, atol=EXACT, rtol=0, err_msg=f"task {i}")
    # The 13-class task ran alone: the packs hold the members of the other nine.
    assert report["tables"] == 9 * 4 and report["padded_cells"] >= report["real_cells"]
    assert all(report[key] > 0 for key in ("fit_ms", "packs_ms", "answers_ms"))
    labels = estimator.fit_predict_many(tasks)
    for i, (want, answer) in enumerate(zip(_loop(estimator, tasks, "predict"), labels)):
        np.testing.assert_array_equal(answer, want, err_msg=f"task {i}")
        assert isinstance(answer[0], str)


def test_regressor_answers_are_each_tasks_own_estimators():
    tasks = regression_tasks()
    estimator = _regressor()
    kinds = ["mean", "median", "variance", "quantiles"]
    got = estimator.fit_predict_many(tasks, output_type=kinds, alphas=[0.1, 0.9])
    want = _loop(estimator, tasks, "predict", output_type=kinds, alphas=[0.1, 0.9])
    for i, (w, g) in enumerate(zip(want, got)):
        scale = np.std(tasks[i][1])
        for kind in kinds:
            np.testing.assert_allclose(g[kind], w[kind], atol=EXACT * scale, rtol=1e-6, err_msg=f"{i} {kind}")
    means = estimator.fit_predict_many(tasks)
    for w, g in zip(want, means):
        np.testing.assert_allclose(g, w["mean"], rtol=1e-6)


@pytest.mark.parametrize("batched", [True, False])
def test_every_normalisation_preprocessed_together_or_alone_answers_as_each_task(
    monkeypatch, batched
):
    """The default methods are preprocessed for all the tasks at once, the quantile and robust
    ones task by task; a batch that fails is preprocessed task by task instead."""
    from tabserve.models.tabicl.sklearn.preprocessing import preprocess_many

    calls, answered = [], []

    def counted(tables, method, threshold):
        calls.append((len(tables), method))
        if not batched:
            raise RuntimeError("a batch that fails")
        done = preprocess_many(tables, method, threshold)
        answered.append(method)
        return done

    monkeypatch.setattr(many, "preprocess_many", counted)
    tasks = classification_tasks(6, seed=3)
    norms = ["none", "power", "quantile_rtdl", "robust"]
    estimator = _classifier(random_state=5, norm_methods=norms).set_params(n_estimators=6)
    got = estimator.fit_predict_many(tasks, "predict_proba")
    for i, (want, answer) in enumerate(zip(_loop(estimator, tasks), got)):
        np.testing.assert_allclose(answer, want, atol=EXACT, rtol=0, err_msg=f"task {i}")
    # batches of the five tasks packed (task 3 has 13 classes), of the batched methods only;
    # a task left on its own is preprocessed alone
    for method in ("none", "power"):
        sizes = [count for count, m in calls if m == method]
        assert sizes and all(size > 1 for size in sizes) and sum(sizes) <= 5
    assert {m for _, m in calls} == {"none", "power"}
    # batched: every batch answered together (a failed one falls back to task by task unseen)
    assert len(answered) == (len(calls) if batched else 0)


def test_preprocessing_batches_hold_every_task_once_within_their_bounds():
    rs = np.random.RandomState(2)
    shapes = zip(rs.randint(8, 2000, 200), rs.randint(1, 500, 200), rs.randint(1, 60, 200))
    tasks = [many._Task(i, shape=Bucket(*map(int, shape))) for i, shape in enumerate(shapes)]
    batches = many._batches(tasks)
    assert sorted(p.index for b in batches for p in b) == list(range(200))
    for batch in batches:
        if len(batch) == 1:
            continue
        rows = max(p.shape.train_rows for p in batch) + max(p.shape.test_rows for p in batch)
        padded = rows * sum(p.shape.features for p in batch)
        real = sum(p.shape.rows * p.shape.features for p in batch)
        assert padded <= many.PREPROCESS_VALUES and padded <= many.PREPROCESS_WASTE * real


def test_answers_match_tabicl_on_a_sample_of_tasks():
    tabicl = pytest.importorskip("tabicl")
    options = {"device": "cpu", "use_amp": False, "use_fa3": False, "allow_auto_download": False}
    tasks = [t for i, t in enumerate(classification_tasks(seed=3)) if i != 3][:4]
    ours = _classifier().fit_predict_many(tasks, "predict_proba")
    path = str(reference_checkpoint("clf", "tiny"))
    for (X_train, y_train, X_test), answer in zip(tasks, ours):
        ref = tabicl.TabICLClassifier(model_path=path, n_estimators=4, **options)
        np.testing.assert_allclose(answer, ref.fit(X_train, y_train).predict_proba(X_test), atol=1e-5)
    tasks = regression_tasks(4, seed=4)
    ours = _regressor().fit_predict_many(tasks)
    path = str(reference_checkpoint("reg", "tiny"))
    for (X_train, y_train, X_test), answer in zip(tasks, ours):
        ref = tabicl.TabICLRegressor(model_path=path, n_estimators=4, **options)
        want = ref.fit(X_train, y_train).predict(X_test)
        # float32 targets: the reference rounds its answers to float32 (7 digits)
        np.testing.assert_allclose(answer, want, atol=1e-5 * np.std(y_train), rtol=1e-6)


def test_the_estimator_is_left_as_it_was():
    tasks = classification_tasks(4)
    fitted = _classifier().fit(*tasks[0][:2])
    before = fitted.predict_proba(tasks[0][2])
    state = dict(vars(fitted))
    fitted.fit_predict_many(tasks[1:])
    assert vars(fitted).keys() == state.keys()
    assert all(vars(fitted)[k] is v for k, v in state.items())
    np.testing.assert_array_equal(fitted.predict_proba(tasks[0][2]), before)
    unfitted = _classifier()
    unfitted.fit_predict_many(tasks)
    assert not hasattr(unfitted, "classes_")


# ---------------------------------------------------------------------------- streaming
def test_the_iterator_reads_the_tasks_a_group_at_a_time(monkeypatch):
    monkeypatch.setattr(many, "GROUP_TASKS", 3)
    tasks = classification_tasks(7)
    read = []

    def source():
        for i, task in enumerate(tasks):
            read.append(i)
            yield task

    answers = _classifier().fit_predict_iter(source(), "predict_proba")
    assert read == []  # nothing read before the first answer is asked for
    first = next(answers)
    assert read == [0, 1, 2]
    rest = list(answers)
    assert read == list(range(7)) and len(rest) == 6
    want = _loop(_classifier(), tasks)
    for w, g in zip(want, [first, *rest]):
        np.testing.assert_allclose(g, w, atol=EXACT, rtol=0)


# ---------------------------------------------------------------------------- refused tasks
def _bad_tasks() -> tuple[list, dict]:
    """Task 1 has a NaN label, task 5's test rows have one more column than its train rows."""
    tasks = classification_tasks(6, seed=5)
    X_train, y_train, X_test = tasks[1]
    labels = (np.arange(len(y_train)) % 2).astype(float)
    labels[0] = np.nan
    tasks[1] = (X_train, labels, X_test)
    X_train, y_train, X_test = tasks[5]
    tasks[5] = (X_train, y_train, np.hstack([X_test, X_test[:, :1]]))
    return tasks, {1: "NaN", 5: "features"}


def test_a_refused_task_raises_naming_its_index_after_the_answers_before_it():
    tasks, bad = _bad_tasks()
    answers = _classifier().fit_predict_iter(tasks, "predict_proba")
    first = next(answers)
    assert first.shape[0] == tasks[0][2].shape[0]
    with pytest.raises(many.TaskError, match="task 1: ValueError: .*NaN") as raised:
        next(answers)
    assert raised.value.index == 1 and isinstance(raised.value.error, ValueError)
    with pytest.raises(many.TaskError, match="task 1"):
        _classifier().fit_predict_many(tasks)


def test_per_task_errors_leave_the_other_tasks_answered():
    tasks, bad = _bad_tasks()
    got = _classifier().fit_predict_many(tasks, "predict_proba", errors="return")
    want = _loop(_classifier(), [t for i, t in enumerate(tasks) if i not in bad])
    good = [g for i, g in enumerate(got) if i not in bad]
    for w, g in zip(want, good):
        np.testing.assert_allclose(g, w, atol=EXACT, rtol=0)
    for index, words in bad.items():
        assert isinstance(got[index], many.TaskError) and got[index].index == index
        assert words in str(got[index])


def test_a_classifier_refuses_a_regression_task_and_a_task_that_is_no_triple():
    tasks = classification_tasks(3)
    X_train, _, X_test = tasks[1]
    tasks[1] = (X_train, np.linspace(0, 1, len(X_train)), X_test)  # continuous
    tasks.append("not a task")
    got = _classifier().fit_predict_many(tasks, errors="return")
    assert isinstance(got[1], many.TaskError) and "continuous" in str(got[1])
    assert isinstance(got[3], many.TaskError) and "(X_train, y_train, X_test)" in str(got[3])
    assert not isinstance(got[0], many.TaskError) and not isinstance(got[2], many.TaskError)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda e, t: e.fit_predict_iter(t, "transform"), "method must be one of"),
        (lambda e, t: e.fit_predict_iter(t, errors="ignore"), "errors must be one of"),
        (lambda e, t: e.set_params(n_estimators=0).fit_predict_iter(t), "n_estimators"),
        (lambda e, t: _regressor().fit_predict_iter(t, "predict_proba"), "method must be one of"),
    ],
)
def test_bad_call_arguments_raise_before_any_task_is_read(call, match):
    read = []

    def source():
        read.append(True)
        yield from classification_tasks(2)

    with pytest.raises(ValueError, match=match):
        call(_classifier(), source())
    assert read == []


# ---------------------------------------------------------------------------- packing
def _group(tables: int, n_train: int, n_test: int, features: int) -> many._Group:
    X, y = torch.zeros(tables, n_train + n_test, features), torch.zeros(tables, n_train)
    return many._Group(0, X, y, Bucket(n_train, n_test, features))


@pytest.mark.parametrize("waste", [0.1, 1.0])
def test_packs_hold_every_group_once_within_their_bounds(waste):
    limits = many.PackLimits(cells=40_000, waste=waste)
    rs = np.random.RandomState(0)
    groups = []
    for _ in range(200):
        n, m, h = int(rs.randint(1, 300)), int(rs.randint(1, 60)), int(rs.randint(1, 40))
        groups.append(_group(int(rs.choice([1, 4, 8])), n, m, h))
    big = _group(8, 1000, 100, 30)  # past the cell bound alone
    packs = many.pack([*groups, big], limits)
    packed = [g for p in packs for g in p.groups]
    assert sorted(map(id, packed)) == sorted(map(id, [*groups, big]))
    assert any(p.groups == [big] for p in packs)
    for p in packs:
        if len(p.groups) > 1:
            assert p.cells <= limits.cells and p.cells <= (1 + limits.waste) * p.real_cells
        for g in p.groups:  # every group fits its pack's bucket
            assert g.n_train <= p.bucket.train_rows and g.n_test <= p.bucket.test_rows
            assert g.X.shape[2] <= p.bucket.features
    # Tables of one shape, or of shapes within the waste bound, share one call.
    alike = [_group(4, 50, 10, 5) for _ in range(30)] + [_group(4, 52, 10, 5) for _ in range(30)]
    assert len(many.pack(alike, many.PackLimits(cells=1 << 20, waste=0.1))) == 1
    assert len(many.pack(alike + [_group(4, 50, 10, 9)], many.CUDA_LIMITS)) == 1
    # On the CPU a pack holds one shape, and runs unpadded.
    assert [len(p.groups) for p in many.pack(alike, many.CPU_LIMITS)] == [30, 30]


def test_a_pack_of_one_shape_runs_unpadded_and_answers_as_the_padded_path():
    engine = copy.deepcopy(our_model("clf", "tiny"))  # a copy: the shared one stays unpatched
    X, y = random_table(0, 6, 30, 6, 5, n_classes=3)
    parts = [many._Group(i, X[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2].float(), Bucket(30, 6, 5)) for i in range(3)]
    calls = []
    original = engine.padded_forward

    def recording(X, y_train, n_train, n_features):
        calls.append((n_train, n_features))
        return original(X, y_train, n_train, n_features)

    engine.padded_forward = recording
    one_shape = many.Pack(parts, Bucket(30, 6, 5))
    plain = many._run_pack(engine, torch.device("cpu"), one_shape)
    assert calls == [(None, None)]
    padded = many._run_pack(engine, torch.device("cpu"), many.Pack(parts, Bucket(32, 8, 6)))
    assert calls[1][0] is not None  # counts: the masked path
    expected = engine.forward_raw(X, y.float())
    for i, (a, b) in enumerate(zip(plain, padded)):
        torch.testing.assert_close(a, expected[2 * i : 2 * i + 2].float(), atol=1e-6, rtol=0)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- CUDA
@requires_cuda
@pytest.mark.parametrize("recipe, tolerance", [("exact", 1e-5), (None, 2e-2)])
def test_cuda_packed_answers_are_each_tasks_own_estimators(recipe, tolerance):
    """On the GPU: the exact recipe packs in fp32 (the memory-efficient kernels with a count per
    table), the default packs on the ready fp16 preset, within the driver's gate of the loop."""
    tasks = classification_tasks(8, seed=9)
    path = reference_checkpoint("clf", "tiny")
    estimator = TabICLClassifier(model_path=path, device="cuda", n_estimators=4, recipe=recipe)
    got = estimator.fit_predict_many(tasks, "predict_proba")
    for i, (want, answer) in enumerate(zip(_loop(estimator, tasks), got)):
        np.testing.assert_allclose(answer, want, atol=tolerance, rtol=0, err_msg=f"task {i}")


@requires_cuda
def test_cuda_packed_regression_with_frames_answers_as_each_tasks_own_estimator():
    """Tasks preprocessed on the host (DataFrames with strings among them), run on the GPU."""
    tasks = regression_tasks(8, seed=4)
    path = reference_checkpoint("reg", "tiny")
    estimator = TabICLRegressor(model_path=path, device="cuda", n_estimators=4, recipe="exact")
    got = estimator.fit_predict_many(tasks)
    for i, (want, answer) in enumerate(zip(_loop(estimator, tasks, "predict"), got)):
        scale = np.std(np.asarray(tasks[i][1], dtype=np.float64))
        np.testing.assert_allclose(answer, want, atol=1e-5 * scale, rtol=0, err_msg=f"task {i}")
