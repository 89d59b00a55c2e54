"""Padded (bucketed) TabICLv2 inference equals unpadded inference (CPU, fp32).

``ServedTabICL`` with bucketed options pads every table onto its bucket (train rows, test rows
and features separately) and passes the real counts as device tensors; predictions must equal the
plain model's within 1e-6 absolute with the same argmax, one-shot and KV-cached, for classifiers
(incl. more than 10 classes) and the regressor. Small ("tiny") random-weight checkpoints.
"""

from __future__ import annotations

import copy
import random
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from cuda_helpers import requires_cuda
from tabicl_helpers import our_model, random_table, reference_checkpoint
from tabserve.buckets import BucketGrid
from tabserve.models.tabicl.network.model import TabICLv2Cache
from tabserve.models.tabicl.network.stage_kernels import STAGES
from tabserve.models.tabicl.serving import options
from tabserve.models.tabicl.serving.options import PRESETS, ServingOptions, serving_presets
from tabserve.models.tabicl.serving.served import PaddedCache, ServedTabICL, serve
from torch.utils._pytree import tree_leaves

#: Whole-model compile with dynamic shapes, flash attention first, fp16.
DYNAMIC_FLASH = ServingOptions(
    precision="fp16",
    compile="default",
    dynamic=True,
    attention={"col": "flash", "row": "flash", "icl": "flash"},
)

ATOL = 1e-6
#: Small grid: every case below lands in a bucket that pads at least one axis, or past the grid.
GRID = BucketGrid(
    train_rows=(4, 8, 16, 32, 64), test_rows=(1, 2, 4, 8, 16), features=(1, 2, 3, 4, 6, 8, 12)
)

#: (n_train, n_test, n_features, n_classes); n_classes 0 = regression.
EDGE_CASES = [
    (3, 4, 5, 3),  # one train row per class
    (2, 1, 1, 2),  # one test row, one feature, one train row per class
    (9, 1, 2, 2),  # two features; train rows just past a bucket edge (8 -> 16)
    (17, 5, 5, 4),  # features just past an edge (4 -> 6), train 16 -> 32
    (33, 9, 9, 3),  # features past 8 -> 12, test rows past 8 -> 16
    (12, 20, 7, 2),  # test rows past the grid: split into 16 + 4
    (70, 3, 4, 2),  # train rows past the grid: unpadded
    (5, 3, 13, 2),  # features past the grid: unpadded
    (40, 6, 3, 13),  # more than 10 classes (mixed radix + hierarchy)
    (60, 3, 6, 25),  # 25 classes: three hierarchy groups
    (1, 3, 4, 0),  # regression, one train row
    (9, 2, 1, 0),  # regression, one feature
    (20, 7, 7, 0),
]


def _random_cases(count: int, seed: int):
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        k = rng.choice([0, 2, 3, 5, 10])
        cases.append((rng.randint(max(k, 1), 64), rng.randint(1, 16), rng.randint(1, 12), k))
    return cases


CASES = EDGE_CASES + _random_cases(8, seed=5)


def _task(n_classes: int) -> str:
    return "reg" if n_classes == 0 else "clf"


def _served(task: str, recipe=ServingOptions(buckets=True)) -> ServedTabICL:
    return ServedTabICL(our_model(task, "tiny"), recipe, GRID)


def _assert_same(unpadded: torch.Tensor, padded: torch.Tensor, classify: bool) -> None:
    """Probabilities: 1e-6 absolute. Raw logits / quantiles (size up to a few units): 1e-6 times
    the largest magnitude, i.e. a few fp32 ulp (GEMMs of 1 vs 4 rows may take different kernels
    and sum in another order)."""
    assert padded.shape == unpadded.shape
    assert (padded - unpadded).abs().max().item() <= ATOL * max(1.0, unpadded.abs().max().item())
    if classify:
        assert torch.equal(padded.argmax(-1), unpadded.argmax(-1))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "n{}-m{}-h{}-k{}".format(*c))
def test_padded_forward_equals_unpadded(case):
    n_train, n_test, n_features, n_classes = case
    X, y = random_table(sum(case), 2, n_train, n_test, n_features, n_classes)
    model, served = our_model(_task(n_classes), "tiny"), _served(_task(n_classes))
    _assert_same(model(X, y), served(X, y), n_classes > 0)
    if n_classes:
        probs = served(X, y, return_logits=False, softmax_temperature=0.7)
        _assert_same(model(X, y, return_logits=False, softmax_temperature=0.7), probs, True)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c[3] <= 10], ids=lambda c: "n{}-m{}-h{}-k{}".format(*c)
)
def test_padded_cache_equals_unpadded(case):
    n_train, n_test, n_features, n_classes = case
    X, y = random_table(sum(case) + 1, 2, n_train, n_test, n_features, n_classes)
    model, served = our_model(_task(n_classes), "tiny"), _served(_task(n_classes))
    cache, padded_cache = (
        model.build_cache(X[:, :n_train], y),
        served.build_cache(X[:, :n_train], y),
    )
    expected = model.forward_with_cache(X[:, n_train:], cache)
    _assert_same(expected, served.forward_with_cache(X[:, n_train:], padded_cache), n_classes > 0)
    _assert_same(
        model(X, y), served.forward_with_cache(X[:, n_train:], padded_cache), n_classes > 0
    )
    if isinstance(padded_cache, PaddedCache):
        # The real part of the cache equals the unpadded cache (internal values of size ~1-10:
        # 1e-6 relative to the largest entry).
        def close(padded, unpadded):
            assert (padded - unpadded).abs().max() <= ATOL * max(1.0, unpadded.abs().max())

        for (k, v), (pk, pv) in zip(cache.icl, padded_cache.icl):
            close(pk[:, :, :n_train], k)
            close(pv[:, :, :n_train], v)
        for (k, v), (pk, pv) in zip(cache.col, padded_cache.col):
            close(pk[:, :n_features], k)
            close(pv[:, :n_features], v)
    else:
        assert GRID.bucket_for(n_train, 0, n_features) is None


def test_regressor_stats_padded():
    X, y = random_table(3, 2, 13, 5, 3)
    model, served = our_model("reg", "tiny"), _served("reg")
    kinds = ["mean", "median", "variance", "quantiles"]
    expected, got = model.predict_stats(X, y, kinds), served.predict_stats(X, y, kinds)
    for kind in kinds:
        assert (expected[kind] - got[kind]).abs().max() <= 1e-5  # variance: squares of ~1


def test_sentinel_column_still_skipped_when_padded():
    # A column whose every cell is the skip sentinel is skipped by the ISAB blocks; padding
    # (sentinel-filled, without label embedding on padded train rows) must keep that.
    X, y = random_table(4, 1, 6, 2, 3, 2)
    X[:, :, 1] = -100.0
    model, served = our_model("clf", "tiny"), _served("clf")
    _assert_same(model(X, y), served(X, y), True)


