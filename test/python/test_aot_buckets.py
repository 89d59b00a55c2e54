"""Ahead-of-time bucket packages (tabserve.models.tabicl.serving.aot): exported once, loaded by a served
model (also in a fresh process) they give the unpadded model's predictions without tracing or
compiling; directories made for another recipe, grid or environment are refused by name.

One bucket and the tiny model keep the AOTInductor build at about half a minute on CPU."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from cuda_helpers import requires_cuda
from tabicl_helpers import our_model, random_table
from tabserve.buckets import BucketGrid
from tabserve.models.tabicl.serving import aot
from tabserve.models.tabicl.serving.options import ServingOptions
from tabserve.models.tabicl.serving.served import ServedTabICL
from torch._dynamo.utils import counters

GRID = BucketGrid(train_rows=(16,), test_rows=(8,), features=(6,))
TABLES = 2
RECIPE = ServingOptions(buckets=True)


def _tables(count: int, seed: int):
    """Fresh tables of random shapes inside GRID's one bucket: (X, y_train)."""
    rng = random.Random(seed)
    for i in range(count):
        n_train, n_test, n_features = rng.randint(3, 16), rng.randint(1, 8), rng.randint(1, 6)
        yield random_table(seed * 100 + i, TABLES, n_train, n_test, n_features, 3)


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    directory = tmp_path_factory.mktemp("aot") / "buckets"
    served = ServedTabICL(our_model("clf", "tiny"), RECIPE, GRID)
    manifest = served.export_buckets(directory, GRID.buckets(), tables=TABLES, kv_cache=True)
    return directory, manifest


def test_loaded_packages_serve_every_table_of_their_bucket(packages):
    directory, manifest = packages
    files = ["bucket-16x8x6-b2.pt2", "build-cache-16x0x6-b2.pt2", "forward-cached-16x8x6-b2.pt2"]
    assert [entry["file"] for entry in manifest["packages"]] == files
    assert manifest["options"] == "ServingOptions(buckets=True)" and manifest["torch"] == torch.__version__
    served = ServedTabICL(our_model("clf", "tiny"), RECIPE, GRID)
    assert served.load_buckets(directory) == 3
    reference = our_model("clf", "tiny")
    counters.clear()
    tables = list(_tables(6, seed=3))
    for X, y in tables:
        assert (served(X, y) - reference(X, y)).abs().max() <= 1e-5
    assert served.aot_calls == len(tables)
    assert counters["stats"].get("unique_graphs", 0) == 0  # nothing traced
    # a batch size without a package takes the recipe's own path
    X, y = random_table(7, 1, 10, 4, 5, 3)
    assert (served(X, y) - reference(X, y)).abs().max() <= 1e-5
    assert served.aot_calls == len(tables)


def test_kv_cache_packages_build_and_predict_like_the_model(packages):
    directory, _ = packages
    served = ServedTabICL(our_model("clf", "tiny"), RECIPE, GRID)
    served.load_buckets(directory)
    reference = our_model("clf", "tiny")
    counters.clear()
    rng = random.Random(9)
    for i in range(4):
        n_train, n_test, n_features = rng.randint(3, 16), rng.randint(1, 8), rng.randint(1, 6)
        X, y = random_table(900 + i, TABLES, n_train, n_test, n_features, 3)
        cache = served.build_cache(X[:, :n_train], y)
        got = served.forward_with_cache(X[:, n_train:], cache)
        assert (got - reference(X, y)).abs().max() <= 1e-5
    assert served.aot_calls == 8  # a build and a cached forward per table, all from packages
    assert counters["stats"].get("unique_graphs", 0) == 0


def test_packages_read_strided_inputs_correctly(packages):
    """A package's kernels assume contiguous inputs; the runner makes them so (a strided view
    read as contiguous gave wrong values, NaN included, before)."""
    directory, _ = packages
    served = ServedTabICL(our_model("clf", "tiny"), RECIPE, GRID)
    served.load_buckets(directory)
    runner = next(iter(served._aot["forward"].values()))
    X, y = random_table(31, TABLES, 16, 8, 6, 3)
    wide = torch.cat([X, torch.full_like(X, float("nan"))], dim=2)[:, :, :6]  # a strided view
    n_train, n_features = torch.tensor(16), torch.tensor(6)
    assert not wide.is_contiguous()
    got = runner(wide, y, n_train, n_features)
    assert torch.equal(got, runner(X.contiguous(), y, n_train, n_features))
    assert torch.isfinite(got).all()


