"""tabserve's estimators as a drop-in for tabicl 2.2.0's: every reference constructor argument,
the checkpoint found through the Hugging Face Hub cache (offline, a pre-filled cache), and
pickling / saving without the network."""

from __future__ import annotations

import copy
import inspect
import io
import logging
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from cuda_helpers import requires_cuda
from tabicl_helpers import device_params, reference_checkpoint
import tabserve
from tabserve.models.tabicl import TabICLClassifier, TabICLRegressor
from tabserve.models.tabicl.sklearn.estimators import JOINED_CALL_MAX_CELLS
from tabserve.models.tabicl.sklearn.reference_args import CHECKPOINT_VERSIONS, HF_REPO

tabicl = pytest.importorskip("tabicl")


def _table(seed: int = 0, rows: int = 120, features: int = 5, classes: int = 3):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, features))
    y = rng.integers(0, classes, rows) if classes else X[:, 0] * 2 + rng.standard_normal(rows)
    return X[:90], y[:90], X[90:]


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (TabICLClassifier, tabicl.TabICLClassifier),
        (TabICLRegressor, tabicl.TabICLRegressor),
    ],
)
def test_every_reference_argument_is_taken_with_the_reference_default(ours, theirs):
    mine = inspect.signature(ours.__init__).parameters
    reference = inspect.signature(theirs.__init__).parameters
    missing = sorted(set(reference) - set(mine))
    assert not missing
    for name, parameter in reference.items():
        assert mine[name].default == parameter.default, name
    # and tabicl's way of calling them works as it is
    X, y, X_test = _table(classes=3 if ours is TabICLClassifier else 0)
    kwargs = {
        "model_path": reference_checkpoint("clf" if ours is TabICLClassifier else "reg", "tiny"),
        "n_estimators": 2, "device": "cpu", "use_amp": "auto", "use_fa3": "auto",
        "offload_mode": "auto", "disk_offload_dir": None, "n_jobs": -1, "verbose": False,
        "allow_auto_download": False,
    }  # fmt: skip
    assert ours(**kwargs).fit(X, y).predict(X_test).shape[0] == len(X_test)


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (TabICLClassifier, tabicl.TabICLClassifier),
        (TabICLRegressor, tabicl.TabICLRegressor),
    ],
)
def test_every_public_method_of_the_reference_is_there_with_its_parameters(ours, theirs):
    for name in (n for n in dir(theirs) if not n.startswith("_")):
        assert hasattr(ours, name), name
        reference = getattr(theirs, name)
        if callable(reference):
            mine = inspect.signature(getattr(ours, name)).parameters
            missing = set(inspect.signature(reference).parameters) - set(mine)
            assert not missing, (name, sorted(missing))


@pytest.mark.parametrize("kv_cache", [False, True, "repr"])
@pytest.mark.parametrize("task", ["clf", "reg"])
def test_the_plain_fitted_attributes_are_the_references(task, kv_cache):
    X, y, _ = _table(classes=3 if task == "clf" else 0)
    ours, theirs = (
        (TabICLClassifier, tabicl.TabICLClassifier)
        if task == "clf"
        else (TabICLRegressor, tabicl.TabICLRegressor)
    )
    path = reference_checkpoint(task, "tiny")
    kwargs = {"model_path": str(path), "n_estimators": 2, "device": "cpu", "kv_cache": kv_cache}
    mine = ours(**kwargs).fit(X, y)
    reference = theirs(**kwargs, allow_auto_download=False).fit(X, y)
    assert mine.cache_mode_ == getattr(reference, "cache_mode_", None)  # tabicl: None documented, unset
    for name in ("n_features_in_", "n_samples_in_", "model_config_", "device_", "model_path_"):
        assert getattr(mine, name) == type(getattr(mine, name))(getattr(reference, name)), name
    if task == "clf":
        np.testing.assert_array_equal(mine.classes_, reference.classes_)
        assert mine.n_classes_ == reference.n_classes_


@pytest.mark.parametrize(
    "params, match",
    [
        ({"use_amp": "yes"}, "use_amp must be True, False or 'auto'"),
        ({"use_fa3": 1}, "use_fa3 must be True, False or 'auto'"),
        ({"offload_mode": "cpu", "kv_cache": True}, "offload_mode='cpu' offloads one-shot"),
        ({"offload_mode": "disk"}, "offload_mode='disk' needs disk_offload_dir"),
        ({"offload_mode": "tape"}, "offload_mode must be one of"),
        ({"inference_config": {"ROW_CONFIG": {"offload": "cpu"}}}, "keeps the row stage's output"),
        ({"inference_config": {"COL_CONFIG": {"disk_dtype": torch.float16}}}, "leave it out"),
        ({"inference_config": {"ICL_CONFIG": {"device": "meta"}}}, "runs on meta, but this estimator"),
        ({"inference_config": {"COL_CONFIG": {"offload": "cpu"}}, "kv_cache": True}, "COL_CONFIG'\\]\\['offload'\\]='cpu'"),
        ({"inference_config": {"ICL_CONFIG": {"use_amp": False}}, "recipe": "large"}, "inference_config's use_amp=False"),
        ({"n_jobs": 0}, "n_jobs must be None or a non-zero integer"),
        ({"n_jobs": 2.5}, "n_jobs must be None or a non-zero integer"),
        ({"checkpoint_version": "tabicl-classifier-v1-20250208.ckpt"}, "not a TabICLv2"),
        ({"use_amp": False, "recipe": "large"}, "use_amp=False asks for fp32"),
    ],
)
def test_bad_reference_arguments_name_themselves_and_leave_the_estimator_as_it_was(params, match):
    X, y, X_test = _table()
    clf = TabICLClassifier(model_path=reference_checkpoint("clf", "tiny"), device="cpu", n_estimators=2)
    clf.fit(X, y)
    before = clf.predict_proba(X_test)
    clf.set_params(**params)
    with pytest.raises(ValueError, match=match):
        clf.fit(X, y)
    clf.set_params(**{k: TabICLClassifier().get_params()[k] for k in params})
    np.testing.assert_array_equal(clf.predict_proba(X_test), before)


