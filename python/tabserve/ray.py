"""tabserve's estimators on a Ray cluster: the optional extra ``pip install 'tabserve[ray]'``.

Two jobs, each run by a fixed number of workers (Ray actors), every worker holding its own copy
of the estimator and its served model, warm from its first batch to the end of the job:

* :func:`predict_dataset`: a fitted estimator predicts every row of a ``ray.data.Dataset``
  (or of Parquet files, or of a pandas DataFrame) through ``Dataset.map_batches`` with a
  callable class. The result is a Dataset of an id column and the predictions; rows come back
  in any order, so :func:`to_pandas_in_order` puts a small result back in the input's order.
* :func:`fit_predict_many_dataset`: a many-tables job. Tasks ``(X_train, y_train, X_test)`` go
  to the workers ``tasks_per_call`` at a time, through a :class:`ray.util.ActorPool`; each
  worker answers its share with the estimator's ``fit_predict_many(errors="return")``, and the
  answers stream back in task order, a refused task as a :class:`TaskFailure` in its slot.

How the estimator reaches the workers: it is pickled once on the driver and unpickled once per
worker. An estimator pickles without its network (its arguments, and once fitted its fitted
state: kilobytes for small training sets): each worker reads the weights again from the
checkpoint path the estimator was fitted with, which must hold the same file on every node (a
shared filesystem, a copy at the same path, or ``model_path=None`` and the Hugging Face cache on
each node); ``predict_dataset(..., ship_weights=True)`` sends the checkpoint along instead (tens
of MiB through Ray's object store).

A worker reserves ``num_cpus_per_worker`` of Ray's CPUs and runs PyTorch with as many threads
(at least one), or one GPU (``num_gpus_per_worker=1``: one worker per GPU, serving on it with
the recipe a fit there would settle: the estimator's ``recipe``, None being ``"auto"`` on a
GPU). A worker whose process dies is restarted by Ray and its batch or chunk run again
(``max_retries`` times), so the output holds every row, and every task, exactly once.

Ray is started on first use (``ray.init()`` with its defaults) unless the caller started it.
"""

from __future__ import annotations

import itertools
import os
import pickle
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

#: What to install for this module.
RAY_EXTRA = "pip install 'tabserve[ray]'"

try:
    import ray
    import ray.data
    from ray.util import ActorPool
except ImportError as error:
    raise ImportError(f"tabserve.ray needs Ray Data: {RAY_EXTRA}") from error

from sklearn.base import is_classifier
from sklearn.utils.validation import check_is_fitted

from tabserve.models.tabicl import TabICLClassifier, TabICLRegressor
from tabserve.models.tabicl.sklearn.many import TaskError

#: The id column numbered from the row order when the caller names none.
ROW_ID = "row_id"
#: The columns of a Dataset of many-tables tasks, one task a row.
TASK_COLUMNS = ("X_train", "y_train", "X_test")


def _settle_fsspec_http() -> None:
    """Imports fsspec's HTTP filesystem once, in this thread, or marks it missing.

    Ray Data resolves a read's paths in several threads, each importing
    ``fsspec.implementations.http``; where fsspec is installed without aiohttp (as
    huggingface_hub, a tabserve dependency, leaves it), a thread can meet the module another
    left half-imported, an ImportError Ray does not catch (4 of 8 fresh processes reading 4
    Parquet files with Ray 2.59). A module marked None fails every import as missing, which Ray
    takes as no HTTP filesystem."""
    try:
        import fsspec.implementations.http  # noqa: F401
    except ImportError:
        sys.modules.setdefault("fsspec.implementations.http", None)


# At import, so that the caller's own reads are settled too.
_settle_fsspec_http()


