"""Many tables in one call: the estimators' ``fit_predict_many`` and ``fit_predict_iter``.

A task is ``(X_train, y_train, X_test)``. Each is fitted as a fresh estimator with the caller's
arguments would be (a :func:`sklearn.base.clone`: its own columns, dtypes, classes, ensemble plan
and preprocessing, the same ``random_state``), then the members of every task (one table per
feature permutation and class shift) are padded onto shared shapes and run together, a few
calls for hundreds of tables where a loop makes a few calls per table. The answers are each
task's own estimator's: padding is exact (each table attends only to its own real rows and
features, the counts per table in the batch), so the exact recipe agrees with a loop within
1e-6; a reduced-precision recipe runs its packs on the engine's ready preset (``medium`` under
the compiling default, then its fused-kernel form once a background warm-up has compiled and
timed it: :meth:`~..serving.background.CompilingTabICL.padded_forward`), within the driver's
accuracy gate of the loop.

Packing (:func:`pack`): largest first, each normalisation group of a task (its shape: train
rows, test rows, features) joins the pack it adds the fewest padded cells to, where the pack,
padded to the shape that holds all of its groups, keeps a bound on its cells and
its padded cells within a share of its groups' real cells (:func:`limits_for`: tight on the CPU,
where time follows cells, loose on a GPU, where a small call's time is its launches); else it
opens a pack. A
group larger than the cell bound runs alone, as its own estimator's call would. Packs run
uncompiled and uncaptured, so their shapes need not recur: they pad to the largest of their
groups, not to a grid. Tasks past the estimator's :class:`~tabserve.buckets.BucketGrid` (the
largest tables it serves padded), or of more classes than the checkpoint's ``max_classes``, run
alone through their estimator.

The members' preprocessing (scaling, Yeo-Johnson, outlier clipping: the estimators' default
normalisations) runs for many tasks at once (:func:`_lay_out`): their columns side by side, each
padded with NaN past its table's rows, which every statistic skips, so a batch of tasks costs the
tensor operations of one (on a GPU each is a kernel launch) and each task's rows are its own.

Tasks are read from the iterable :data:`GROUP_TASKS` at a time: ``fit_predict_iter`` holds one
group's tables, so it serves more tasks than memory holds and yields the answers in order.

Errors: a task whose data is refused (a NaN label, a column count its test rows do not share, a
classifier given continuous targets) raises :class:`TaskError` naming its index
(``errors="raise"``, after the answers before it have been yielded), or stands in its slot
(``errors="return"``) while the other tasks are answered. The estimator's own arguments are
checked first: a bad one raises before any task is read. The estimator itself is never fitted
or changed.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from sklearn.base import clone
from torch import Tensor

from tabserve import ops
from tabserve.buckets import Bucket, BucketGrid

from ..network.transfer import device_values
from ..serving.background import foreground
from ..serving.served import SKIP_VALUE
from .preprocessing import BATCHED_METHODS, MemberPreprocessor, preprocess_many
from .reference_args import torch_threads

#: Tasks read from the iterable and answered together.
GROUP_TASKS = 256


@dataclass(frozen=True)
class PackLimits:
    """How large a packed call grows: ``cells`` (tables x padded rows x padded features) at
    most, and padded cells at most ``waste`` above its tables' real cells."""

    cells: int
    waste: float


#: On the CPU a call's time follows its padded cells (full-size model, 2 cores: 16 tables
#: packed at 1.34x their cells took 19.1 s where their loop took 16.3 s), and the padded path's
#: masked attention costs more than the plain one (16 tables packed at 1.000x their cells: 0.84x
#: their loop's tables per second): so packs there hold groups of one shape, which run
#: unpadded. 2**20 cells hold about 1 GiB of the row stage's fp32 activations.
CPU_LIMITS = PackLimits(cells=1 << 20, waste=0.0)
#: On a GPU packs grow larger and looser. What that buys is small: on an H100 (the ready preset,
#: the 60-table population) 57 packs at 1.01x their cells spent 1.4 s in the packed calls, 19 at
#: 1.83x 1.35 s, whose kernels kept the GPU busy for about as long (layer norms and the casts
#: around them took 41% of it, attention 21%, the matrix products 11%).
CUDA_LIMITS = PackLimits(cells=1 << 22, waste=1.0)


def limits_for(device: torch.device) -> PackLimits:
    return CUDA_LIMITS if device.type == "cuda" else CPU_LIMITS
ERRORS = ("raise", "return")


class TaskError(ValueError):
    """Task ``index`` was refused: ``error`` is what its own estimator raised."""

    def __init__(self, index: int, error: BaseException):
        super().__init__(f"task {index}: {type(error).__name__}: {error}")
        self.index = index
        self.error = error