@pytest.mark.parametrize(
    "params, error, match",
    [
        ({"n_estimators": 0}, ValueError, "n_estimators must be an integer >= 1, got 0"),
        ({"batch_size": 0}, ValueError, "batch_size must be None or an integer >= 1, got 0"),
        ({"test_chunk_rows": -5}, ValueError, "test_chunk_rows must be None or an integer >= 1"),
        ({"device_split": "tables"}, ValueError, "device_split must be one of"),
        ({"norm_methods": ["power", "zscore"]}, ValueError, "unsupported normalisation method 'zscore'"),
        ({"feat_shuffle_method": "sorted"}, ValueError, "feat_shuffle_method: unknown shuffle method"),
        ({"class_shuffle_method": 1}, ValueError, "class_shuffle_method: unknown shuffle method"),
        ({"outlier_threshold": -1.0}, ValueError, "outlier_threshold must be a positive finite"),
        ({"softmax_temperature": float("nan")}, ValueError, "softmax_temperature must be a positive"),
        ({"average_logits": "yes"}, TypeError, "average_logits must be True or False"),
        ({"allow_fp8": None}, TypeError, "allow_fp8 must be True or False"),
        ({"kv_cache": "yes"}, ValueError, "kv_cache must be False, True, 'kv' or 'repr'"),
        ({"random_state": 1.5}, ValueError, "random_state must be None or an integer"),
        ({"model_path": 3}, TypeError, "model_path must be None or a path, got int"),
        ({"device": "gpu0"}, ValueError, "device must name a torch device, got 'gpu0'"),
        ({"bucket_grid": (8, 16)}, TypeError, "bucket_grid must be a tabserve.BucketGrid"),
        ({"recipe": "fastest"}, ValueError, "fastest"),
        ({"verbose": "loud"}, TypeError, "verbose must be True or False"),
        ({"inference_config": {"COL_CONFIG": {"chunk": 1}}}, KeyError, "unknown setting 'chunk'"),
    ],
)
def test_every_argument_is_checked_at_the_start_of_fit_before_the_checkpoint(params, error, match, monkeypatch):
    """One check of every constructor argument when fit starts: a bad one is named before the
    data is looked at or a checkpoint is found or read."""
    from tabserve.models.tabicl.sklearn import estimators

    def no_checkpoint(*args):
        raise AssertionError("the checkpoint was looked for before the arguments were checked")

    monkeypatch.setattr(estimators, "checkpoint_path", no_checkpoint)
    clf = TabICLClassifier(**params)
    with pytest.raises(error, match=match):
        clf.fit(np.array([[np.nan, "not numeric"]], dtype=object), [0])  # the data would fail too
    assert not hasattr(clf, "n_features_in_")


def test_use_amp_false_serves_exact_where_the_default_would_serve_auto():
    """The rule on a CUDA device (no GPU needed: it only reads the estimator's device)."""
    clf = TabICLClassifier()
    clf.device_ = torch.device("cuda")
    assert clf._recipe() == "auto"
    assert clf.set_params(use_amp=False)._recipe() == "exact"
    assert clf.set_params(use_amp=True)._recipe() == "auto"
    assert clf.set_params(use_amp=False, recipe="exact")._recipe() == "exact"


def test_n_jobs_sets_torch_threads_for_the_call_and_restores_them(monkeypatch):
    X, y, X_test = _table()
    seen = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n))[1])
    before = torch.get_num_threads()
    clf = TabICLClassifier(model_path=reference_checkpoint("clf", "tiny"), device="cpu", n_estimators=2, n_jobs=1)
    clf.fit(X, y).predict_proba(X_test)
    assert seen == [1, before, 1, before] and torch.get_num_threads() == before
    seen.clear()
    clf.set_params(n_jobs=-1).predict_proba(X_test)
    assert seen == [max(1, (os.cpu_count() or 1) + 1 - 1), before]


