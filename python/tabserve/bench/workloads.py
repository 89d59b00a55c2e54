"""Benchmark workloads (named table shapes, as data), their seeded random tables, and the default
random-weight checkpoints.

A workload is ``members`` ensemble members of one table with ``n_train`` train rows, ``n_test``
test rows and ``n_features`` features, classification (``n_classes``) or regression. A stream
workload is instead ``stream`` fresh tables of seeded random shapes between ``stream_min`` and
the maxima. Inputs are random (never zeros: zeros make some kernels faster than real data).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

#: Seed of the default random-weight checkpoints (reported in every result).
CHECKPOINT_SEED = 0
#: Reference-constructor keyword arguments of a v2 model (as the parity tests build it).
V2_ARCHITECTURE = {"zero_init": False, "row_rope_interleaved": False}
#: Model sizes: the released v2 architecture, and a tiny one for the driver's own tests.
MODEL_SIZES = {
    "full": {},
    "tiny": {
        "embed_dim": 32,
        "col_num_inds": 16,
        "col_num_blocks": 1,
        "row_num_blocks": 1,
        "icl_num_blocks": 1,
    },
}


@dataclass(frozen=True)
class Workload:
    """One benchmark input shape (see the module docstring)."""

    name: str
    members: int
    n_train: int
    n_test: int
    n_features: int
    n_classes: int = 4
    task: str = "clf"
    stream: int = 0
    stream_min: tuple = (0, 0, 0)
    description: str = ""

    @property
    def is_stream(self) -> bool:
        return self.stream > 0

    @property
    def cacheable(self) -> bool:
        """Whether the KV cache serves it (not past ``max_classes``: hierarchical path)."""
        return self.task == "reg" or self.n_classes <= 10

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


WORKLOADS: tuple[Workload, ...] = (
    Workload("small", 8, 512, 64, 8, description="8 members, 512 + 64 rows, 8 features"),
    Workload("medium", 8, 1024, 256, 20, description="8 members, 1,024 + 256 rows, 20 features"),
    Workload("large", 8, 8192, 2048, 64, description="8 members, 8,192 + 2,048 rows, 64 features"),
    Workload(
        "xlarge", 8, 50000, 1000, 100, description="8 members, 50,000 + 1,000 rows, 100 features"
    ),
    Workload("many-class", 8, 1024, 256, 20, n_classes=25, description="medium shape, 25 classes"),
    Workload("regression", 8, 1024, 256, 20, task="reg", description="medium shape, regressor"),
    Workload(
        "stream",
        8,
        8192,
        2048,
        64,
        n_classes=10,
        stream=32,
        stream_min=(64, 1, 2),
        description="32 fresh tables, seeded random shapes up to large",
    ),
)

#: Reduced workloads for CPU-only machines (``--quick``).
QUICK_WORKLOADS: tuple[Workload, ...] = (
    Workload("small-quick", 2, 128, 32, 8, description="2 members, 128 + 32 rows, 8 features"),
    Workload("regression-quick", 2, 128, 32, 8, task="reg", description="small-quick, regressor"),
    Workload(
        "stream-quick",
        2,
        192,
        48,
        12,
        stream=4,
        stream_min=(32, 1, 2),
        description="4 fresh tables up to 192 + 48 rows, 12 features",
    ),
)


def workload_by_name(name: str) -> Workload:
    """The workload called ``name`` (full or quick). Raises KeyError listing the known names."""
    for workload in WORKLOADS + QUICK_WORKLOADS:
        if workload.name == name:
            return workload
    known = ", ".join(w.name for w in WORKLOADS + QUICK_WORKLOADS)
    raise KeyError(f"unknown workload {name!r}; known: {known}")


# ---------------------------------------------------------------------------------------------
# Tables


def model_tables(
    workload: Workload,
    seed: int,
    device: torch.device | str = "cpu",
    shape: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded model inputs: ``X (members, N + M, H)`` float32 and ``y_train (members, N)`` float32
    (labels 0..K-1, every class present when N >= K; standard-normal targets for regression).

    ``shape`` = ``(n_train, n_test, n_features, n_classes)`` overrides the workload's (stream).
    """
    n_train, n_test, n_features, n_classes = shape or (
        workload.n_train,
        workload.n_test,
        workload.n_features,
        workload.n_classes,
    )
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(n_features, generator=g) * 3 + 0.1
    X = torch.randn(workload.members, n_train + n_test, n_features, generator=g) * scale
    if workload.task == "reg":
        y = torch.randn(workload.members, n_train, generator=g)
    else:
        y = torch.stack(
            [torch.randperm(n_train, generator=g) % n_classes for _ in range(workload.members)]
        ).float()
    return X.to(device), y.to(device)


