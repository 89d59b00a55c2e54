"""Shared helpers for the TabICLv2 tests: reference checkpoints with random weights, random tables.

Checkpoints are written in the reference file format (``torch.save({"config", "state_dict"})``)
by the reference constructor ``tabicl.TabICL`` with ``zero_init=False`` and
``row_rope_interleaved=False``; every weight then gets seeded Gaussian noise so that no parameter
keeps a trivial initial value (e.g. QASSMax's zero-initialised query MLP).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch
from cuda_helpers import requires_cuda

_PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"
try:
    import tabserve  # noqa: F401
except ImportError:
    # The compiled extension is not built: load the pure-PyTorch model package on its own.
    _pkg = types.ModuleType("tabserve")
    _pkg.__path__ = [str(_PYTHON_DIR / "tabserve")]
    sys.modules["tabserve"] = _pkg

tabicl = pytest.importorskip("tabicl")
from tabicl import InferenceConfig
from tabicl._model.tabicl import TabICL

#: Full keyword set written by the reference training code into a checkpoint's config.
REFERENCE_CONFIG_KEYS = [
    "max_classes",
    "num_quantiles",
    "embed_dim",
    "col_num_blocks",
    "col_nhead",
    "col_num_inds",
    "col_affine",
    "col_feature_group",
    "col_feature_group_size",
    "col_target_aware",
    "col_ssmax",
    "row_num_blocks",
    "row_nhead",
    "row_num_cls",
    "row_rope_base",
    "row_rope_interleaved",
    "icl_num_blocks",
    "icl_nhead",
    "icl_ssmax",
    "ff_factor",
    "dropout",
    "activation",
    "norm_first",
    "bias_free_ln",
    "zero_init",
    "recompute",
]

#: Model sizes: the released v2 architecture, and a small one for broad, fast sweeps.
SIZES = {
    "full": {},
    "tiny": {
        "embed_dim": 32,
        "col_num_inds": 16,
        "col_num_blocks": 2,
        "row_num_blocks": 2,
        "icl_num_blocks": 2,
    },
}

_TMP = Path(tempfile.mkdtemp(prefix="tabserve-tabicl-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)


def reference_config(task: str = "clf", size: str = "full") -> dict:
    """Constructor kwargs of a v2 classifier (``clf``) or regressor (``reg``) of the given size."""
    config = dict(zero_init=False, row_rope_interleaved=False, **SIZES[size])
    if task == "reg":
        config.update(max_classes=0, bias_free_ln=True, num_quantiles=999 if size == "full" else 99)
    return config


def build_reference_model(task: str = "clf", size: str = "full", seed: int = 0) -> TabICL:
    """Reference ``TabICL`` with seeded random weights (eval mode)."""
    torch.manual_seed(seed)
    model = TabICL(**reference_config(task, size)).eval()
    noise = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("rope.freqs"):
                p.add_(torch.randn(p.shape, generator=noise) * 0.05)
    return model


def checkpoint_payload(model: TabICL) -> dict:
    """What the reference training code saves: ``config`` (all constructor kwargs) + ``state_dict``."""
    return {
        "config": {k: getattr(model, k, False) for k in REFERENCE_CONFIG_KEYS},
        "state_dict": model.state_dict(),
    }


@functools.cache
def reference_checkpoint(task: str = "clf", size: str = "full", seed: int = 0) -> Path:
    """Path of a reference-format checkpoint (written once per process)."""
    path = _TMP / f"tabicl-{task}-{size}-{seed}.ckpt"
    torch.save(checkpoint_payload(build_reference_model(task, size, seed)), path)
    return path


@functools.cache
def reference_model(task: str = "clf", size: str = "full", seed: int = 0) -> TabICL:
    """The reference module loaded from :func:`reference_checkpoint` the way its wrappers do."""
    payload = torch.load(
        reference_checkpoint(task, size, seed), map_location="cpu", weights_only=True
    )
    model = TabICL(**payload["config"])
    model.load_state_dict(payload["state_dict"])
    return model.eval()


@functools.cache
def our_model(task: str = "clf", size: str = "full", seed: int = 0):
    from tabserve.models.tabicl import TabICLv2

    return TabICLv2.from_checkpoint(reference_checkpoint(task, size, seed))


def fp32_inference_config(device: str = "cpu") -> InferenceConfig:
    """Reference inference config with AMP and FlashAttention-3 off (fp32 parity)."""
    config = InferenceConfig()
    stage = {"device": device, "use_amp": False, "use_fa3": False}
    config.update_from_dict({k: dict(stage) for k in ("COL_CONFIG", "ROW_CONFIG", "ICL_CONFIG")})
    return config


def random_table(
    seed: int, tables: int, n_train: int, n_test: int, n_features: int, n_classes: int = 0
):
    """Seeded ``X (B, N + M, H)`` and ``y_train (B, N)``: labels 0..K-1 (every class present when
    N >= K) or standard-normal targets when ``n_classes == 0``."""
    g = torch.Generator().manual_seed(seed)
    X = (
        torch.randn(tables, n_train + n_test, n_features, generator=g)
        * torch.rand(n_features, generator=g)
        * 3
    )
    if n_classes == 0:
        return X, torch.randn(tables, n_train, generator=g)
    y = torch.stack([torch.randperm(n_train, generator=g) % n_classes for _ in range(tables)])
    return X, y.float()


def device_params():
    """``cpu`` and ``cuda`` for ``pytest.mark.parametrize("device", ...)``: the CUDA case is
    marked ``cuda`` and skipped without a GPU."""
    cuda = pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            requires_cuda,
        ],
    )
    return ["cpu", cuda]


def interpreter_child(code: str, timeout: int = 300):
    """Runs ``code`` in a child Python under ``TRITON_INTERPRET=1`` (it must be set before Triton
    compiles a kernel, hence a fresh process) from the tests' folder; returns the JSON of the last
    line it printed. Fails the test with the child's stderr if it exits non-zero."""
    child = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parent,
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def bench_child_imports(module: str, spec: dict, folder: Path) -> tuple[dict, list]:
    """Runs the benchmark child ``tabserve.bench.<module>`` on ``spec`` in a fresh interpreter
    (the driver's child environment, in ``folder``); returns its result and the
    ``tabserve.models`` modules the process had loaded by its end."""
    from tabserve.bench import runner

    spec_path = folder / "spec.json"
    spec_path.write_text(json.dumps(spec))
    probe = (
        f"import json, sys\nfrom tabserve.bench import {module}\n"
        f"assert {module}.main(sys.argv[1:]) == 0\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('tabserve.models'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(spec_path)],
        env=runner.child_env(folder),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(Path(spec["result"]).read_text())
    return result, json.loads(done.stdout.strip().splitlines()[-1])