def test_verbose_logs_on_the_tabserve_logger(caplog):
    X, y, _ = _table()
    with caplog.at_level(logging.INFO, logger="tabserve"):
        TabICLClassifier(model_path=reference_checkpoint("clf", "tiny"), device="cpu", n_estimators=2).fit(X, y)
        assert not caplog.records
        TabICLClassifier(
            model_path=reference_checkpoint("clf", "tiny"), device="cpu", n_estimators=2,
            verbose=True,
        ).fit(X, y)
    assert any("fit: exact on cpu, 90 train rows, 5 features" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "config",
    [
        {"COL_CONFIG": {"chunk": 4}},
        {"COL_CONFIG": {"safety_factor": 1}},
        {"COL_CONFIG": {"safety_factor": 1.5}},
        {"ROW_CONFIG": {"min_batch_size": 0}},
        {"ICL_CONFIG": {"offload": "tape"}},
        {"ICL_CONFIG": {"use_amp": "auto"}},
        {"COL_CONFIG": {"disk_min_free_mb": -1}},
        {"COL_CONFIG": {"device": 0}},
    ],
)
def test_a_bad_inference_config_raises_what_tabicl_raises_and_leaves_the_estimator(config):
    """tabicl's exception type for the same setting (KeyError for a name it does not know,
    TypeError for a type, ValueError for a value), a message naming the stage and setting."""
    X, y, X_test = _table()
    kwargs = {"model_path": str(reference_checkpoint("clf", "tiny")), "device": "cpu", "n_estimators": 2}
    with pytest.raises(Exception) as theirs:
        tabicl.TabICLClassifier(**kwargs, inference_config=config, allow_auto_download=False).fit(X, y)
    clf = TabICLClassifier(**kwargs).fit(X, y)
    before = clf.predict_proba(X_test)
    clf.set_params(inference_config=config)
    with pytest.raises(theirs.type) as mine:
        clf.fit(X, y)
    stage, setting = next(iter(config.items()))
    assert stage in str(mine.value)
    if isinstance(setting, dict):
        assert repr(next(iter(setting))) in str(mine.value)
    np.testing.assert_array_equal(clf.set_params(inference_config=None).predict_proba(X_test), before)


@pytest.mark.parametrize(
    "config, error, match",
    [
        ({"COL": {}}, KeyError, "unknown key 'COL'; it takes COL_CONFIG"),
        ({"ROW_CONFIG": "cpu"}, TypeError, "'ROW_CONFIG'\\] must be a dict of settings, got str"),
        ("fp32", TypeError, "inference_config must be None, a dict of stage settings or an InferenceConfig"),
    ],
)
def test_an_inference_config_tabicl_would_misread_is_refused(config, error, match):
    """Where tabicl ignores a misspelled stage or fails on a malformed one with an unrelated
    error, tabserve names it."""
    X, y, _ = _table()
    clf = TabICLClassifier(model_path=reference_checkpoint("clf", "tiny"), device="cpu", inference_config=config)
    with pytest.raises(error, match=match):
        clf.fit(X, y)
    assert not hasattr(clf, "n_features_in_")


@pytest.mark.parametrize("form", ["dict", "InferenceConfig", "tabserve.InferenceConfig"])
@pytest.mark.parametrize("task", ["clf", "reg"])
def test_inference_config_answers_as_tabicl_and_offloads_as_it_says(form, task, tmp_path, monkeypatch):
    """tabicl's three stage settings in either of its forms: the same answers as tabicl given the
    same config (fp32, within 1e-5), the column stage's output stored where the config says (a
    dict overrides the estimator's arguments; tabicl's InferenceConfig replaces them), the tuning
    settings tabserve leaves to itself accepted."""
    from tabicl._model.inference_config import InferenceConfig
    from tabserve.models.tabicl.sklearn import reference_args

    X, y, X_test = _table(seed=3, classes=4 if task == "clf" else 0)
    stages = {
        "COL_CONFIG": {"offload": "disk", "disk_offload_dir": str(tmp_path), "min_batch_size": 2,
                       "safety_factor": 0.5, "disk_flush_mb": 64, "use_async": False},
        "ROW_CONFIG": {"use_fa3": False, "async_depth": 2, "offload": False},
        "ICL_CONFIG": {"use_amp": False, "max_pinned_memory_mb": 128.0, "offload": "cpu"},
    }  # fmt: skip
    if form != "dict":  # it replaces the arguments: each stage says fp32 on the CPU
        for settings in stages.values():
            settings.update(use_amp=False, device="cpu")
    config = InferenceConfig(**stages) if form != "dict" else stages
    mine_config = tabserve.InferenceConfig(**stages) if form == "tabserve.InferenceConfig" else config
    ours, theirs = (
        (TabICLClassifier, tabicl.TabICLClassifier) if task == "clf" else (TabICLRegressor, tabicl.TabICLRegressor)
    )
    kwargs = {"model_path": str(reference_checkpoint(task, "tiny")), "device": "cpu", "n_estimators": 3,
              "offload_mode": "cpu"}  # fmt: skip
    reference = theirs(**kwargs, inference_config=config, allow_auto_download=False).fit(X, y)
    stores = []
    real = reference_args.DiskStore
    monkeypatch.setattr(reference_args, "DiskStore", lambda folder: stores.append(folder) or real(folder))
    mine = ours(**kwargs, inference_config=mine_config).fit(X, y)
    method = "predict_proba" if task == "clf" else "predict"
    np.testing.assert_allclose(
        getattr(mine, method)(X_test), getattr(reference, method)(X_test), atol=1e-5, rtol=0
    )
    assert stores and set(stores) == {str(tmp_path)}  # one per normalisation group
    assert mine.get_params()["inference_config"] is mine_config  # the argument as given