@dataclass(frozen=True)
class Workers:
    """How a job's workers are placed: ``count`` actors, each reserving ``cpus`` of Ray's CPUs
    and ``gpus`` (0 or 1) GPUs; a worker that dies is restarted, and what it was answering run
    again, up to ``max_retries`` times."""

    count: int = 1
    cpus: float = 1
    gpus: int = 0
    max_retries: int = 3

    def __post_init__(self):
        _check_count("num_workers", self.count)
        if isinstance(self.cpus, bool) or not isinstance(self.cpus, (int, float)) or self.cpus <= 0:
            raise ValueError(f"num_cpus_per_worker must be a positive number, got {self.cpus!r}")
        # One worker per GPU: a worker serves on the device Ray gives it, and two workers
        # sharing one GPU would each hold the weights and compiled graphs.
        if isinstance(self.gpus, bool) or self.gpus not in (0, 1):
            raise ValueError(f"num_gpus_per_worker must be 0 or 1, got {self.gpus!r}")
        _check_count("max_retries", self.max_retries, minimum=0)

    @property
    def device(self) -> str:
        """The device each worker serves on (Ray shows a GPU worker its own GPU as cuda:0)."""
        return "cuda" if self.gpus else "cpu"

    @property
    def threads(self) -> int:
        """PyTorch's CPU threads in each worker: its reserved CPUs, at least one."""
        return max(1, int(self.cpus))

    def remote_args(self) -> dict:
        """Ray's options for each worker actor."""
        return {
            "num_cpus": self.cpus,
            "num_gpus": self.gpus,
            "max_restarts": self.max_retries,
            "max_task_retries": self.max_retries,
        }


def _check_estimator(estimator) -> None:
    if not isinstance(estimator, (TabICLClassifier, TabICLRegressor)):
        raise TypeError(
            f"estimator must be a tabserve TabICLClassifier or TabICLRegressor, got "
            f"{type(estimator).__name__}"
        )