RESTART = textwrap.dedent(
    """
    import json, sys, time, torch
    start = time.perf_counter()
    from torch._dynamo.utils import counters
    sys.path.insert(0, sys.argv[2])
    from tabicl_helpers import our_model, random_table
    from tabserve.buckets import BucketGrid
    from tabserve.models.tabicl.serving.options import ServingOptions
    from tabserve.models.tabicl.serving.served import ServedTabICL

    served = ServedTabICL(our_model("clf", "tiny"), ServingOptions(buckets=True),
                          BucketGrid(train_rows=(16,), test_rows=(8,), features=(6,)))
    loaded = served.load_buckets(sys.argv[1])
    X, y = random_table(11, 2, 12, 5, 6, 3)
    out = served(X, y)
    print(json.dumps({"loaded": loaded, "aot_calls": served.aot_calls, "out": out.tolist(),
                      "graphs": counters["stats"].get("unique_graphs", 0),
                      "ready_s": time.perf_counter() - start}))
    """
)


def test_a_restarted_process_serves_from_the_packages(packages):
    directory, _ = packages
    tests = os.path.dirname(__file__)
    done = subprocess.run(
        [sys.executable, "-c", RESTART, str(directory), tests],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["loaded"] == 3 and report["aot_calls"] == 1 and report["graphs"] == 0
    X, y = random_table(11, 2, 12, 5, 6, 3)
    expected = our_model("clf", "tiny")(X, y)
    assert (torch.tensor(report["out"]) - expected).abs().max() <= 1e-5


def _edited(packages, tmp_path, edit):
    directory, _ = packages
    copy = tmp_path / "edited"
    shutil.copytree(directory, copy)
    manifest = json.loads((copy / aot.MANIFEST).read_text())
    edit(manifest, copy)
    (copy / aot.MANIFEST).write_text(json.dumps(manifest))
    return copy


@pytest.mark.parametrize(
    "edit, error, match",
    [
        (
            lambda m, d: m.update(options="medium"),
            aot.AotPackageError,
            "made for options 'medium'",
        ),
        (lambda m, d: m.update(torch="0.0.1"), aot.AotPackageError, "made for torch '0.0.1'"),
        (lambda m, d: m["grid"].update(features=[6, 12]), aot.AotPackageError, "made for grid"),
        (
            lambda m, d: m.update(format="other/1"),
            aot.AotPackageError,
            "not a tabserve-aot-buckets/1 manifest",
        ),
        (
            lambda m, d: (d / m["packages"][0]["file"]).unlink(),
            FileNotFoundError,
            "named by the manifest, missing",
        ),
    ],
)
def test_directories_for_something_else_are_refused_by_name(packages, tmp_path, edit, error, match):
    directory = _edited(packages, tmp_path, edit)
    served = ServedTabICL(our_model("clf", "tiny"), RECIPE, GRID)
    with pytest.raises(error, match=match):
        served.load_buckets(directory)
    assert served.aot_calls == 0 and not any(served._aot.values())  # nothing half-loaded
    X, y = random_table(5, TABLES, 9, 3, 4, 3)  # and the model still serves
    assert (served(X, y) - our_model("clf", "tiny")(X, y)).abs().max() <= 1e-5


def test_bad_manifests_and_recipes_without_buckets(packages, tmp_path):
    (tmp_path / aot.MANIFEST).write_text("{not json")
    served = ServedTabICL(our_model("clf", "tiny"), RECIPE, GRID)
    with pytest.raises(aot.AotPackageError, match="is not valid JSON"):
        served.load_buckets(tmp_path)
    with pytest.raises(FileNotFoundError):
        served.load_buckets(tmp_path / "absent")
    unpadded = ServedTabICL(our_model("clf", "tiny"), ServingOptions())
    with pytest.raises(ValueError, match="does not pad onto buckets"):
        unpadded.load_buckets(packages[0])
    with pytest.raises(ValueError, match="does not pad onto buckets"):
        unpadded.export_buckets(tmp_path / "x", GRID.buckets())


def test_autocast_recipes_export_with_their_precision(tmp_path):
    """The options' precision context is inside the exported function: a bf16 package (CPU
    autocast) answers like the bf16 eager path, within bf16 rounding, and in bf16."""
    recipe = ServingOptions(buckets=True, precision="bf16")
    exporter = ServedTabICL(our_model("clf", "tiny"), recipe, GRID)
    exporter.export_buckets(tmp_path, GRID.buckets(), tables=TABLES)
    served = ServedTabICL(our_model("clf", "tiny"), recipe, GRID)
    assert served.load_buckets(tmp_path) == 1
    for X, y in _tables(3, seed=5):
        got, want = served(X, y), exporter(X, y)  # package / eager bf16
        assert got.dtype == want.dtype == torch.bfloat16
        assert (got.float() - want.float()).abs().max() <= 0.05
    assert served.aot_calls == 3 and exporter.aot_calls == 0


def test_cuda_packages_are_refused_unless_allowed(monkeypatch):
    """Loading CUDA packages crashed the process on the H200 (docs/guide/serving.md): refused by name
    unless TABSERVE_ALLOW_CUDA_AOT=1; CPU packages are never refused. (The check needs no GPU.)"""
    monkeypatch.delenv(aot.ALLOW_CUDA_ENV, raising=False)
    with pytest.raises(aot.AotPackageError, match=f"disabled.*{aot.ALLOW_CUDA_ENV}=1"):
        aot.refuse_cuda_packages("cuda:0")
    aot.refuse_cuda_packages("cpu")
    monkeypatch.setenv(aot.ALLOW_CUDA_ENV, "1")
    aot.refuse_cuda_packages(torch.device("cuda", 0))


CUDA_RECIPE = "medium"


def cuda_export(directory) -> None:
    """fp16 packages of GRID's bucket on the GPU, one-shot and KV-cached."""
    exporter = ServedTabICL(our_model("clf", "tiny").cuda(), CUDA_RECIPE, GRID)
    exporter.export_buckets(directory, GRID.buckets(), tables=TABLES, kv_cache=True)


def cuda_load_and_check(directory) -> None:
    """In a process that exported nothing: the packages replayed from a CUDA graph per bucket
    give the answers of the recipe's own (eager, captured) path within fp16 rounding, one-shot
    and KV-cached."""
    served = ServedTabICL(our_model("clf", "tiny").cuda(), CUDA_RECIPE, GRID)
    assert served.load_buckets(directory) == 3
    own_path = ServedTabICL(our_model("clf", "tiny").cuda(), CUDA_RECIPE, GRID)
    for X, y in _tables(4, seed=13):
        X, y = X.cuda(), y.cuda()
        got, want = served(X, y), own_path(X, y)
        assert (got.float() - want.float()).abs().max() <= 2e-2
        n_train = y.shape[1]
        cached = served.forward_with_cache(X[:, n_train:], served.build_cache(X[:, :n_train], y))
        assert (cached.float() - want.float()).abs().max() <= 2e-2
    assert served.aot_calls == 12 and served.captures >= 1 and own_path.aot_calls == 0


class AotLoadCrash(Exception):
    """The child process that loads CUDA packages died of a segmentation fault."""


def _child(function: str, directory) -> subprocess.CompletedProcess:
    code = f"import test_aot_buckets as t; t.{function}({str(directory)!r})"
    return subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=os.path.dirname(__file__),
        env={**os.environ, aot.ALLOW_CUDA_ENV: "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.cuda
@requires_cuda
@pytest.mark.xfail(
    raises=AotLoadCrash,
    strict=True,
    reason="torch 2.11's aoti_load_package crashed loading these packages on the H200 "
    "(docs/guide/serving.md); passing here means the refusal in aot.load can be lifted",
)
def test_cuda_packages_exported_then_loaded_in_a_fresh_process(tmp_path):
    """Export and load each in a child process with the CUDA refusal lifted: a crash must fail
    this test, not end the test run. The export must work (it did on the H200); only a
    segmentation fault of the loading process is the known failure (any other error fails)."""
    exported = _child("cuda_export", tmp_path)
    if exported.returncode != 0:
        pytest.fail(f"export: exit {exported.returncode}\n{exported.stderr[-3000:]}")
    loaded = _child("cuda_load_and_check", tmp_path)
    if loaded.returncode == -signal.SIGSEGV:
        raise AotLoadCrash(loaded.stderr[-3000:])
    if loaded.returncode != 0:
        pytest.fail(f"load: exit {loaded.returncode}\n{loaded.stderr[-3000:]}")


def test_packages_loaded_after_captures_replace_those_graphs(packages, monkeypatch):
    """With CUDA graphs (the CPU stand-in of test_padded_inference), a bucket captured before
    its package was loaded is captured again from the package instead of replaying the old graph."""
    from tabserve.models.tabicl.serving import served as serving
    from test_padded_inference import _ReplayOnCPU

    monkeypatch.setattr(serving, "_BucketGraph", _ReplayOnCPU)
    served = ServedTabICL(our_model("clf", "tiny"), RECIPE, GRID)
    served.options = served.options.replace(cuda_graphs=True)
    (X, y), (X2, y2) = _tables(2, seed=21)
    reference = our_model("clf", "tiny")
    assert (served(X, y) - reference(X, y)).abs().max() <= 1e-5
    assert served.captures == 1 and served.aot_calls == 0
    served.load_buckets(packages[0])
    assert (served(X2, y2) - reference(X2, y2)).abs().max() <= 1e-5
    assert served.captures == 2 and served.aot_calls == 1