def test_tabserves_inference_config_holds_what_tabicls_holds():
    """tabserve.InferenceConfig, for code importing it beside the estimators: the settings of
    tabicl's for each stage left out or given, the same exception types for bad ones at
    construction and update, and a failed update changes nothing."""
    from tabicl._model.inference_config import InferenceConfig

    def held(config):
        return {stage: dict(getattr(config, stage).items()) for stage in ("COL_CONFIG", "ROW_CONFIG", "ICL_CONFIG")}

    given = {"COL_CONFIG": {"offload": "disk", "disk_offload_dir": "/x", "safety_factor": 0.5},
             "ICL_CONFIG": {"use_amp": False}}  # fmt: skip
    for stages in ({}, given):
        assert held(tabserve.InferenceConfig(**stages)) == held(InferenceConfig(**stages))
    update = {"ROW_CONFIG": {"async_depth": 2}, "COL_CONFIG": {"verbose": True}}
    ours, theirs = tabserve.InferenceConfig(**given), InferenceConfig(**given)
    ours.update_from_dict(update)
    theirs.update_from_dict(update)
    assert held(ours) == held(theirs)
    for bad in ({"COL_CONFIG": {"chunk": 1}}, {"ROW_CONFIG": {"safety_factor": 1}},
                {"ICL_CONFIG": {"async_depth": 0}}):  # fmt: skip
        with pytest.raises(Exception) as reference:
            InferenceConfig(**bad)
        with pytest.raises(reference.type):
            tabserve.InferenceConfig(**bad)
        before = held(ours)
        with pytest.raises(reference.type):
            ours.update_from_dict({"COL_CONFIG": {"use_fa3": False}, **bad})
        assert held(ours) == before
    with pytest.raises(KeyError, match="unknown key 'COL'"):
        ours.update_from_dict({"COL": {}})


def test_inference_config_sets_tabicls_offload_thresholds_verbose_and_precision():
    from tabicl._model.inference_config import InferenceConfig
    from tabserve.models.tabicl.sklearn.reference_args import OffloadRule, reference_settings

    clf = TabICLClassifier(device="cpu", verbose=False)
    assert reference_settings(clf).offload_rule == OffloadRule()
    clf.set_params(inference_config={
        "COL_CONFIG": {"auto_offload_threshold": 0.25, "cpu_safety_factor": 0.5,
                       "disk_safety_factor": 0.75, "disk_min_free_mb": 100},
        "ROW_CONFIG": {"verbose": True},
    })  # fmt: skip
    settings = reference_settings(clf)
    assert settings.offload_rule == OffloadRule(0.25, 0.5, 0.75, 100 << 20)
    assert settings.verbose and settings.use_amp == "auto" and settings.offload_mode == "auto"
    # tabicl's InferenceConfig ignores the arguments: its own defaults (AMP on, offload "auto")
    clf.set_params(use_amp=False, offload_mode="cpu", inference_config=InferenceConfig())
    settings = reference_settings(clf)
    assert settings.use_amp is True and settings.offload_mode == "auto" and not settings.verbose
    # one stage in fp32 serves fp32 throughout
    clf.set_params(use_amp=True, inference_config={"ROW_CONFIG": {"use_amp": False}})
    clf.device_ = torch.device("cuda")  # the rule as on a GPU (no GPU needed: it reads device_)
    assert clf._recipe() == "exact"
    assert clf.set_params(inference_config=None)._recipe() == "auto"


# ------------------------------------------------------------------ the checkpoint's source
def _prefilled_hub_cache(root, task: str):
    """A Hugging Face Hub cache holding the (random-weight) checkpoint under the released name."""
    revision = "0" * 40
    repo = root / f"models--{HF_REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    shutil.copy(reference_checkpoint(task, "tiny"), snapshot / CHECKPOINT_VERSIONS[task][0])
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return root


@pytest.mark.parametrize("task", ["clf", "reg"])
def test_model_path_none_loads_the_released_checkpoint_from_the_hub_cache_offline(tmp_path, task):
    cache = _prefilled_hub_cache(tmp_path / "hub", task)
    name = "TabICLClassifier" if task == "clf" else "TabICLRegressor"
    code = f"""
import numpy as np
from tabserve.models.tabicl import {name}
rng = np.random.default_rng(0)
X = rng.standard_normal((60, 4)); y = rng.integers(0, 2, 60) if {task == 'clf'} else X[:, 0]
a = {name}(n_estimators=2).fit(X[:40], y[:40])
b = {name}(n_estimators=2, model_path={str(reference_checkpoint(task, 'tiny'))!r}).fit(X[:40], y[:40])
out = (lambda e: e.predict_proba(X[40:]) if {task == 'clf'} else e.predict(X[40:]))
print("same", float(np.abs(out(a) - out(b)).max()), a.model_path_.name)
"""
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    child = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert f"same 0.0 {CHECKPOINT_VERSIONS[task][0]}" in child.stdout


def test_no_checkpoint_and_no_download_is_a_clear_error(tmp_path):
    code = """
import numpy as np
from tabserve.models.tabicl import TabICLClassifier
X = np.random.default_rng(0).standard_normal((20, 3)); y = np.arange(20) % 2
for kwargs in ({"allow_auto_download": False}, {"model_path": "missing.ckpt", "allow_auto_download": False}):
    try:
        TabICLClassifier(**kwargs).fit(X, y)
    except FileNotFoundError as error:
        print("refused:", error)
"""
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "empty"), HF_HUB_OFFLINE="1")
    child = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
        cwd=tmp_path,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    lines = [line for line in child.stdout.splitlines() if line.startswith("refused:")]
    assert len(lines) == 2 and all("allow_auto_download" in line for line in lines)
    assert "not in the Hugging Face Hub cache" in lines[0] and "missing.ckpt" in lines[1]