@dataclass(eq=False)
class _Group:
    """One normalisation group of one task: its members as a batch of tables."""

    task: int
    X: Tensor  # (members, n_train + n_test, features)
    y: Tensor  # (members, n_train)
    bucket: Bucket  # its own shape
    output: Tensor | None = None

    @property
    def n_train(self) -> int:
        return self.y.shape[1]

    @property
    def n_test(self) -> int:
        return self.X.shape[1] - self.y.shape[1]

    @property
    def real_cells(self) -> int:
        return self.X.shape[0] * self.X.shape[1] * self.X.shape[2]


@dataclass
class Pack:
    """Groups run in one call, on the bucket that holds each of them."""

    groups: list = field(default_factory=list)
    bucket: Bucket | None = None

    @property
    def tables(self) -> int:
        return sum(g.X.shape[0] for g in self.groups)

    @property
    def cells(self) -> int:
        return self.tables * self.bucket.rows * self.bucket.features

    @property
    def real_cells(self) -> int:
        return sum(g.real_cells for g in self.groups)


def _covering(a: Bucket, b: Bucket) -> Bucket:
    return Bucket(
        max(a.train_rows, b.train_rows), max(a.test_rows, b.test_rows), max(a.features, b.features)
    )


def pack(groups: list, limits: PackLimits = CPU_LIMITS) -> list:
    """Packs of ``groups`` (see the module docstring): largest first, each group joins the pack
    it adds the fewest padded cells to within ``limits``, or opens a pack of its own."""
    packs: list = []
    for group in sorted(groups, key=lambda g: g.real_cells, reverse=True):
        best, best_extra = None, None
        for candidate in packs:
            bucket = _covering(candidate.bucket, group.bucket)
            cells = (candidate.tables + group.X.shape[0]) * bucket.rows * bucket.features
            real = candidate.real_cells + group.real_cells
            if cells > limits.cells or cells > (1 + limits.waste) * real:
                continue
            extra = cells - candidate.cells
            if best is None or extra < best_extra:
                best, best_extra = candidate, extra
        if best is None:
            packs.append(Pack([group], group.bucket))
        else:
            best.groups.append(group)
            best.bucket = _covering(best.bucket, group.bucket)
    return packs


def _run_pack(engine, device: torch.device, pack: Pack) -> list:
    """One call of ``engine`` on ``device`` for the pack's groups: each group's raw outputs of
    its real test rows."""
    bucket = pack.bucket
    if all(g.bucket == bucket for g in pack.groups):  # one shape: no padding, the plain path
        with torch.no_grad():
            raw = engine.padded_forward(
                torch.cat([g.X for g in pack.groups]).to(device),
                torch.cat([g.y for g in pack.groups]).to(device),
                None,
                None,
            )
        return _split_outputs(pack, raw)
    tables, labels, n_train, n_features = [], [], [], []
    for g in pack.groups:
        tables.append(
            ops.pad_to_bucket(
                g.X.to(device), g.n_train, bucket.train_rows, bucket.test_rows, bucket.features,
                SKIP_VALUE,
            )
        )  # fmt: skip
        labels.append(ops.pad_labels(g.y.to(device), bucket.train_rows))
        n_train += [g.n_train] * g.X.shape[0]
        n_features += [g.X.shape[2]] * g.X.shape[0]
    with torch.no_grad():
        raw = engine.padded_forward(
            torch.cat(tables),
            torch.cat(labels),
            device_values(n_train, torch.int64, device),
            device_values(n_features, torch.int64, device),
        )
    return _split_outputs(pack, raw)


def _split_outputs(pack: Pack, raw: Tensor) -> list:
    """Each group's raw outputs of its real test rows, from the pack's ``raw``."""
    outputs, start = [], 0
    for g in pack.groups:
        stop = start + g.X.shape[0]
        outputs.append(raw[start:stop, : g.n_test].float())
        start = stop
    return outputs


def _split(task, index: int):
    try:
        X_train, y_train, X_test = task
    except (TypeError, ValueError):
        raise TypeError(
            f"task {index}: a task is a tuple (X_train, y_train, X_test), got "
            f"{type(task).__name__}"
        ) from None
    return X_train, y_train, X_test


@dataclass
class _Task:
    index: int
    estimator: object | None = None  # fitted up to its members' preprocessing: to be packed
    test_table: Tensor | None = None  # its test rows, encoded
    shape: Bucket | None = None  # (train rows, test rows, features) of its member tables
    groups: list = field(default_factory=list)
    answer: object = None
    error: TaskError | None = None


def _on_grid(grid: BucketGrid, shape: Bucket) -> bool:
    return grid.bucket_for(shape.train_rows, shape.test_rows, shape.features) is not None