def test_feature_groups_stay_in_bounds_for_any_count_tensor():
    """The feature count reaches the grouping as a tensor nothing checks (a compiled package is
    autotuned with random inputs): it is clamped into [1, H], so the group indices never leave X
    (0 and negatives used to divide by zero / index out of bounds), and real counts are exact."""
    embedder = our_model("clf", "tiny").col_embedder
    X = torch.randn(2, 5, 6)
    for n, clamped in ((0, 1), (-4, 1), (99, 6), (4, 4)):
        out = embedder.cells(X, torch.tensor(n))
        assert torch.equal(out, embedder.cells(X, torch.tensor(clamped)))
    assert torch.equal(embedder.cells(X, torch.tensor(4))[:, :4], embedder.cells(X[..., :4]))


def test_padded_path_refuses_what_the_model_refuses():
    served = _served("clf")
    X, y = random_table(0, 1, 4, 2, 3, 2)
    with pytest.raises(ValueError, match="NaN"):
        served(torch.where(X > 0, torch.nan, X), y)
    with pytest.raises(ValueError, match="0..K-1"):
        served(X, y + 1)
    with pytest.raises(ValueError, match="does not match the cache"):
        served.forward_with_cache(X[:, 4:, :2], served.build_cache(X[:, :4], y))
    # A padded cache's prediction reads X_test's finiteness after its replays: still refused.
    X_test = X[:, 4:].clone()
    X_test[0, 1, 0] = torch.inf
    with pytest.raises(ValueError, match="X_test contains NaN or infinite values"):
        served.forward_with_cache(X_test, served.build_cache(X[:, :4], y))


def test_counts_reach_the_model_as_tensors(monkeypatch):
    served = _served("clf")
    seen = []
    real = served.model.padded_forward

    def spy(X, y, n_train, n_features):
        seen.append((X.shape, n_train, n_features))
        return real(X, y, n_train, n_features)

    served._forward = spy
    X, y = random_table(1, 2, 10, 3, 5, 2)
    served(X, y)
    ((shape, n_train, n_features),) = seen
    assert shape == (2, 16 + 4, 6)
    assert isinstance(n_train, torch.Tensor) and int(n_train) == 10
    assert isinstance(n_features, torch.Tensor) and int(n_features) == 5


def test_estimator_with_bucketed_recipe_matches_default():
    from tabserve.models.tabicl import TabICLClassifier, TabICLRegressor

    rng = np.random.default_rng(0)
    X, Xt = rng.normal(size=(37, 5)), rng.normal(size=(11, 5))
    y = rng.integers(0, 3, size=37)
    ckpt = reference_checkpoint("clf", "tiny")
    for kv in (False, True):
        common = {"n_estimators": 4, "model_path": ckpt, "device": "cpu", "kv_cache": kv}
        plain = TabICLClassifier(**common).fit(X, y)
        padded = TabICLClassifier(recipe=ServingOptions(buckets=True), bucket_grid=GRID, **common).fit(X, y)
        assert isinstance(padded.model_, ServedTabICL)
        np.testing.assert_allclose(padded.predict_proba(Xt), plain.predict_proba(Xt), atol=ATOL)
    yr = rng.normal(size=37)
    ckpt = reference_checkpoint("reg", "tiny")
    plain = TabICLRegressor(n_estimators=2, model_path=ckpt, device="cpu").fit(X, yr)
    padded = TabICLRegressor(n_estimators=2, model_path=ckpt, device="cpu", recipe=ServingOptions(buckets=True))
    np.testing.assert_allclose(padded.fit(X, yr).predict(Xt), plain.predict(Xt), atol=1e-5)


# ---------------------------------------------------------------------- options as data
def test_presets_and_options_are_validated():
    presets = serving_presets()
    assert list(presets) == list(PRESETS) and 1 <= len(presets) <= 8
    assert all(presets.values())
    assert options.resolve_options(None) == PRESETS[options.DEFAULT_PRESET].options == ServingOptions()
    assert options.resolve_options("large") is PRESETS["large"].options
    with pytest.raises(ValueError, match="did you mean 'large'"):
        options.resolve_options("lage")
    with pytest.raises(ValueError, match="unknown serving preset 'fp64-warp-speed'"):
        options.resolve_options("fp64-warp-speed")
    with pytest.raises(TypeError, match="recipe must be"):
        options.resolve_options(3)
    with pytest.raises(ValueError, match="cuda_graphs need buckets"):
        ServingOptions(cuda_graphs=True)
    with pytest.raises(ValueError, match="precision"):
        ServingOptions(precision="fp12")
    with pytest.raises(ValueError, match="no field 'fused'"):
        ServingOptions().replace(fused=True)
    with pytest.raises(ValueError, match="attention row='warp'"):
        ServingOptions(attention={"row": "warp"})
    with pytest.raises(ValueError, match="buckets must be True or False"):
        ServingOptions(buckets="yes")
    for bad in (
        {"compile": "none"},
        {"compile": "regional"},
        {"buckets": True, "compile": "default"},
    ):
        with pytest.raises(ValueError, match="dynamic shapes are a whole-model compile"):
            ServingOptions(dynamic=True, **bad)
    assert DYNAMIC_FLASH.dynamic
    # Only large-fp8 computes in fp8; a round trip through a dict gives the same options.
    assert [n for n, p in PRESETS.items() if p.options.uses_fp8] == ["large-fp8"]
    for preset in PRESETS.values():
        assert ServingOptions.from_dict(preset.options.to_dict()) == preset.options
        assert options.describe(preset.options) == preset.name
    assert options.describe(ServingOptions(buckets=True)) == "ServingOptions(buckets=True)"
    with pytest.raises(ValueError, match="CUDA graph"):
        ServedTabICL(our_model("clf", "tiny"), "medium")
    with pytest.raises(TypeError, match="grid must be a BucketGrid"):
        ServedTabICL(our_model("clf", "tiny"), None, (8, 16))
    model = our_model("clf", "tiny")
    served = serve(model, None)  # every configuration is served, exact included
    assert type(served) is ServedTabICL and served.options == ServingOptions()


def _tf32_flags() -> tuple:
    cudnn = torch.backends.cudnn
    matmul = torch.backends.cuda.matmul.fp32_precision
    return matmul, cudnn.fp32_precision, cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision


def test_precision_flags_nest_and_restore_across_threads():
    """The TF32 flags are process-wide: contexts of one thread nest as a stack, and threads that
    enter and leave in any order leave the process's own flags behind (each context restoring
    what it saw left the last thread's mode set, which torch.export refused as a mix of APIs)."""
    before = _tf32_flags()
    with options.precision_flags("tf32"):
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        with options.precision_flags("fp32"):
            assert _tf32_flags()[:2] == ("ieee", "ieee")
        assert _tf32_flags()[:2] == ("tf32", "tf32")
    assert _tf32_flags() == before
    # Thread A enters, thread B enters, A leaves first, then B: the order that leaked.
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def thread_a():
        with options.precision_flags("fp32"):
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def thread_b():
        a_in.wait(5)
        with options.precision_flags("fp32"):
            b_in.set()
            a_out.wait(5)
            seen["inside"] = _tf32_flags()[:2]  # A left: B's mode still holds

    threads = [threading.Thread(target=f) for f in (thread_a, thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["inside"] == ("ieee", "ieee")
    assert _tf32_flags() == before
    torch._C._get_cudnn_allow_tf32()  # what torch.export reads: no mix of APIs left


def _promotions(path, workloads: dict) -> None:
    import json

    document = {"schema": options.PROMOTIONS_SCHEMA, "devices": {"cpu": {"workloads": workloads}}}
    path.write_text(json.dumps(document))


def _entry(preset: str) -> dict:
    return {"preset": preset, "median_ms": 1.0}


def test_auto_options_reads_measurements(tmp_path):
    path = tmp_path / "promotions.json"
    with pytest.warns(UserWarning, match="no one_shot measurement"):
        assert options.auto_options("cpu", 100, 8, path=path) == options.DEFAULT_PRESET
    _promotions(
        path,
        {
            "small": {"one_shot": _entry("small"), "shape": {"n_train": 512, "n_features": 8}},
            "large": {
                "one_shot": _entry("large"),
                "kv_predict": _entry("exact"),
                "shape": {"n_train": 8192, "n_features": 64},
            },
            "odd": {"one_shot": _entry("retired-name"), "shape": {"n_train": 400, "n_features": 10}},
        },
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert options.auto_options("cpu", 400, 10, path=path) == "small"  # "odd" names no preset
        assert options.auto_options("cpu", 6000, 50, path=path) == "large"
        assert options.auto_options("cpu", 400, 10, kv_cache=True, path=path) == "exact"


def test_auto_options_finds_the_shipped_promotions_and_the_override(tmp_path, monkeypatch):
    """The promotions ship inside the package (found where the package is installed); the
    environment variable points elsewhere."""
    monkeypatch.delenv(options.PROMOTIONS_ENV, raising=False)
    shipped = options.promotions_path()
    assert shipped.parent == Path(options.__file__).parent and shipped.is_file()
    import json

    document = json.loads(shipped.read_text())
    assert document["schema"] == options.PROMOTIONS_SCHEMA
    for device in document["devices"].values():
        for entry in device["workloads"].values():
            for route, promoted in entry.items():
                if route != "shape":
                    assert promoted["preset"] in PRESETS, (route, promoted)
    assert options.auto_options("cpu", 128, 8, path=shipped) == "exact"
    mine = tmp_path / "mine.json"
    _promotions(mine, {"w": {"one_shot": _entry("medium"), "shape": {"n_train": 9, "n_features": 9}}})
    monkeypatch.setenv(options.PROMOTIONS_ENV, str(mine))
    assert options.promotion_files() == [mine] and options.auto_options("cpu", 9, 9) == "medium"


def _fake_gpu(monkeypatch, name: str, capability: tuple) -> None:
    """``cuda:0`` reads as a GPU called ``name`` of ``capability`` (what auto_options asks)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)


def test_auto_options_on_an_unmeasured_gpu(tmp_path, monkeypatch):
    """A GPU no file measured takes the promotions of a measured GPU of the same compute
    capability, and with none of those a GPU preset, never fp32; both warn."""
    import json

    path = tmp_path / "promotions.json"
    shape = {"n_train": 8192, "n_features": 64}
    entry = {"capability": [9, 0], "workloads": {"large": {"one_shot": _entry("large"), "shape": shape}}}
    path.write_text(json.dumps({"schema": options.PROMOTIONS_SCHEMA, "devices": {"GPU A": entry}}))
    _fake_gpu(monkeypatch, "GPU A", (9, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert options.auto_options("cuda:0", 8000, 60, path=path) == "large"  # measured
    _fake_gpu(monkeypatch, "GPU B", (9, 0))
    assert options.auto_options("cuda:0", 8000, 60, path=path) == "large"  # same capability
    _fake_gpu(monkeypatch, "GPU C", (8, 0))
    with pytest.warns(UserWarning, match="no one_shot measurement for 'GPU C'; serving 'medium'"):
        assert options.auto_options("cuda:0", 8000, 60, path=path) == options.UNMEASURED_GPU_PRESET
    assert not PRESETS[options.UNMEASURED_GPU_PRESET].options.compiled


def test_auto_options_prefers_this_machines_promotions_and_warns_on_other_versions(
    tmp_path, monkeypatch
):
    """The driver's own run on this machine (the user cache) comes before the shipped file;
    promotions measured under another torch version warn; TABSERVE_PROMOTIONS replaces both."""
    import json

    import tabserve
    from tabserve.bench import report

    monkeypatch.delenv(options.PROMOTIONS_ENV, raising=False)
    monkeypatch.setenv(options.CACHE_DIR_ENV, str(tmp_path / "cache"))
    assert options.promotion_files() == [tmp_path / "cache" / "promotions.json", options.promotions_path()]
    shape = {"name": "w", "n_train": 128, "n_features": 8}
    document = {
        "environment": {"torch": torch.__version__, "tabserve": tabserve.__version__},
        "settings": {"device": "cpu", "command": "python -m tabserve.bench"},
        "created": "t",
        "workloads": [shape],
        "promotion": {"w": {"one_shot": _entry("medium")}},
    }
    report.write_promotions(options.user_promotions_path(), document)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert options.auto_options("cpu", 128, 8) == "medium"  # not the shipped "exact"
    document["environment"]["torch"] = "0.0.1"
    report.write_promotions(options.user_promotions_path(), document)
    with pytest.warns(UserWarning, match="measured with torch 0.0.1"):
        assert options.auto_options("cpu", 128, 8) == "medium"
    mine = tmp_path / "mine.json"
    _promotions(mine, {"w": {"one_shot": _entry("small"), "shape": shape}})
    monkeypatch.setenv(options.PROMOTIONS_ENV, str(mine))
    assert options.promotion_files() == [mine] and options.auto_options("cpu", 128, 8) == "small"
    assert json.loads(options.user_promotions_path().read_text())["schema"] == options.PROMOTIONS_SCHEMA


def test_auto_options_without_fp8_takes_the_fastest_preset_without_it(tmp_path):
    """``allow_fp8=False``: where the promoted preset computes in fp8, the workload's
    ``<route>_without_fp8`` entry; a workload with neither is left out, and one whose promoted
    preset has no fp8 serves it as with fp8 allowed."""
    path = tmp_path / "promotions.json"
    _promotions(
        path,
        {
            "xlarge": {
                "one_shot": _entry("large-fp8"),
                "one_shot_without_fp8": _entry("large"),
                "kv_predict": _entry("large-fp8"),
                "shape": {"n_train": 50000, "n_features": 100},
            },
            "medium": {
                "one_shot": _entry("medium"),
                "kv_predict": _entry("medium"),
                "shape": {"n_train": 1024, "n_features": 20},
            },
        },
    )
    pick = lambda *a, **kw: options.auto_options("cpu", *a, path=path, **kw)
    assert pick(50000, 100) == "large-fp8"
    assert pick(50000, 100, allow_fp8=False) == "large"
    # KV: xlarge has no fp8-free entry, so the closest other workload serves
    assert pick(50000, 100, True, allow_fp8=False) == "medium"
    assert pick(50000, 100, True) == "large-fp8"


def test_auto_options_matches_task_and_class_regime(tmp_path):
    """Workloads of one shape but another task or class regime (medium, regression and
    many-class on the H200) must not stand in for each other; a criterion no workload meets is
    dropped."""

    def workload(preset, n_train, task="clf", n_classes=4):
        shape = {"n_train": n_train, "n_features": 20, "task": task, "n_classes": n_classes}
        return {"one_shot": _entry(preset), "shape": shape}

    path = tmp_path / "promotions.json"
    _promotions(
        path,
        {
            "medium": workload("medium", 1024),
            "many-class": workload("exact", 1024, n_classes=25),
            "regression": workload("small", 1024, task="reg"),
            "large": workload("large", 8192),
        },
    )
    pick = lambda **kw: options.auto_options("cpu", 1000, 20, path=path, **kw)
    assert pick(task="clf", n_classes=3) == "medium"
    assert pick(task="clf", n_classes=11) == "exact"
    assert pick(task="clf", n_classes=10) == "medium"  # 10 classes: the flat path
    assert pick(task="reg") == "small"
    assert pick(task="clf", n_classes=11, many_classes_above=20) == "medium"
    assert options.auto_options("cpu", 8000, 20, path=path, task="reg") == "small"
    # Only classification measured: a regressor still gets the closest shape, not an error.
    _promotions(path, {"large": workload("large", 8192), "medium": workload("medium", 1024)})
    assert pick(task="reg") == "medium"
    assert options.auto_options("cpu", 8000, 20, path=path, task="reg") == "large"
    with pytest.raises(ValueError, match="task must be"):
        options.auto_options("cpu", 1000, 20, path=path, task="regression")


# ---------------------------------------------------------------------- CUDA-graph plumbing
class _ReplayOnCPU:
    """Stands in for ``serving._BucketGraph`` on the CPU: captured input buffers updated in place
    and one output buffer overwritten by every replay, as a CUDA graph does."""

    def __init__(self, fn, inputs, static=(), pool=None):
        self.fn, self.static = fn, static
        self.inputs = [t.clone() for t in inputs]
        self.output = fn(*self.inputs, *static)

    def __call__(self, *inputs):
        for buffer, value in zip(self.inputs, inputs):
            buffer.copy_(value)
        fresh = self.fn(*self.inputs, *self.static)
        for buffer, value in zip(tree_leaves(self.output), tree_leaves(fresh)):
            buffer.copy_(value)
        return self.output


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_graph_replay_plumbing_on_cpu(monkeypatch, compiled):
    """Per-(bucket, batch) graphs, inputs copied in, outputs copied out, cached predicts keyed by
    the cache's storage: the logic of the CUDA-graph recipe, run with a CPU stand-in; also with
    the bucket cores compiled (fp16-buckets-compile-cudagraphs' route; `eager` backend)."""
    from tabserve.models.tabicl.serving import served as serving

    monkeypatch.setattr(serving, "_BucketGraph", _ReplayOnCPU)
    torch._dynamo.reset()
    model = our_model("clf", "tiny")
    recipe = ServingOptions(buckets=True, compile="default" if compiled else "none")
    served = ServedTabICL(copy.deepcopy(model), recipe.replace(compile_backend="eager"), GRID)
    served.options = served.options.replace(cuda_graphs=True)
    cases = [(10, 5, 5, 3, 2), (12, 6, 6, 3, 2), (10, 5, 5, 3, 3), (2, 1, 1, 2, 2)]
    results = []
    for seed, (n_train, n_test, n_features, n_classes, tables) in enumerate(cases):
        X, y = random_table(seed, tables, n_train, n_test, n_features, n_classes)
        got = served(X, y)
        _assert_same(model(X, y), got, True)
        results.append((got.clone(), got))
        cache = served.build_cache(X[:, :n_train], y)
        for rows in (X[:, n_train:], X[:, n_train:].flip(1)):
            expected = model.forward_with_cache(rows, model.build_cache(X[:, :n_train], y))
            _assert_same(expected, served.forward_with_cache(rows, cache), True)
    for before, returned in results:  # later replays did not overwrite earlier results
        assert torch.equal(before, returned)
    # One-shot: (16, 8, 6) x 2 tables, again, x 3 tables, (4, 1, 1); cache builds on (16, 6) x
    # {2, 3} tables and (4, 1); one cached-predict graph per cache.
    assert len(served._graphs) == 3 + 3 and len(served._cached_graphs) == 4
    assert served.captures == 3 + 3 + 4


def test_many_classes_replay_their_column_and_row_stages_on_cpu(monkeypatch):
    """More classes than max_classes with CUDA graphs (CPU stand-in): the padded column and row
    stages replay from one graph per (bucket, tables, classes) and the hierarchy runs after
    them; answers equal the unpadded model's, later replays leave earlier answers as they were,
    and the graphs are not the buckets' own."""
    from tabserve.models.tabicl.serving import served as serving

    monkeypatch.setattr(serving, "_BucketGraph", _ReplayOnCPU)
    model = our_model("clf", "tiny")
    served = ServedTabICL(copy.deepcopy(model), ServingOptions(buckets=True), GRID)
    served.options = served.options.replace(cuda_graphs=True)
    answers = []
    # 25 classes twice on one bucket (a replay), other rows of it, then 13 classes: 2 graphs
    for seed, (n_train, n_test, classes) in enumerate([(60, 3, 25), (60, 3, 25), (50, 4, 25), (40, 6, 13)]):
        X, y = random_table(seed, 2, n_train, n_test, 5, classes)
        got = served(X, y, return_logits=False)
        _assert_same(model(X, y, return_logits=False), got, True)
        answers.append((got.clone(), got))
    for before, returned in answers:
        assert torch.equal(before, returned)
    assert served.captures == 2 and len(served._hierarchy_graphs) == 2 and not served._graphs


@pytest.mark.parametrize("kv_cache", [False, True], ids=["one-shot", "kv-cache"])
def test_warmed_grid_serves_a_stream_without_new_captures_on_cpu(monkeypatch, kv_cache):
    """The serving promise with the CUDA-graph recipe's logic (CPU stand-in for the graph):
    once every bucket of a grid is warmed, seeded fresh tables of random shapes inside it, with
    2 to 4 classes, capture no new one-shot or cache-build graph and answer as the unpadded model
    does. A cached prediction replays a graph per cache (its tensors are the graph's inputs):
    one capture for each new cache, none for further predictions from it."""
    from tabserve.models.tabicl.serving import served as serving

    monkeypatch.setattr(serving, "_BucketGraph", _ReplayOnCPU)
    grid = BucketGrid(train_rows=(8, 16), test_rows=(2, 4), features=(2, 4))
    model = our_model("clf", "tiny")
    served = ServedTabICL(copy.deepcopy(model), ServingOptions(buckets=True), grid)
    served.options = served.options.replace(cuda_graphs=True)
    assert served.warm_up(tables=2, kv_cache=kv_cache) == 8
    captures, graphs = served.captures, len(served._graphs)
    assert captures >= 8  # every bucket captured its one-shot graph
    rng = np.random.default_rng(5)
    for seed in range(12):
        n_classes = int(rng.integers(2, 5))
        n_train = int(rng.integers(n_classes, 17))
        n_test, n_features = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        X, y = random_table(100 + seed, 2, n_train, n_test, n_features, n_classes)
        _assert_same(model(X, y), served(X, y), True)
        if kv_cache:
            cache = served.build_cache(X[:, :n_train], y)
            reference = model.build_cache(X[:, :n_train], y)
            for rows in (X[:, n_train:], X[:, n_train:].flip(1)):  # the second one replays
                _assert_same(
                    model.forward_with_cache(rows, reference),
                    served.forward_with_cache(rows, cache),
                    True,
                )
    new_caches = 12 if kv_cache else 0
    assert (served.captures, len(served._graphs)) == (captures + new_caches, graphs)


# ---------------------------------------------------------------------- CUDA
def _cuda_model(task: str):
    import copy

    return copy.deepcopy(our_model(task, "tiny")).cuda()


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize(
    "recipe",
    [
        ServingOptions(buckets=True),
        ServingOptions(buckets=True, cuda_graphs=True),
        ServingOptions(buckets=True, compile="default").replace(cuda_graphs=True),
        ServingOptions().replace(kv_graphs=True),
        ServingOptions(precision="fp16", compile="default").replace(precision="fp32", kv_graphs=True),
        ServingOptions().replace(shape_graphs=True),
        ServingOptions(precision="fp16", compile="default").replace(
            precision="fp32", kv_graphs=True, shape_graphs=True
        ),
    ],
    ids=[
        "eager",
        "cudagraphs",
        "compile-cudagraphs",
        "kv-graphs",
        "compile-kv-graphs",
        "shape-graphs",
        "compile-kv-shape-graphs",
    ],
)
def test_cuda_padded_equals_unpadded(recipe):
    """fp32 on the GPU (TF32 off): padded (eager, replayed CUDA graphs, replayed compiled
    kernels) against unpadded, two tables per bucket so a replay must see its new inputs, then
    KV-cached."""
    torch._dynamo.reset()
    model = _cuda_model("clf")
    served = ServedTabICL(_cuda_model("clf"), recipe, GRID)
    with options.precision_flags("fp32"):
        for seed, case in enumerate([(10, 5, 5, 3), (12, 3, 6, 3), (9, 8, 5, 2), (2, 1, 1, 2)]):
            n_train, n_test, n_features, n_classes = case
            X, y = (t.cuda() for t in random_table(seed, 2, n_train, n_test, n_features, n_classes))
            expected = model(X, y, return_logits=False)
            got = served(X, y, return_logits=False)
            assert (got - expected).abs().max() <= 1e-5
            assert torch.equal(got.argmax(-1), expected.argmax(-1))
            cache = served.build_cache(X[:, :n_train], y)
            cached = served.forward_with_cache(X[:, n_train:], cache, return_logits=False)
            assert (cached - expected).abs().max() <= 1e-5
            again = served.forward_with_cache(X[:, n_train:].flip(1), cache, return_logits=False)
            assert (again - expected.flip(1)).abs().max() <= 1e-5
    if recipe.cuda_graphs:
        # One-shot buckets (16, 8, 6) twice, (16, 4, 6), (4, 1, 1); cache builds on (16, 6) and
        # (4, 1); one cached-predict graph per cache (the flipped rows replay it).
        assert len(served._graphs) == 3 + 2 and served.captures == 3 + 2 + 4
    if recipe.kv_graphs:  # one cached-predict graph per (unpadded) cache
        assert not served._graphs and len(served._cached_graphs) == 4
    if recipe.shape_graphs:  # one one-shot graph per table shape (test rows 8, 4, 8, 1)
        assert not served._graphs and len(served._shape_graphs) == 4
    if not recipe.cuda_graphs:  # nothing else captured
        assert served.captures == len(served._cached_graphs) + len(served._shape_graphs)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize(
    "changes", [{}, {"rope_in_projection": True}], ids=["small", "small-rope-in-projection"]
)
def test_cuda_fused_fp16_kernels_pad_as_they_compute_unpadded(changes, monkeypatch):
    """The full-size model under the small preset's kernels (with and without RoPE inside the
    projection) (the fused feed-forward, here its
    resident kernel with the out-projection applied before it and the row tokens laid out after
    it, fused LayerNorm + projection with or without RoPE, the head-dim-16 kernel, QASSMax and
    prefix attention with n on the device), eager in fp16: padded
    tables against the same kernels unpadded, within the fp16 recipes' rounding (a quarter of
    the reduced-precision gate, as the driver's ``padded_recipe`` gate; a padded key or row
    read would be off by far more), every class's argmax on tables that pad all three axes. The
    compiled and captured forms of these recipes are gated the same way by the driver."""
    from tabserve.kernels import feed_forward as ff

    launches = []
    for launcher in ("_launch", "_resident"):  # the Triton and the resident kernel
        original = getattr(ff, launcher)
        monkeypatch.setattr(
            ff, launcher, lambda *a, __f=original, __n=launcher: launches.append(__n) or __f(*a)
        )
    recipe = PRESETS["small"].options.replace(
        compile="none", cuda_graphs=False, freeze=False, **changes
    )
    model = our_model("clf", "full")
    padded = ServedTabICL(copy.deepcopy(model).cuda(), recipe, GRID)
    plain = ServedTabICL(copy.deepcopy(model).cuda(), recipe.replace(buckets=False))
    worst = 0.0
    for seed, case in enumerate([(40, 6, 7, 3), (33, 9, 9, 4), (17, 5, 5, 2)]):
        n_train, n_test, n_features, n_classes = case
        X, y = (t.cuda() for t in random_table(seed, 2, n_train, n_test, n_features, n_classes))
        got = padded(X, y, return_logits=False).float()
        expected = plain(X, y, return_logits=False).float()
        assert got.shape == expected.shape == (2, n_test, n_classes)
        worst = max(worst, (got - expected).abs().max().item())
        assert (got.argmax(-1) == expected.argmax(-1)).double().mean() >= 0.9
    assert worst <= 5e-3
    # The width-128 stages' streams of these tables are short: the resident kernel serves them
    # (the ICL stage's width 512 is not a fused feed-forward width).
    assert "_resident" in launches


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("name", list(PRESETS))
def test_cuda_preset_meets_the_drivers_limits_on_small_tables(name):
    """Each preset on the GPU on small tables (the driver gates them on full-size ones): against
    the fp32 eager model
    (TF32 off) within the driver's gate limits for its precision, and, where bucketed, its
    padded tables against the same kernels eager and unpadded within the driver's padded-recipe
    limits. A reduced-precision argmax may flip on a near-tie; the driver's 99.5% agreement is
    for its hundreds of predictions, so over these ~80 a reduced recipe must agree on 90% (as
    the fused-kernel test above) while fp32 must meet the gate. Three tables share one bucket
    (every axis padded), so a compiled or captured bucket is replayed on new inputs. A recipe
    that names attention kernels or fuses operators runs on the full-size model (the
    head-dim-16 and fused kernels need its widths; the tiny model's head dim 4 is below what
    some SDPA kernels take), the others on the tiny one."""
    from tabserve.bench import gates

    torch._dynamo.reset()
    recipe = PRESETS[name].options
    size = "full" if recipe.attention or recipe.fused_ffn or recipe.fused_norm_linear else "tiny"
    reference = copy.deepcopy(our_model("clf", size)).cuda()
    served = ServedTabICL(copy.deepcopy(our_model("clf", size)).cuda(), recipe, GRID)
    if recipe.buckets:  # the same kernels, eager and unpadded
        eager = recipe.replace(buckets=False, cuda_graphs=False, compile="none", freeze=False)
        unpadded = ServedTabICL(copy.deepcopy(our_model("clf", size)).cuda(), eager)
    reduced = recipe.precision != "fp32"
    limits = gates.LIMITS["reduced" if reduced else "fp32"]
    padded_limits = gates.LIMITS["padded_recipe_reduced" if reduced else "padded_recipe_fp32"]

    def assert_within(figures: dict, limits: gates.Limits, case: tuple) -> None:
        assert figures["max_prob_diff"] <= limits.max_prob_diff, (name, case, figures)
        agree = 0.9 if reduced else limits.min_argmax_agreement
        assert figures["argmax_agreement"] >= agree, (name, case, figures)

    for seed, case in enumerate([(20, 5, 5, 3), (25, 7, 6, 2), (30, 6, 5, 4)]):  # bucket (32, 8, 6)
        X, y = (t.cuda() for t in random_table(seed, 4, *case))
        with options.precision_flags("fp32"):
            expected = reference(X, y, return_logits=False)
        got = served(X, y, return_logits=False).float()
        assert_within(gates.compare("clf", got, expected), limits, case)
        if recipe.buckets:
            plain = unpadded(X, y, return_logits=False).float()
            assert_within(gates.compare("clf", got, plain), padded_limits, case)
    if recipe.buckets:
        assert GRID.bucket_for(30, 6, 5) == GRID.bucket_for(20, 5, 5)
    if recipe.cuda_graphs:  # one bucket, one capture, replayed for the two later tables
        assert len(served._graphs) == 1


def test_stage_attention_choice_reaches_padded_attention():
    import copy

    from tabserve.models.tabicl.network.layers import Attention

    recipe = ServingOptions(buckets=True).replace(attention={"row": "efficient", "icl": "cudnn"})
    served = ServedTabICL(copy.deepcopy(our_model("clf", "tiny")), recipe, GRID)
    kernels = {
        stage: {
            m.prefix_backend
            for m in getattr(served.model, module).modules()
            if isinstance(m, Attention)
        }
        for stage, module in STAGES.items()
    }
    assert kernels == {"col": {"auto"}, "row": {"efficient"}, "icl": {"masked"}}
    # On the CPU only the math SDPA backend exists; prefix_attention computes exact maths there.
    recipe = recipe.replace(attention={"row": "math", "icl": "math"})
    served = ServedTabICL(copy.deepcopy(our_model("clf", "tiny")), recipe, GRID)
    X, y = random_table(7, 2, 10, 3, 4, 3)
    _assert_same(our_model("clf", "tiny")(X, y), served(X, y), True)


def test_estimator_auto_recipe_without_measurements_serves_exact(tmp_path, monkeypatch):
    from tabserve.models.tabicl import TabICLClassifier

    monkeypatch.setenv(options.PROMOTIONS_ENV, str(tmp_path / "none.json"))
    rng = np.random.default_rng(1)
    X, y = rng.normal(size=(20, 3)), rng.integers(0, 2, size=20)
    clf = TabICLClassifier(
        n_estimators=2, model_path=reference_checkpoint("clf", "tiny"), device="cpu", recipe="auto"
    )
    with pytest.warns(UserWarning, match="'exact'"):
        clf.fit(X, y)
    assert clf.model_.options == ServingOptions()
    clf.set_params(allow_fp8=False)  # the same lookup, fp8 presets left out
    with pytest.warns(UserWarning, match="'exact'"):
        clf.fit(X, y)
    assert clf.model_.options == ServingOptions()


def test_estimator_serves_the_promoted_preset_and_refuses_bad_recipes(tmp_path, monkeypatch):
    """``recipe="auto"`` serves what the promotions name for the closest workload (CPU: a
    bucketed preset variant cannot be named, so "exact" stands for "what was promoted"); a
    misspelled preset or a grid that is not a BucketGrid fails at fit, naming the argument, and
    leaves the estimator as it was."""
    from tabserve.models.tabicl import TabICLClassifier

    path = tmp_path / "promotions.json"
    _promotions(path, {"w": {"one_shot": _entry("exact"), "shape": {"n_train": 20, "n_features": 3}}})
    monkeypatch.setenv(options.PROMOTIONS_ENV, str(path))
    rng = np.random.default_rng(2)
    X, y = rng.normal(size=(20, 3)), rng.integers(0, 2, size=20)
    common = {"n_estimators": 2, "model_path": reference_checkpoint("clf", "tiny"), "device": "cpu"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clf = TabICLClassifier(recipe="auto", **common).fit(X, y)
    assert clf.model_.options == ServingOptions()
    before = clf.predict_proba(X)
    with pytest.raises(ValueError, match="did you mean 'exact'"):
        clf.set_params(recipe="exakt").fit(X, y)
    with pytest.raises(TypeError, match="bucket_grid must be"):
        clf.set_params(recipe=None, bucket_grid=[8, 16]).fit(X, y)
    np.testing.assert_array_equal(clf.predict_proba(X), before)


def test_unpadded_compile_recipe_runs():
    """An unpadded whole-model compile served: the model's host-side input checks are graph
    breaks there, so it compiles without ``fullgraph``; the KV-cached prediction is compiled
    too and gives the model's answers."""
    import copy

    recipe = ServingOptions(compile="default", compile_backend="eager")
    served = ServedTabICL(copy.deepcopy(our_model("clf", "tiny")), recipe)
    X, y = random_table(8, 2, 10, 3, 4, 3)
    _assert_same(our_model("clf", "tiny")(X, y), served(X, y), True)


@pytest.mark.parametrize("task", ["clf", "reg"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_kv_graphs_replay_unpadded_caches_per_test_bucket(monkeypatch, compiled, task):
    """kv_graphs (CPU stand-in for the graphs): a plain cache's prediction with its test rows
    padded onto the grid's test buckets (split past 16) equals the model's, train rows and
    features unpadded; one graph per (cache, test bucket), replayed for every later call of
    the same sizes; X_test with NaN still raises."""
    from tabserve.models.tabicl.serving import served as serving

    monkeypatch.setattr(serving, "_BucketGraph", _ReplayOnCPU)
    torch._dynamo.reset()
    model = our_model(task, "tiny")
    recipe = ServingOptions().replace(
        compile="default" if compiled else "none", compile_backend="eager"
    )
    served = ServedTabICL(copy.deepcopy(model), recipe, GRID)
    served.options = served.options.replace(kv_graphs=True)  # (CUDA-only: the stand-in replays)
    served._raw_forward_cached = served._graph_core(served.model.forward_cached_raw)
    classes = 0 if task == "reg" else 3
    X, y = random_table(11, 2, 70, 40, 13, classes)  # 70 train rows and 13 features: past GRID
    cache = served.build_cache(X[:, :70], y)
    assert type(cache) is TabICLv2Cache  # unpadded
    reference = model.build_cache(X[:, :70], y)
    for n_test in (5, 1, 16, 40, 5):  # buckets 8, 1, 16, then 16 + 16 + 8, then 8 again
        rows = X[:, 70 : 70 + n_test]
        got = served.forward_with_cache(rows, cache)
        _assert_same(model.forward_with_cache(rows, reference), got, task == "clf")
    assert served.captures == 3 and len(served._cached_graphs) == 3  # 8, 1, 16 rows
    flipped = X[:, 70:75].flip(1)  # same bucket, other rows: a replay, not a capture
    _assert_same(
        model.forward_with_cache(flipped, reference),
        served.forward_with_cache(flipped, cache),
        task == "clf",
    )
    assert served.captures == 3
    bad = X[:, 70:75].clone()
    bad[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="X_test contains NaN or infinite values"):
        served.forward_with_cache(bad, cache)
    assert served.forward_with_cache(X[:, 70:70], cache).shape[1] == 0


@pytest.mark.parametrize("task", ["clf", "reg"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_shape_graphs_replay_unpadded_tables_per_test_bucket(monkeypatch, compiled, task):
    """shape_graphs (CPU stand-in for the graphs): a table's one-shot call with its test rows
    padded onto the grid's test buckets (split past 16) equals the model's, train rows and
    features unpadded; one graph per (tables, train rows, test bucket, features), replayed for
    every later call of those sizes; the compiled core is one graph (fullgraph); bad input
    still raises (after the replay where its shape's graph exists, before any capture where
    not); more classes than max_classes run the hierarchy and capture nothing."""
    from tabserve.models.tabicl.serving import served as serving

    monkeypatch.setattr(serving, "_BucketGraph", _ReplayOnCPU)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = our_model(task, "tiny")
    recipe = ServingOptions().replace(
        compile="default" if compiled else "none", compile_backend="eager"
    )
    served = ServedTabICL(copy.deepcopy(model), recipe, GRID)
    served.options = served.options.replace(shape_graphs=True)  # (CUDA-only: the stand-in replays)
    served._raw_forward = served._graph_core(serving._one_shot_core(served.model))
    classes = 0 if task == "reg" else 3
    X, y = random_table(12, 2, 70, 40, 13, classes)  # 70 train rows and 13 features: past GRID
    for n_test in (5, 1, 16, 40, 5):  # buckets 8, 1, 16, then 16 + 16 + 8, then 8 again
        table = X[:, : 70 + n_test]
        _assert_same(model(table, y), served(table, y), task == "clf")
    assert served.captures == 3 and len(served._shape_graphs) == 3  # 8, 1, 16 test rows
    other = torch.cat([X[:, :70], X[:, 70:75].flip(1)], dim=1)  # same shape: a replay
    _assert_same(model(other, y), served(other, y), task == "clf")
    fewer = random_table(13, 2, 20, 3, 13, classes)  # another train count: another graph
    _assert_same(model(*fewer), served(*fewer), task == "clf")
    assert served.captures == 4 and not served._graphs and not served._cached_graphs
    if compiled:  # one frame, no graph break: the core a CUDA graph can capture
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
        assert not torch._dynamo.utils.counters["graph_break"]
    bad = other.clone()
    bad[1, 72, 3] = float("nan")
    with pytest.raises(ValueError, match="X contains NaN or infinite values"):
        served(bad, y)  # a captured shape: replayed, then refused
    with pytest.raises(ValueError, match="X contains NaN or infinite values"):
        served(bad[:, :, :12], y)  # 12 features: a shape still to capture, refused before it
    assert served.captures == 4
    assert served(X[:, :70], y).shape[1] == 0
    if task == "clf":  # 12 classes > max_classes = 10: the hierarchy, not a graph
        many = random_table(14, 2, 30, 4, 5, 12)
        _assert_same(model(*many), served(*many), True)
        assert served.captures == 4


def test_shape_graphs_keep_the_most_recent_shapes(monkeypatch):
    """Past MAX_SHAPE_GRAPHS table shapes, the least recently replayed graph is dropped."""
    from tabserve.models.tabicl.serving import served as serving

    monkeypatch.setattr(serving, "_BucketGraph", _ReplayOnCPU)
    monkeypatch.setattr(serving, "MAX_SHAPE_GRAPHS", 2)
    model = our_model("clf", "tiny")
    served = ServedTabICL(copy.deepcopy(model), ServingOptions(), GRID)
    served.options = served.options.replace(shape_graphs=True)
    served._raw_forward = serving._one_shot_core(served.model)
    tables = {n: random_table(n, 1, n, 2, 3, 2) for n in (4, 5, 6)}
    for n in (4, 5, 4, 6):  # 5 is the least recent when 6 comes
        _assert_same(model(*tables[n]), served(*tables[n]), True)
    assert [key[1] for key in served._shape_graphs] == [4, 6]
    assert served.captures == 3


def test_shape_graphs_recipe_rules():
    with pytest.raises(ValueError, match="shape_graphs are the unpadded tables' graphs"):
        ServingOptions(buckets=True).replace(shape_graphs=True)
    recipe = PRESETS["large"].options.replace(shape_graphs=True)
    assert recipe.shape_graphs and recipe.kv_graphs and recipe.graphs and not recipe.buckets
    with pytest.raises(ValueError, match="captures CUDA graphs; the model is on cpu"):
        ServedTabICL(copy.deepcopy(our_model("clf", "tiny")), recipe, GRID)


def test_kv_graphs_recipe_rules():
    with pytest.raises(ValueError, match="kv_graphs are the unpadded cache's graphs"):
        ServingOptions(buckets=True).replace(kv_graphs=True)
    recipe = PRESETS["large"].options
    assert recipe.kv_graphs and recipe.graphs and not recipe.cuda_graphs and not recipe.buckets
    with pytest.raises(ValueError, match="captures CUDA graphs; the model is on cpu"):
        ServedTabICL(copy.deepcopy(our_model("clf", "tiny")), recipe, GRID)


class _SlowReplayOnCPU(_ReplayOnCPU):
    """The CPU stand-in with a pause between copying the inputs in and running: without the
    served model's lock, another thread's copy lands in the buffers during the pause."""

    def __call__(self, *inputs):
        for buffer, value in zip(self.inputs, inputs):
            buffer.copy_(value)
        time.sleep(0.002)
        fresh = self.fn(*self.inputs, *self.static)
        for buffer, value in zip(tree_leaves(self.output), tree_leaves(fresh)):
            buffer.copy_(value)
        return self.output


def test_a_call_is_served_uncaptured_while_another_thread_holds_the_captures(monkeypatch):
    """While another thread holds the process's captures (a background warm-up compiling), a
    call of a new bucket runs its kernels uncaptured with the same answer; the next call after
    the release captures."""
    from tabserve.models.tabicl.serving import served as serving

    monkeypatch.setattr(serving, "_BucketGraph", _ReplayOnCPU)
    model = our_model("clf", "tiny")
    served = ServedTabICL(copy.deepcopy(model), ServingOptions(buckets=True), GRID)
    served.options = served.options.replace(cuda_graphs=True)
    X, y = random_table(31, 2, 10, 5, 5, 3)
    held, release = threading.Event(), threading.Event()

    def warm_up():
        with serving.exclusive_captures():
            held.set()
            release.wait(60)

    holder = threading.Thread(target=warm_up)
    holder.start()
    assert held.wait(60)
    rows = X[:, 10:]
    expected_cached = model.forward_with_cache(rows, model.build_cache(X[:, :10], y))
    try:
        _assert_same(model(X, y), served(X, y), True)
        cache = served.build_cache(X[:, :10], y)
        _assert_same(expected_cached, served.forward_with_cache(rows, cache), True)
        assert (served.captures, served.uncaptured, len(served._graphs)) == (0, 3, 0)
    finally:
        release.set()
        holder.join()
    _assert_same(model(X, y), served(X, y), True)
    _assert_same(expected_cached, served.forward_with_cache(rows, cache), True)
    assert served.uncaptured == 3 and len(served._graphs) == 1 and len(served._cached_graphs) == 1


def test_graph_replays_are_serialised_between_threads(monkeypatch):
    """Two host threads share one served model whose tables fall in the same bucket (one graph,
    one set of buffers): each gets its own table's predictions."""
    from tabserve.models.tabicl.serving import served as serving

    monkeypatch.setattr(serving, "_BucketGraph", _SlowReplayOnCPU)
    model = our_model("clf", "tiny")
    served = ServedTabICL(copy.deepcopy(model), ServingOptions(buckets=True), GRID)
    served.options = served.options.replace(cuda_graphs=True)
    tables = [random_table(700 + i, 2, 10, 5, 5, 3) for i in range(8)]
    expected = [model(X, y) for X, y in tables]
    got: dict = {}

    def worker(index: int) -> None:
        for i in range(index, len(tables), 2):
            got[i] = served(*tables[i])

    threads = [threading.Thread(target=worker, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert served.captures == 1
    for i, want in enumerate(expected):
        _assert_same(want, got[i], True)


@pytest.mark.cuda
@requires_cuda
def test_cuda_graph_recipe_shared_by_two_threads_on_their_own_streams():
    served = ServedTabICL(_cuda_model("clf"), ServingOptions(buckets=True, cuda_graphs=True), GRID)
    tables = [tuple(t.cuda() for t in random_table(800 + i, 2, 10, 5, 5, 3)) for i in range(12)]
    with options.precision_flags("fp32"):
        expected = [served(X, y) for X, y in tables]
        got: dict = {}

        def worker(index: int) -> None:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream), options.precision_flags("fp32"):
                for i in range(index, len(tables), 2):
                    got[i] = served(*tables[i])
            stream.synchronize()

        threads = [threading.Thread(target=worker, args=(w,)) for w in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i, want in enumerate(expected):
        assert torch.equal(want, got[i]), i


@pytest.mark.parametrize("task,classes", [("clf", 3), ("clf", 13), ("reg", 0)])
def test_zero_test_rows_predict_nothing(task, classes):
    """A table of train rows only: ``(B, 0, K)`` (``num_quantiles`` for the regressor) from the
    plain and the padded model alike, one-shot and from a KV cache (the plain model's attention
    once failed on zero queries with a reshape error)."""
    model = our_model(task, "tiny")
    served = ServedTabICL(copy.deepcopy(model), ServingOptions(buckets=True), GRID)
    X, y = random_table(6, 2, 20, 0, 4, classes)
    width = model.config.num_quantiles if task == "reg" else classes
    for f in (model, served):
        out = f(X, y)
        assert out.shape == (2, 0, width) and out.dtype == torch.float32
        if classes <= model.config.max_classes:
            cache = f.build_cache(X, y)
            assert f.forward_with_cache(X[:, :0], cache).shape == (2, 0, width)