def _check_count(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer of at least {minimum}, got {value!r}")


# ---------------------------------------------------------------------------------------------
# Shipping the estimator


def _saved(estimator, ship_weights: bool) -> bytes:
    """The fitted estimator as :meth:`save` writes it: kilobytes, or with the checkpoint."""
    with tempfile.TemporaryDirectory(prefix="tabserve-ray-") as folder:
        path = Path(folder) / "estimator.pkl"
        estimator.save(path, save_model_weights=ship_weights)
        return path.read_bytes()


def _loaded(cls, saved: bytes, device: str):
    """The estimator of :func:`_saved`, loaded on ``device`` (a checkpoint it embeds is written
    once into this node's tabserve cache)."""
    with tempfile.TemporaryDirectory(prefix="tabserve-ray-") as folder:
        path = Path(folder) / "estimator.pkl"
        path.write_bytes(saved)
        return cls.load(path, device=device)


# ---------------------------------------------------------------------------------------------
# Predicting a dataset


@dataclass(frozen=True)
class _PredictJob:
    """What every worker of :func:`predict_dataset` needs besides the estimator."""

    estimator_class: type
    method: str
    params: dict
    id_column: str
    feature_columns: tuple
    feature_names: tuple | None  # the estimator's own names (fitted on a DataFrame), else None
    output_columns: tuple
    workers: Workers


class _BatchPredictor:
    """One worker of :func:`predict_dataset` (a Ray Data actor): loads the estimator once, then
    answers batches (pyarrow tables) with their ids and predictions."""

    def __init__(self, job: _PredictJob, saved: bytes):
        self.job = job
        self.estimator = _loaded(job.estimator_class, saved, job.workers.device)
        self.estimator.set_params(n_jobs=job.workers.threads)

    def __call__(self, batch: pa.Table) -> dict:
        job = self.job
        frame = batch.select(list(job.feature_columns)).to_pandas()
        if job.feature_names is None:
            X = frame.to_numpy()
        else:
            X = frame.set_axis(list(job.feature_names), axis=1)
        answer = getattr(self.estimator, job.method)(X, **job.params)
        columns = {job.id_column: batch.column(job.id_column).to_numpy(zero_copy_only=False)}
        columns.update(zip(job.output_columns, _answer_columns(answer, job.method)))
        return columns


def _answer_columns(answer, method: str) -> list:
    """The output columns of one batch's answer, in :func:`_output_columns`' order: a dict (the
    regressor's list of ``output_type``) by kind, probabilities by class, else the answer (1-D,
    or 2-D as one tensor column: quantiles)."""
    if isinstance(answer, dict):
        return list(answer.values())
    if method == "predict_proba":
        return [np.ascontiguousarray(answer[:, k]) for k in range(answer.shape[1])]
    return [answer]


def _output_columns(estimator, method: str, output_column: str | None, params: dict) -> tuple:
    """The names of the prediction columns: ``output_column`` (default ``prediction``); for
    ``predict_proba`` one per class, ``<output_column>_<class>`` (default ``proba``); for a list
    of the regressor's ``output_type``, one per kind, ``<output_column>_<kind>``."""
    if method == "predict_proba":
        prefix = output_column or "proba"
        names = tuple(f"{prefix}_{label}" for label in estimator.classes_)
    else:
        output_type = params.get("output_type", "mean")
        name = output_column or "prediction"
        names = (
            (name,) if isinstance(output_type, str) else tuple(f"{name}_{k}" for k in output_type)
        )
    if len(set(names)) != len(names):
        raise ValueError(f"two prediction columns would share a name: {list(names)}")
    return names


def _check_method(estimator, method: str) -> None:
    methods = ("predict", "predict_proba") if is_classifier(estimator) else ("predict",)
    if method not in methods:
        raise ValueError(f"method must be one of {methods}, got {method!r}")


def _with_ids(data, id_column: str | None, batch_size: int, workers: Workers) -> tuple:
    """``(dataset, its columns but the id, the id column)``: ``data`` as a Dataset carrying an
    id column, numbered 0, 1, ... in the row order (``ROW_ID``) when ``id_column`` is None."""
    if isinstance(data, pd.DataFrame):
        if len(data) == 0:
            raise ValueError("the dataset holds no rows")
        if id_column is None:
            _check_free(ROW_ID, [str(c) for c in data.columns])
            data = data.assign(**{ROW_ID: np.arange(len(data), dtype=np.int64)})
            id_column = ROW_ID
        dataset = _from_pandas(data, batch_size, workers)
    elif isinstance(data, (str, os.PathLike)) or (
        isinstance(data, Sequence) and data and all(isinstance(p, (str, os.PathLike)) for p in data)
    ):
        dataset = _read_parquet_in_order(
            data if isinstance(data, (str, os.PathLike)) else list(data)
        )
    elif isinstance(data, ray.data.Dataset):
        dataset = data
    else:
        raise TypeError(
            f"dataset must be a ray.data.Dataset, Parquet path(s) or a pandas DataFrame, got "
            f"{type(data).__name__}"
        )
    columns = dataset.columns()
    if id_column is None:
        _check_free(ROW_ID, columns)
        dataset, id_column = _numbered(dataset), ROW_ID
    elif id_column not in columns:
        raise ValueError(f"id_column {id_column!r} is not a column of the dataset: {columns}")
    return dataset, [c for c in columns if c != id_column], id_column


def _from_pandas(frame: pd.DataFrame, batch_size: int, workers: Workers) -> ray.data.Dataset:
    # A block per batch, and one per worker at least, so that every worker gets work.
    blocks = min(max(workers.count, -(-len(frame) // batch_size)), max(len(frame), 1))
    bounds = np.linspace(0, len(frame), blocks + 1).astype(int)
    frame = frame.reset_index(drop=True)
    return ray.data.from_pandas([frame.iloc[a:b] for a, b in itertools.pairwise(bounds)])


def _read_parquet_in_order(paths) -> ray.data.Dataset:
    """``ray.data.read_parquet(paths)`` yielding its rows in the files' order (a read keeps the
    context it was made under: the caller's stays as it was)."""
    options = ray.data.DataContext.get_current().execution_options
    before, options.preserve_order = options.preserve_order, True
    try:
        return ray.data.read_parquet(paths)
    finally:
        options.preserve_order = before


@ray.remote
def _row_count(block: pa.Table) -> int:
    return block.num_rows


@ray.remote
def _with_row_numbers(block: pa.Table, first: int) -> pa.Table:
    numbers = np.arange(first, first + block.num_rows, dtype=np.int64)
    return block.append_column(ROW_ID, pa.array(numbers))


def _numbered(dataset: ray.data.Dataset) -> ray.data.Dataset:
    """``dataset`` with the column ``ROW_ID`` numbering its rows in the order it yields them,
    read whole into Ray's object store first."""
    blocks = dataset.to_arrow_refs()
    if not blocks:
        raise ValueError("the dataset holds no rows")
    counts = ray.get([_row_count.remote(block) for block in blocks])
    firsts = np.cumsum([0, *counts[:-1]]).tolist()
    return ray.data.from_arrow_refs(
        [_with_row_numbers.remote(block, first) for block, first in zip(blocks, firsts)]
    )


def _check_free(name: str, columns: list) -> None:
    if name in columns:
        raise ValueError(
            f"the dataset has a column {name!r}: name it as id_column, or rename it, so the row "
            "numbers can take that name"
        )


def _features(estimator, columns: list, feature_columns) -> tuple:
    """``(the dataset's columns the estimator reads, in its order; the estimator's own feature
    names or None)``. Default: the estimator's ``feature_names_in_`` when it was fitted on a
    DataFrame, else every column but the id, in the dataset's order."""
    names = getattr(estimator, "feature_names_in_", None)
    names = None if names is None else tuple(str(n) for n in names)
    if feature_columns is None:
        chosen = names if names is not None else tuple(columns)
    else:
        chosen = (feature_columns,) if isinstance(feature_columns, str) else tuple(feature_columns)
    missing = [c for c in chosen if c not in columns]
    if missing:
        raise ValueError(f"feature columns {missing} are not in the dataset: {columns}")
    if len(chosen) != estimator.n_features_in_:
        raise ValueError(
            f"the estimator was fitted on {estimator.n_features_in_} features, and "
            f"{len(chosen)} feature columns were chosen: {list(chosen)}; name them with "
            "feature_columns"
        )
    return chosen, names


def predict_dataset(
    estimator,
    dataset,
    *,
    feature_columns: Sequence[str] | None = None,
    id_column: str | None = None,
    method: str = "predict",
    output_column: str | None = None,
    batch_size: int = 10_000,
    num_workers: int = 1,
    num_cpus_per_worker: float = 1,
    num_gpus_per_worker: int = 0,
    max_retries: int = 3,
    ship_weights: bool = False,
    **params,
) -> ray.data.Dataset:
    """The predictions of a fitted ``estimator`` for every row of ``dataset``, as a lazy
    ``ray.data.Dataset`` (write it with ``write_parquet``, or collect a small one with
    :func:`to_pandas_in_order`).

    Args:
        estimator: a fitted tabserve ``TabICLClassifier`` or ``TabICLRegressor``; fit it with
            ``kv_cache=True`` so that no batch recomputes the train rows.
        dataset: a ``ray.data.Dataset``, Parquet path(s) (read with ``ray.data.read_parquet``)
            or a pandas DataFrame.
        feature_columns: the columns the estimator reads, in its feature order; default: its
            ``feature_names_in_`` (fitted on a DataFrame), else every column but the id. Named
            otherwise than the estimator's features, they are renamed to them in each batch.
        id_column: the column that identifies a row, carried into the output. None: a column
            ``row_id`` numbering the rows 0, 1, ... in the input's order: a DataFrame's rows,
            Parquet files' rows file after file, a Dataset's rows in the order it yields them
            (deterministic only under ``DataContext.execution_options.preserve_order``). A
            Parquet file or Dataset is then read whole into Ray's object store by this call;
            name an id column to stream.
        method: ``"predict"``, or ``"predict_proba"`` for a classifier.
        output_column: the prediction column (default ``prediction``); probabilities get one
            float32 column per class, ``<output_column>_<class>`` (default ``proba_<class>``);
            a regressor's list of ``output_type`` gets one column per kind.
        batch_size: rows per call of the estimator; each answer depends on the train rows alone,
            so the batching leaves the numbers as one call's.
        num_workers, num_cpus_per_worker, num_gpus_per_worker, max_retries: :class:`Workers`.
            On CPU workers, leave Ray a CPU beyond ``num_workers * num_cpus_per_worker`` for
            reading the input: the workers hold theirs for the whole job.
        ship_weights: send the checkpoint to the workers with the estimator (``save(...,
            save_model_weights=True)``), for nodes that do not have it at its path.
        params: the method's keyword arguments (the regressor's ``output_type``, ``alphas``).

    Returns:
        A Dataset of ``id_column`` and the prediction columns, one row per input row, in any
        order.

    Raises:
        NotFittedError: ``estimator`` is not fitted. TypeError: not a tabserve estimator, or
        ``dataset`` of another type. ValueError: a bad ``method``, count or column choice,
        or a dataset without rows.
        Errors inside a batch (data the estimator refuses) fail the job when it runs.
    """
    _check_estimator(estimator)
    check_is_fitted(estimator, "plan_")
    _check_method(estimator, method)
    _check_count("batch_size", batch_size)
    workers = Workers(num_workers, num_cpus_per_worker, num_gpus_per_worker, max_retries)
    outputs = _output_columns(estimator, method, output_column, params)
    dataset, columns, id_column = _with_ids(dataset, id_column, batch_size, workers)
    chosen, names = _features(estimator, columns, feature_columns)
    if id_column in outputs:
        raise ValueError(f"the id column {id_column!r} is also a prediction column's name")
    job = _PredictJob(
        type(estimator), method, dict(params), id_column, chosen, names, outputs, workers
    )
    with warnings.catch_warnings():
        # Ray Data takes an actor pool's restart and retry limits through ray_remote_args
        # only (deprecated since 2.59, without a named replacement; pinned below 2.64).
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        return dataset.map_batches(
            _BatchPredictor,
            fn_constructor_args=(job, _saved(estimator, ship_weights)),
            compute=ray.data.ActorPoolStrategy(size=workers.count),
            batch_size=batch_size,
            batch_format="pyarrow",
            **workers.remote_args(),
        )


def to_pandas_in_order(
    predictions: ray.data.Dataset, ids=None, *, id_column: str = ROW_ID
) -> pd.DataFrame:
    """The rows of ``predictions`` (a result of :func:`predict_dataset`) as one pandas DataFrame
    indexed by ``id_column``, in the input's order: sorted by id (the row numbers), or in the
    order of ``ids`` (the input's own id column). For results that fit in the driver's memory;
    ``.to_numpy()`` gives the predictions as an array.

    Raises:
        ValueError: an id occurs twice, or an id of ``ids`` has no row (or a row no id of ``ids``).
    """
    tables = ray.get(predictions.to_arrow_refs())
    frame = pa.concat_tables(tables).to_pandas() if tables else pd.DataFrame({id_column: []})
    frame = frame.set_index(id_column)
    if not frame.index.is_unique:
        repeated = frame.index[frame.index.duplicated()].unique()[:5].tolist()
        raise ValueError(f"ids occur more than once in the predictions: {repeated}")
    if ids is None:
        return frame.sort_index()
    order = pd.Index(ids)
    if len(order) != len(frame) or not order.isin(frame.index).all():
        raise ValueError(
            f"the predictions hold {len(frame)} rows and ids names {len(order)}, not the same ids"
        )
    return frame.loc[order]


# ---------------------------------------------------------------------------------------------
# Many tables


@dataclass(frozen=True)
class TaskFailure:
    """A task of :func:`fit_predict_many_dataset` that its estimator refused, in its slot:
    ``index`` in the job, the error's class name and message (what ``fit_predict_many``'s
    :class:`~tabserve.models.tabicl.sklearn.many.TaskError` says: ``str`` gives the same text)."""

    index: int
    error_type: str
    message: str

    def __str__(self) -> str:
        return f"task {self.index}: {self.error_type}: {self.message}"


@ray.remote
class _TableAnswerer:
    """One worker of :func:`fit_predict_many_dataset`: the estimator template, unpickled once on
    the worker's device, answering chunks of tasks."""

    def __init__(self, template: bytes, workers: Workers, method: str, params: dict):
        self.estimator = pickle.loads(template)
        self.estimator.set_params(device=workers.device, n_jobs=workers.threads)
        self.method, self.params = method, params

    def answer(self, first: int, tasks: list) -> tuple:
        """``(first, answers)``: the answers of tasks ``first``, ``first + 1``, ... in order."""
        answers: list = [None] * len(tasks)
        # The estimator names a task by its place in the call; a task that is no
        # (X_train, y_train, X_test) is refused here, so that every place maps to the job's.
        places, good = [], []
        for place, task in enumerate(tasks):
            try:
                X_train, y_train, X_test = task
            except (TypeError, ValueError):
                answers[place] = TaskFailure(
                    first + place,
                    "TypeError",
                    f"a task is a tuple (X_train, y_train, X_test), got {type(task).__name__}",
                )
                continue
            places.append(place)
            good.append((X_train, y_train, X_test))
        found = self.estimator.fit_predict_many(good, self.method, errors="return", **self.params)
        for place, answer in zip(places, found):
            if isinstance(answer, TaskError):
                # Plain data crosses processes: a TaskError does not unpickle.
                error = answer.error
                answer = TaskFailure(first + place, type(error).__name__, str(error))
            answers[place] = answer
        return first, answers


def _chunks(tasks, size: int) -> Iterator:
    """``(first task's index, list of tasks)`` of ``size`` tasks at a time."""
    source = iter(tasks)
    first = 0
    while chunk := list(itertools.islice(source, size)):
        yield first, chunk
        first += len(chunk)


def _dataset_tasks(dataset: ray.data.Dataset) -> Iterator:
    """The tasks of a Dataset of :data:`TASK_COLUMNS`, as it iterates."""
    missing = [c for c in TASK_COLUMNS if c not in dataset.columns()]
    if missing:
        raise ValueError(
            f"a Dataset of tasks needs the columns {TASK_COLUMNS}; {missing} are missing"
        )
    return (tuple(row[c] for c in TASK_COLUMNS) for row in dataset.iter_rows())


def fit_predict_many_dataset(
    estimator,
    tasks,
    method: str = "predict",
    *,
    tasks_per_call: int = 64,
    num_workers: int = 1,
    num_cpus_per_worker: float = 1,
    num_gpus_per_worker: int = 0,
    max_retries: int = 3,
    **params,
) -> Iterator:
    """``estimator.fit_predict_many(tasks, method, errors="return", **params)`` spread over
    Ray workers: yields each task's answer in task order as the workers finish, a refused task's
    :class:`TaskFailure` in its slot, while the other tasks go on.

    Args:
        estimator: the template, a tabserve ``TabICLClassifier`` or ``TabICLRegressor`` (fitted
            or not: each task is fitted on a clone). Each worker serves on its own device
            (``num_gpus_per_worker``) with its own threads, whatever the template's
            ``device`` and ``n_jobs``.
        tasks: an iterable of ``(X_train, y_train, X_test)``, read ``tasks_per_call`` at a time
            as the job goes (a generator serves more tasks than the driver holds), or a
            ``ray.data.Dataset`` with the columns :data:`TASK_COLUMNS`, one task a row, read
            on the driver in the order it iterates.
        method: ``"predict"``, or ``"predict_proba"`` for a classifier.
        tasks_per_call: tasks per worker call (one ``fit_predict_many``): more packs their
            tables better; fewer spreads a small job over more workers.
        num_workers, num_cpus_per_worker, num_gpus_per_worker, max_retries: :class:`Workers`.
        params: the method's keyword arguments (the regressor's ``output_type``, ``alphas``).

    Yields:
        Each task's answer as its own clone's ``method`` gives it, or a :class:`TaskFailure`.
        At most ``2 * num_workers`` calls are out at once; answers finished ahead of an earlier
        call's wait for it.

    Raises:
        TypeError / ValueError: a bad estimator, ``method``, count or constructor argument, at
        the call. A worker that dies more than ``max_retries`` times fails the job (a
        ``ray.exceptions.RayActorError`` from the iteration).
    """
    _check_estimator(estimator)
    estimator.fit_predict_iter((), method, errors="return", **params)  # its arguments, now
    _check_count("tasks_per_call", tasks_per_call)
    workers = Workers(num_workers, num_cpus_per_worker, num_gpus_per_worker, max_retries)
    if isinstance(tasks, ray.data.Dataset):
        tasks = _dataset_tasks(tasks)
    return _answers(
        pickle.dumps(estimator), _chunks(tasks, tasks_per_call), method, dict(params), workers
    )


def _answers(template: bytes, chunks: Iterator, method: str, params: dict, workers: Workers):
    actors = [
        _TableAnswerer.options(**workers.remote_args()).remote(template, workers, method, params)
        for _ in range(workers.count)
    ]
    pool = ActorPool(actors)

    def submit(chunk) -> None:
        pool.submit(lambda actor, c: actor.answer.remote(*c), chunk)

    finished: dict = {}  # first index -> answers, done ahead of an earlier chunk
    next_first = 0
    try:
        # One call queued behind each running one, so a worker never waits for the driver.
        for chunk in itertools.islice(chunks, 2 * workers.count):
            submit(chunk)
        while pool.has_next():
            first, answers = pool.get_next_unordered()
            finished[first] = answers
            chunk = next(chunks, None)
            if chunk is not None:
                submit(chunk)
            while next_first in finished:
                answers = finished.pop(next_first)
                yield from answers
                next_first += len(answers)
    finally:
        for actor in actors:
            ray.kill(actor)


__all__ = [
    "RAY_EXTRA",
    "ROW_ID",
    "TASK_COLUMNS",
    "TaskFailure",
    "Workers",
    "fit_predict_many_dataset",
    "predict_dataset",
    "to_pandas_in_order",
]