def _prepare(template, task, index: int, method: str, params: dict, grid: BucketGrid) -> _Task:
    """Fits task ``index`` up to its members' preprocessing (:func:`_lay_out` does that for
    the packed tasks together); a task that cannot be packed is fitted whole and answered here,
    by its estimator."""
    prepared = _Task(index)
    try:
        X_train, y_train, X_test = _split(task, index)
        estimator = clone(template)
        estimator._members_later = True
        estimator.fit(X_train, y_train)
        X = estimator._test_table(X_test)
        shape = Bucket(estimator._train_table.shape[0], X.shape[0], X.shape[1])
        if estimator._packable() and _on_grid(grid, shape):
            prepared.estimator, prepared.test_table, prepared.shape = estimator, X, shape
        else:
            estimator._fit_preprocessors(estimator._train_table)
            prepared.answer = getattr(estimator, method)(X_test, **params)
    except Exception as error:  # the task's own refusal, reported per task
        prepared.error = error if isinstance(error, TaskError) else TaskError(index, error)
    return prepared


#: The most values (padded rows x the tables' columns) the members' preprocessing of many
#: tasks holds in one batch (:func:`preprocessing.preprocess_many`): 2**22 float64 values are
#: 32 MiB a copy.
PREPROCESS_VALUES = 1 << 22
#: ... and at most this many times the values of its tables: padding is work too.
PREPROCESS_WASTE = 1.5


def _lay_out(prepared: list) -> None:
    """The member groups of every packed task: each normalisation method's preprocessing for
    the tasks that use it, in batches of at most :data:`PREPROCESS_VALUES` values (task by task
    for the methods not batched, and for a batch that failed: a task's own failure is its
    error), then each task's member tables."""
    packed = [p for p in prepared if p.estimator is not None]
    rows: dict = {}  # (task index, method) -> preprocessed train + test rows
    for method in dict.fromkeys(m for p in packed for m in p.estimator.plan_):
        users = [p for p in packed if method in p.estimator.plan_]
        batches = _batches(users) if method in BATCHED_METHODS else [[p] for p in users]
        for batch in batches:
            if len(batch) > 1:
                threshold = batch[0].estimator.outlier_threshold
                tables = [(p.estimator._train_table, p.test_table) for p in batch]
                try:
                    done = preprocess_many(tables, method, threshold)
                except Exception:  # noqa: BLE001  (each task alone below: whose failure is it)
                    done = None
                if done is not None:
                    rows.update(((p.index, method), out) for p, out in zip(batch, done))
                    continue
            for p in batch:
                _preprocess_alone(p, method, rows)
    for p in packed:
        if p.error is not None:
            p.estimator = None
            continue
        est = p.estimator
        p.groups = [
            _Group(p.index, X_m, y_m, p.shape)
            for method in est.plan_
            for X_m, y_m in est._chunks(method, None, rows=rows[p.index, method])
        ]


def _preprocess_alone(p: _Task, method: str, rows: dict) -> None:
    """Task ``p``'s preprocessing for ``method`` on its own (its error, if it fails)."""
    est = p.estimator
    try:
        prep = MemberPreprocessor(method, est.outlier_threshold, est.random_state)
        prep.fit(est._train_table)
        rows[p.index, method] = torch.cat([prep.train_, prep.transform(p.test_table)])
    except Exception as error:  # the task's own refusal, reported per task
        p.error = p.error or TaskError(p.index, error)


def _batches(tasks: list) -> list:
    """``tasks`` in batches for :func:`preprocess_many`, most rows first (the columns of a
    batch stand side by side, padded to its most train and test rows), each padded to at most
    :data:`PREPROCESS_VALUES` values and :data:`PREPROCESS_WASTE` times its tasks' own (a task
    larger than that alone)."""
    batches: list = []
    train = test = columns = real = 0
    for p in sorted(tasks, key=lambda p: (p.shape.train_rows, p.shape.test_rows), reverse=True):
        shape, own = p.shape, p.shape.rows * p.shape.features
        grown = max(train, shape.train_rows), max(test, shape.test_rows), columns + shape.features
        padded = (grown[0] + grown[1]) * grown[2]
        if batches and padded <= min(PREPROCESS_VALUES, PREPROCESS_WASTE * (real + own)):
            batches[-1].append(p)
            (train, test, columns), real = grown, real + own
        else:
            batches.append([p])
            train, test, columns, real = shape.train_rows, shape.test_rows, shape.features, own
    return batches


def _finish(prepared: _Task, method: str, params: dict) -> None:
    if prepared.estimator is None:
        return
    try:
        raw = torch.cat([g.output for g in prepared.groups])
        prepared.answer = prepared.estimator._from_raw(raw, method, params)
    except Exception as error:
        prepared.error = TaskError(prepared.index, error)
    prepared.estimator = prepared.groups = prepared.test_table = None