def host_table(workload: Workload, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seeded host data for the estimators: ``X_train (N, H)``, ``y_train (N,)``, ``X_test (M, H)``."""
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.1, 3.1, workload.n_features).astype(np.float32)
    X = rng.standard_normal((workload.n_train + workload.n_test, workload.n_features))
    X = (X * scale).astype(np.float32)
    if workload.task == "reg":
        y = (X[: workload.n_train, 0] + rng.standard_normal(workload.n_train)).astype(np.float32)
    else:
        y = rng.permutation(workload.n_train) % workload.n_classes
    return X[: workload.n_train], y, X[workload.n_train :]


def stream_shapes(workload: Workload, seed: int) -> list:
    """``workload.stream`` seeded ``(n_train, n_test, n_features, n_classes)``, log-uniform between
    ``stream_min`` and the workload's maxima (classes 2..n_classes, never more than train rows)."""
    rng = np.random.default_rng(seed)
    lows = workload.stream_min
    highs = (workload.n_train, workload.n_test, workload.n_features)
    shapes = []
    for _ in range(workload.stream):
        dims = [
            int(np.rint(np.exp(rng.uniform(np.log(max(lo, 1)), np.log(hi)))))
            for lo, hi in zip(lows, highs)
        ]
        classes = int(rng.integers(2, workload.n_classes + 1))
        shapes.append((dims[0], dims[1], dims[2], min(classes, dims[0])))
    return shapes


# ---------------------------------------------------------------------------------------------
# Checkpoints

#: What to install for the reference cells, the random-weight checkpoints and the plot.
BENCH_EXTRA = "pip install 'tabserve[bench]'"


def make_checkpoint(
    task: str, path: str | Path, size: str = "full", seed: int = CHECKPOINT_SEED
) -> Path:
    """Writes a random-weight v2 checkpoint in the reference file format and returns its path.

    Built by the reference constructor ``tabicl.TabICL`` (``zero_init=False``,
    ``row_rope_interleaved=False``) under ``torch.manual_seed(seed)``, then every weight but the
    RoPE frequencies gets seeded Gaussian noise (std 0.05) so none keeps a trivial initial value;
    the same recipe as the parity tests (``test/python/tabicl_helpers.py``). ``task`` is ``"clf"``
    or ``"reg"`` (999 quantiles, bias-free LayerNorms). Raises ImportError without tabicl,
    naming the extra that brings it.
    """
    try:
        from tabicl._model.tabicl import TabICL
    except ImportError as error:
        raise ImportError(
            f"random-weight checkpoints are built with tabicl 2.2.0's model: {BENCH_EXTRA}"
        ) from error

    config = dict(V2_ARCHITECTURE, **MODEL_SIZES[size])
    if task == "reg":
        config.update(max_classes=0, bias_free_ln=True, num_quantiles=999 if size == "full" else 99)
    torch.manual_seed(seed)
    model = TabICL(**config).eval()
    noise = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("rope.freqs"):
                p.add_(torch.randn(p.shape, generator=noise) * 0.05)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The reference training code saves every constructor argument as the config.
    keys = [k for k in inspect.signature(TabICL.__init__).parameters if k != "self"]
    payload = {
        "config": {k: getattr(model, k, False) for k in keys},
        "state_dict": model.state_dict(),
    }
    torch.save(payload, path)
    return path


def add_checkpoint_arguments(parser) -> None:
    """The driver's checkpoint options, every suite's: ``--checkpoint``,
    ``--regressor-checkpoint`` (the ``given`` of :func:`checkpoints_for`) and ``--model-size``."""
    parser.add_argument(
        "--checkpoint", type=Path, help="classifier checkpoint (.ckpt / .safetensors)"
    )
    parser.add_argument("--regressor-checkpoint", type=Path, help="regressor checkpoint")
    parser.add_argument(
        "--model-size",
        choices=tuple(MODEL_SIZES),
        default="full",
        help="size of the random-weight checkpoints made without --checkpoint",
    )


def checkpoints_for(
    tasks, given: dict, run_dir: Path, size: str, prog: str
) -> tuple[dict[str, Path], str]:
    """The checkpoint of each task in ``tasks`` (``"clf"``, ``"reg"``) and a sentence saying where
    they came from.

    ``given``: ``{task: path or None}`` from ``--checkpoint`` / ``--regressor-checkpoint``; a task
    without one gets a random-weight checkpoint of ``size`` (:func:`make_checkpoint`) in
    ``run_dir``. Raises SystemExit, naming ``prog`` and the flag, when such a checkpoint is needed
    and tabicl is not installed.
    """
    import importlib.util

    paths, notes = {}, []
    for task in sorted(tasks):
        if given.get(task) is not None:
            paths[task] = Path(given[task])
            notes.append(f"{task}: {given[task]}")
            continue
        if importlib.util.find_spec("tabicl") is None:
            flag = "--checkpoint" if task == "clf" else "--regressor-checkpoint"
            raise SystemExit(
                f"{prog}: the random-weight checkpoints made without {flag} are built with "
                f"tabicl 2.2.0's model ({BENCH_EXTRA}); give {flag} to benchmark a checkpoint "
                "you have"
            )
        paths[task] = make_checkpoint(task, Path(run_dir) / f"random-{task}.ckpt", size)
        notes.append(
            f"{task}: RANDOM weights ({size} v2 architecture, seed {CHECKPOINT_SEED}; timings "
            "are real, accuracy is agreement only)"
        )
    return paths, "; ".join(notes)