UNREACHABLE_HUB = """
import huggingface_hub, numpy as np
from tabserve.models.tabicl import TabICLClassifier
real, downloads = huggingface_hub.hf_hub_download, []
def spy(*args, **kwargs):  # a download attempt (the client retries for about 24 s offline)
    if not kwargs.get("local_files_only"):
        downloads.append(kwargs)
    return real(*args, **kwargs)
huggingface_hub.hf_hub_download = spy
X = np.random.default_rng(0).standard_normal((20, 3)); y = np.arange(20) % 2
for model_path in (None, "nested/folder/tabicl-clasifier.ckpt"):
    try:
        TabICLClassifier(model_path=model_path).fit(X, y)
    except FileNotFoundError as error:
        print("refused:", error)
print("downloads attempted:", len(downloads))
"""


@pytest.mark.parametrize("offline", [False, True], ids=["unreachable", "HF_HUB_OFFLINE"])
def test_a_checkpoint_that_cannot_be_downloaded_fails_at_once_and_says_why(tmp_path, offline):
    """Download allowed (the default) and the Hub out of reach: one request without retries
    (or none where HF_HUB_OFFLINE=1), then an error naming the path and what to change; a
    mistyped model_path leaves no folder behind."""
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "empty"), HF_ENDPOINT="http://127.0.0.1:9")
    env.pop("HF_HUB_OFFLINE", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    child = subprocess.run(
        [sys.executable, "-c", UNREACHABLE_HUB], env=env, capture_output=True, text=True,
        timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    lines = [line for line in child.stdout.splitlines() if line.startswith("refused:")]
    assert len(lines) == 2, child.stdout + child.stderr[-2000:]
    released, mistyped = lines
    assert "is not in the Hugging Face Hub cache and cannot be downloaded" in released
    assert "give model_path" in released
    assert "checkpoint not found: nested/folder/tabicl-clasifier.ckpt" in mistyped
    assert "check model_path" in mistyped
    reason = "the Hub is offline (HF_HUB_OFFLINE=1)" if offline else "the Hub answered"
    assert reason in released and reason in mistyped
    assert "downloads attempted: 0" in child.stdout
    assert not (tmp_path / "nested").exists()


def test_a_directory_as_model_path_is_named_as_one(tmp_path):
    X, y, _ = _table()
    shutil.copy(reference_checkpoint("clf", "tiny"), tmp_path / "tiny.ckpt")
    est = TabICLClassifier(model_path=tmp_path, device="cpu")
    with pytest.raises(IsADirectoryError, match=r"is a directory; it holds tiny\.ckpt: give the"):
        est.fit(X, y)
    assert not hasattr(est, "plan_")
    (tmp_path / "empty").mkdir()
    with pytest.raises(IsADirectoryError, match="holds no .ckpt or .safetensors file"):
        TabICLClassifier(model_path=tmp_path / "empty", device="cpu").fit(X, y)


def test_a_missing_model_path_is_downloaded_there_whole(tmp_path, monkeypatch):
    """tabicl's rule: a model_path that does not exist is where the checkpoint is downloaded to
    (its folders made); the file appears whole, under its name, or not at all."""
    import huggingface_hub
    from tabserve.models.tabicl.sklearn import reference_args

    cached = tmp_path / "hub" / "blob"
    cached.parent.mkdir()
    shutil.copy(reference_checkpoint("clf", "tiny"), cached)
    asked = []
    monkeypatch.setattr(reference_args, "_reach_hub", lambda *args: asked.append(args[0]))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda **kwargs: str(cached))
    target = tmp_path / "models" / "v2" / "classifier.ckpt"
    got = reference_args.checkpoint_path(target, True, CHECKPOINT_VERSIONS["clf"][0])
    assert got == target and target.read_bytes() == cached.read_bytes()
    assert asked == [CHECKPOINT_VERSIONS["clf"][0]]
    assert sorted(p.name for p in target.parent.iterdir()) == ["classifier.ckpt"]


# ------------------------------------------------------------------ pickling and saving
@pytest.mark.parametrize("task", ["clf", "reg"])
@pytest.mark.parametrize("kv_cache", [False, True, "repr"])
def test_a_fitted_estimator_pickles_small_and_predicts_the_same(task, kv_cache):
    X, y, X_test = _table(classes=3 if task == "clf" else 0)
    cls = TabICLClassifier if task == "clf" else TabICLRegressor
    checkpoint = reference_checkpoint(task, "full")
    est = cls(model_path=checkpoint, device="cpu", n_estimators=4, kv_cache=kv_cache)
    est.fit(X, y)
    predict = (lambda e: e.predict_proba(X_test)) if task == "clf" else (lambda e: e.predict(X_test))
    expected = predict(est)
    data = pickle.dumps(est)
    # The weights (about 110 MB) stay in the checkpoint file; the KV cache is kept, as tabicl's.
    cache_bytes = len(pickle.dumps(est.cache_))
    assert len(data) < 1_000_000 + cache_bytes < checkpoint.stat().st_size // 2
    again = pickle.loads(data)
    assert (again.cache_ is not None) == bool(kv_cache)
    np.testing.assert_allclose(predict(again), expected, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(predict(est), expected)  # pickling left the original whole


def test_the_kv_cache_is_built_batch_size_members_at_a_time_across_the_normalisation_groups():
    # 8 members in two normalisation groups of 4: one cache of 8 members, or chunks of 3, 3 and 2
    # with batch_size=3, each chunk holding members of both groups; the same answers as uncached.
    X, y, X_test = _table(3)
    params = {"model_path": reference_checkpoint("clf", "tiny"), "device": "cpu", "random_state": 1}
    expected = TabICLClassifier(**params).fit(X, y).predict_proba(X_test)
    for batch_size, sizes in ((8, [8]), (3, [3, 3, 2])):
        est = TabICLClassifier(**params, kv_cache=True, batch_size=batch_size).fit(X, y)
        assert [len(group) for group in est.plan_.values()] == [4, 4]
        assert [cache.icl[0][0].shape[0] for cache in est.cache_] == sizes
        np.testing.assert_allclose(est.predict_proba(X_test), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("task", ["clf", "reg"])
def test_a_one_shot_prediction_spans_the_normalisation_groups_on_a_gpu(task, monkeypatch):
    # 8 members in two normalisation groups of 4, batch_size=3: a call per group on the CPU
    # (3 + 1 members, twice), calls across the groups on a GPU (3, 3, 2): the same answers.
    X, y, X_test = _table(5)
    if task == "reg":
        y = np.random.default_rng(5).normal(size=len(y))
    cls = TabICLClassifier if task == "clf" else TabICLRegressor
    est = cls(model_path=reference_checkpoint(task, "tiny"), device="cpu", batch_size=3).fit(X, y)
    assert [len(group) for group in est.plan_.values()] == [4, 4]
    assert not est._joins_groups(len(X_test))
    sizes = []
    one_shot = cls._one_shot

    def counted(self, engine, X_m, *args, **kwargs):
        sizes.append(X_m.shape[0])
        return one_shot(self, engine, X_m, *args, **kwargs)

    monkeypatch.setattr(cls, "_one_shot", counted)
    method = "predict_proba" if task == "clf" else "predict"
    per_group = getattr(est, method)(X_test)
    assert sizes == [3, 1, 3, 1]
    sizes.clear()
    monkeypatch.setattr(cls, "_joins_groups", lambda self, n_test: True)
    np.testing.assert_allclose(getattr(est, method)(X_test), per_group, atol=1e-6, rtol=0)
    assert sizes == [3, 3, 2]
    monkeypatch.undo()
    # The policy alone (nothing runs on the GPU): across the groups up to the cell bound.
    cuda = copy.copy(est)
    cuda.devices_ = [torch.device("cuda", 0)]
    n_train, n_features = est.preprocessors_["none"].train_.shape
    largest = JOINED_CALL_MAX_CELLS // n_features - n_train
    assert cuda._joins_groups(largest) and not cuda._joins_groups(largest + 1)
    cuda.test_chunk_rows = largest  # each call holds that many test rows
    assert cuda._joins_groups(10 * largest) and not est._joins_groups(len(X_test))


def test_a_pickle_with_a_kv_cache_per_normalisation_group_is_rebuilt_or_refused():
    X, y, X_test = _table(4)
    est = TabICLClassifier(
        model_path=reference_checkpoint("clf", "tiny"), device="cpu", n_estimators=4, kv_cache=True
    ).fit(X, y)
    expected = est.predict_proba(X_test)

    def per_group(state: dict, training_data: bool) -> dict:
        fitted = torch.load(io.BytesIO(state["_fitted"]), weights_only=False)
        fitted["cache_"] = {method: [fitted["cache_"][0]] for method in est.plan_}
        fitted["cache_steps_"] = {method: 2 for method in est.plan_}
        del fitted["cache_step_"]
        if not training_data:
            fitted["y_train_"] = None
        buffer = io.BytesIO()
        torch.save(fitted, buffer)
        return dict(state, _fitted=buffer.getvalue())

    again = TabICLClassifier.__new__(TabICLClassifier)
    again.__setstate__(per_group(est.__getstate__(), training_data=True))
    assert isinstance(again.cache_, list) and not hasattr(again, "cache_steps_")
    np.testing.assert_allclose(again.predict_proba(X_test), expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="saved without its training data"):
        TabICLClassifier.__new__(TabICLClassifier).__setstate__(
            per_group(est.__getstate__(), training_data=False)
        )


def test_save_keeps_the_kv_cache_unless_asked_and_load_checks_the_kind(tmp_path):
    X, y, X_test = _table()
    est = TabICLClassifier(model_path=reference_checkpoint("clf", "tiny"), device="cpu", n_estimators=2, kv_cache=True)
    expected = est.fit(X, y).predict_proba(X_test)
    light, heavy = tmp_path / "light.pkl", tmp_path / "new" / "folder" / "heavy.pkl"
    est.save(light, save_kv_cache=False)
    est.save(heavy)  # tabicl's default keeps the cache; missing folders are made, as tabicl's
    assert heavy.stat().st_size > light.stat().st_size
    assert not hasattr(est, "_save")
    for path in (light, heavy):
        loaded = TabICLClassifier.load(path)
        assert loaded.cache_ is not None  # rebuilt from the training data when left out
        np.testing.assert_allclose(loaded.predict_proba(X_test), expected, atol=1e-6, rtol=0)
    assert sorted(p.name for p in heavy.parent.iterdir()) == ["heavy.pkl"]
    with pytest.raises(TypeError, match=r"holds a tabserve\.[\w.]+\.TabICLClassifier, not a tabserve\.TabICLRegressor$"):
        TabICLRegressor.load(light)
    theirs = tmp_path / "tabicl.pkl"
    tabicl.TabICLClassifier(model_path=str(reference_checkpoint("clf", "tiny")), device="cpu",
                            n_estimators=2, allow_auto_download=False).fit(X, y).save(theirs)  # fmt: skip
    with pytest.raises(TypeError, match=r"holds a tabicl\.[\w.]+\.TabICLClassifier, not a tabserve\.TabICLClassifier: a file tabicl saved"):
        TabICLClassifier.load(theirs)
    with pytest.raises(Exception, match="fitted|plan_"):
        TabICLClassifier(model_path=reference_checkpoint("clf", "tiny"), device="cpu").save(tmp_path / "x.pkl")


@pytest.mark.parametrize("task", ["clf", "reg"])
def test_save_model_weights_loads_without_the_checkpoint(tmp_path, monkeypatch, task):
    """tabicl's save_model_weights=True: the file alone is enough; the embedded checkpoint is
    written once into tabserve's cache directory under its SHA-256."""
    import hashlib

    monkeypatch.setenv("TABSERVE_CACHE_DIR", str(tmp_path / "cache"))
    X, y, X_test = _table(classes=3 if task == "clf" else 0)
    cls = TabICLClassifier if task == "clf" else TabICLRegressor
    checkpoint = tmp_path / "model.ckpt"
    shutil.copy(reference_checkpoint(task, "tiny"), checkpoint)
    digest = hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    est = cls(model_path=checkpoint, device="cpu", n_estimators=2).fit(X, y)
    predict = (lambda e: e.predict_proba(X_test)) if task == "clf" else (lambda e: e.predict(X_test))
    expected = predict(est)
    est.save(tmp_path / "light.pkl")
    est.save(tmp_path / "whole.pkl", save_model_weights=True)
    size = checkpoint.stat().st_size
    assert (tmp_path / "whole.pkl").stat().st_size > (tmp_path / "light.pkl").stat().st_size + size
    checkpoint.unlink()
    with pytest.raises(FileNotFoundError, match="save_model_weights=True"):
        cls.load(tmp_path / "light.pkl")
    for _ in range(2):  # the second load finds the stored copy
        loaded = cls.load(tmp_path / "whole.pkl")
        assert loaded.model_path_ == tmp_path / "cache" / "checkpoints" / f"{digest}.ckpt"
        np.testing.assert_allclose(predict(loaded), expected, atol=1e-6, rtol=0)
    assert [p.name for p in (tmp_path / "cache" / "checkpoints").iterdir()] == [f"{digest}.ckpt"]


def test_save_training_data_false_keeps_only_the_kv_cache(tmp_path):
    X, y, X_test = _table()
    kwargs = dict(model_path=reference_checkpoint("clf", "tiny"), device="cpu", n_estimators=2)
    plain = TabICLClassifier(**kwargs).fit(X, y)
    with pytest.raises(ValueError, match="save_training_data=False needs the KV cache"):
        plain.save(tmp_path / "plain.pkl", save_training_data=False)
    assert not (tmp_path / "plain.pkl").exists() and not hasattr(plain, "_save")
    cached = TabICLClassifier(kv_cache=True, **kwargs).fit(X, y)
    expected = cached.predict_proba(X_test)
    with pytest.raises(ValueError, match="save_training_data=False needs the KV cache"):
        cached.save(tmp_path / "x.pkl", save_training_data=False, save_kv_cache=False)
    cached.save(tmp_path / "private.pkl", save_training_data=False)
    loaded = TabICLClassifier.load(tmp_path / "private.pkl", device="cpu")
    assert loaded.y_train_ is None
    assert all(prep.train_ is None for prep in loaded.preprocessors_.values())
    assert all(prep.train_ is not None for prep in cached.preprocessors_.values())  # untouched
    np.testing.assert_allclose(loaded.predict_proba(X_test), expected, atol=1e-6, rtol=0)


def test_load_takes_tabicls_device_argument(tmp_path):
    X, y, X_test = _table(classes=0)
    est = TabICLRegressor(model_path=reference_checkpoint("reg", "tiny"), n_estimators=2, device="cpu")
    expected = est.fit(X, y).predict(X_test)
    est.save(tmp_path / "reg.pkl")
    loaded = TabICLRegressor.load(tmp_path / "reg.pkl", device=torch.device("cpu"))
    assert loaded.device == torch.device("cpu") and loaded.device_ == torch.device("cpu")
    np.testing.assert_allclose(loaded.predict(X_test), expected, atol=1e-6, rtol=0)
    with pytest.raises(RuntimeError, match="Expected one of|device"):
        TabICLRegressor.load(tmp_path / "reg.pkl", device="nowhere")


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("keep_training_data", [True, False])
def test_a_gpu_fit_loads_on_the_cpu(tmp_path, keep_training_data):
    """Fitted on CUDA with the default recipe (reduced precision there), loaded with
    device="cpu": the pickle holds no CUDA tensor, and the CPU serves its own default (exact),
    as a CPU fit would; the KV cache of the GPU's options is rebuilt, or, without the training
    data, the load says where the file can be loaded."""
    X, y, X_test = _table()
    kwargs = dict(model_path=reference_checkpoint("clf", "tiny"), n_estimators=2, kv_cache=True)
    gpu = TabICLClassifier(device="cuda", **kwargs).fit(X, y)
    cpu = TabICLClassifier(device="cpu", **kwargs).fit(X, y)
    path = tmp_path / "gpu.pkl"
    gpu.save(path, save_training_data=keep_training_data)
    if not keep_training_data:
        with pytest.raises(ValueError, match="load it on a cuda device"):
            TabICLClassifier.load(path, device="cpu")
        return
    loaded = TabICLClassifier.load(path, device="cpu")
    assert loaded.device_ == torch.device("cpu") and loaded.served_options_ == cpu.served_options_
    np.testing.assert_allclose(loaded.predict_proba(X_test), cpu.predict_proba(X_test), atol=1e-5, rtol=0)


def test_unpickling_without_the_checkpoint_says_which_file_is_missing(tmp_path):
    X, y, _ = _table()
    path = tmp_path / "model.ckpt"
    shutil.copy(reference_checkpoint("clf", "tiny"), path)
    data = pickle.dumps(TabICLClassifier(model_path=path, device="cpu", n_estimators=2).fit(X, y))
    path.unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.ckpt .* is not there"):
        pickle.loads(data)


# ------------------------------------------------------------------ scikit-learn conformance
#: The checks a random-weight checkpoint cannot pass: they ask for high train accuracy.
ACCURACY_CHECKS = {"check_classifiers_train", "check_regressors_train"}


def _check_results(estimator) -> dict:
    import warnings

    from sklearn.utils.estimator_checks import check_estimator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = check_estimator(estimator, on_fail=None)
    return {
        status: sorted(r["check_name"] for r in results if r["status"] == status)
        for status in ("passed", "failed")
    }


@pytest.mark.parametrize("task", ["clf", "reg"])
def test_check_estimator_passes_what_tabicl_passes_with_the_same_weights(task):
    path = str(reference_checkpoint(task, "tiny"))
    ours = (TabICLClassifier if task == "clf" else TabICLRegressor)(
        model_path=path, device="cpu", n_estimators=2
    )
    theirs = (tabicl.TabICLClassifier if task == "clf" else tabicl.TabICLRegressor)(
        model_path=path, n_estimators=2, device="cpu", allow_auto_download=False
    )
    mine, reference = _check_results(ours), _check_results(theirs)
    assert set(mine["failed"]) <= ACCURACY_CHECKS, mine["failed"]
    assert len(mine["passed"]) >= len(reference["passed"])


def test_scikit_learn_model_selection_and_pipelines():
    from sklearn.model_selection import GridSearchCV, cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(3)
    X = rng.standard_normal((90, 4))
    y = (X[:, 0] + 0.3 * rng.standard_normal(90) > 0).astype(int)
    clf = TabICLClassifier(model_path=reference_checkpoint("clf", "tiny"), device="cpu", n_estimators=2)
    scores = cross_val_score(clf, X, y, cv=3)
    assert scores.shape == (3,) and np.all((0 <= scores) & (scores <= 1))
    search = GridSearchCV(clf, {"softmax_temperature": [0.5, 0.9]}, cv=2).fit(X, y)
    assert search.best_params_["softmax_temperature"] in (0.5, 0.9)
    pipe = make_pipeline(StandardScaler(), clf).fit(X, y)
    np.testing.assert_allclose(
        pipe.predict_proba(X[:5]),
        TabICLClassifier(model_path=reference_checkpoint("clf", "tiny"), device="cpu", n_estimators=2)
        .fit(StandardScaler().fit(X).transform(X), y)
        .predict_proba(StandardScaler().fit(X).transform(X[:5])),
        atol=1e-6,
        rtol=0,
    )


# ------------------------------------------------------------------ many test rows
@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("task", ["clf", "reg"])
@pytest.mark.parametrize("kv_cache", [False, True, "repr"])
def test_test_rows_in_chunks_give_one_calls_answers(task, kv_cache, device):
    rng = np.random.default_rng(5)
    X = rng.standard_normal((200, 6))
    y = rng.integers(0, 3, 200) if task == "clf" else X[:, 0] + 0.1 * rng.standard_normal(200)
    cls = TabICLClassifier if task == "clf" else TabICLRegressor
    params = {
        "model_path": reference_checkpoint(task, "tiny"), "device": device, "n_estimators": 4,
        "kv_cache": kv_cache, "recipe": "exact",
    }  # fmt: skip
    whole = cls(**params).fit(X[:120], y[:120])
    chunked = cls(**params, test_chunk_rows=7).fit(X[:120], y[:120])
    if task == "clf":
        np.testing.assert_allclose(
            chunked.predict_proba(X[120:]), whole.predict_proba(X[120:]), atol=1e-6, rtol=0
        )
    else:
        kinds = ["mean", "quantiles"]
        a = chunked.predict(X[120:], output_type=kinds, alphas=[0.1, 0.9])
        b = whole.predict(X[120:], output_type=kinds, alphas=[0.1, 0.9])
        for kind in kinds:
            np.testing.assert_allclose(a[kind], b[kind], atol=1e-5, rtol=0)
    calls = []
    model = chunked.model_
    chunked.model_ = type("Counting", (), {
        "__getattr__": lambda self, name: getattr(model, name),
        "__call__": lambda self, *a, **k: (calls.append(a[0].shape), model(*a, **k))[1],
    })()  # fmt: skip
    if not kv_cache and task == "clf":
        chunked.predict_proba(X[120:])
        # 80 test rows in chunks of 7: 12 chunks, one call per normalisation per chunk
        assert len(calls) == 2 * 12 and max(shape[1] - 120 for shape in calls) == 7


def test_test_chunk_rows_must_be_a_positive_integer():
    X, y, X_test = _table()
    clf = TabICLClassifier(model_path=reference_checkpoint("clf", "tiny"), device="cpu", n_estimators=2).fit(X, y)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="test_chunk_rows must be None or an integer >= 1"):
            clf.set_params(test_chunk_rows=bad).predict_proba(X_test)