def _answer_group(
    template, tasks: list, first: int, method: str, params: dict, report: dict | None
) -> list:
    # Every task is fitted before any pack runs. Fitting the next tasks while the device ran
    # the packed calls of those before them (the fits' tensor work on a stream of its own) was
    # slower on an H100 (60 tables, warm: 1.78 s in parts of 16 tasks, 1.84 s of 8, 1.76 s of
    # 32, against 1.64 s in one part): the fits took as long as alone (589 against 571 ms), and
    # smaller parts made more packs (25 against 19).
    grid = template.bucket_grid or BucketGrid()
    clock = _Clock(report)
    prepared = [_prepare(template, t, first + i, method, params, grid) for i, t in enumerate(tasks)]
    _lay_out(prepared)
    clock.lap("fit_ms", template_device(prepared))
    by_engine: dict = {}  # tasks served by one engine pack together
    for p in prepared:
        if p.estimator is not None:
            by_engine.setdefault(id(p.estimator.model_), (p.estimator, []))[1].extend(p.groups)
    limits = limits_for(template_device(prepared))
    for fitted, groups in by_engine.values():
        packs = pack(groups, limits)
        # Packs go to the estimator's devices in turn (:func:`.devices.spread`).
        jobs = [lambda engine, device, one=one: _run_pack(engine, device, one) for one in packs]
        for one, outputs in zip(packs, fitted._spread(jobs)):
            for group, output in zip(one.groups, outputs):
                group.output = output
            if report is not None:
                _count(report, one)
    clock.lap("packs_ms", template_device(prepared))
    for p in prepared:
        _finish(p, method, params)
    clock.lap("answers_ms", None)
    return prepared


class _Clock:
    """Adds the time of each stage of a group to ``report`` (nothing without one): ``fit_ms``
    (the tasks' fits and member tables), ``packs_ms`` (the packed calls), ``answers_ms`` (each
    task's answer from its outputs). A lap waits for ``device``'s queued work, so the time of
    a stage is its own, not the next one's."""

    def __init__(self, report: dict | None):
        self.report = report
        self.start = time.perf_counter()

    def lap(self, key: str, device: torch.device | None) -> None:
        if self.report is None:
            return
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        self.report[key] = self.report.get(key, 0.0) + (now - self.start) * 1e3
        self.start = now


def template_device(prepared: list) -> torch.device:
    """The device the fitted tasks serve on (the CPU when none was fitted)."""
    for p in prepared:
        if p.estimator is not None:
            return p.estimator.device_
    return torch.device("cpu")


def check_call(estimator, method: str, errors: str) -> None:
    """The call's own arguments, and the estimator's, before any task is read."""
    methods = ("predict", "predict_proba") if estimator._classification else ("predict",)
    if method not in methods:
        raise ValueError(f"method must be one of {methods}, got {method!r}")
    if errors not in ERRORS:
        raise ValueError(f"errors must be one of {ERRORS}, got {errors!r}")
    estimator._check_params()


def fit_predict_iter(
    estimator, tasks: Iterable, method: str, errors: str, params: dict, report: dict | None = None
) -> Iterator:
    """The answers of ``tasks``, in order (see the module docstring). ``report``: a dict that
    counts the packs and their padding (:func:`_count`)."""
    check_call(estimator, method, errors)  # now, not at the first answer
    return _answers(estimator, iter(tasks), method, errors, params, report)


def _answers(estimator, source: Iterator, method: str, errors: str, params: dict, report) -> Iterator:
    first = 0
    while True:
        group = list(itertools.islice(source, GROUP_TASKS))
        if not group:
            return
        with torch_threads(estimator.n_jobs), foreground():
            answered = _answer_group(estimator, group, first, method, params, report)
        for p in answered:
            if p.error is not None and errors == "raise":
                raise p.error
            yield p.error if p.error is not None else p.answer
        first += len(group)


def _count(report: dict, one: Pack) -> None:
    """Adds a pack to ``report``: packed calls, tables, real and padded cells, the largest
    call's cells (what the benchmark reports of the padding; :class:`_Clock` adds the times)."""
    report["packs"] = report.get("packs", 0) + 1
    report["tables"] = report.get("tables", 0) + one.tables
    report["real_cells"] = report.get("real_cells", 0) + one.real_cells
    report["padded_cells"] = report.get("padded_cells", 0) + one.cells
    report["largest_pack_cells"] = max(report.get("largest_pack_cells", 0), one.cells)


__all__ = ["CPU_LIMITS", "CUDA_LIMITS", "GROUP_TASKS", "Pack", "PackLimits", "TaskError", "pack"]
