"""Checkpoint loading: reference ``.ckpt`` files, safetensors export, strict config validation."""

from __future__ import annotations

import json

import pytest
import torch
from tabicl_helpers import (
    REFERENCE_CONFIG_KEYS,
    build_reference_model,
    checkpoint_payload,
    fp32_inference_config,
    our_model,
    random_table,
    reference_checkpoint,
    reference_model,
)
from tabserve.models.tabicl import CheckpointError, ConfigError, TabICLv2, load_checkpoint


@pytest.mark.parametrize("task, n_keys", [("clf", 391), ("reg", 347)])
def test_full_v2_state_dict_matches_reference(task, n_keys):
    ours, ref = our_model(task, "full"), reference_model(task, "full")
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert len(ours_sd) == n_keys
    assert list(ours_sd) == list(ref_sd)
    for key, value in ref_sd.items():
        assert ours_sd[key].shape == value.shape and torch.equal(ours_sd[key], value), key
    assert ours.is_regressor == (task == "reg")


@pytest.fixture
def payload():
    return checkpoint_payload(build_reference_model("clf", "tiny", seed=3))


def _save(tmp_path, payload, name="model.ckpt"):
    path = tmp_path / name
    torch.save(payload, path)
    return path


def test_safetensors_roundtrip(tmp_path):
    ours = our_model("reg", "tiny")
    path = ours.save_safetensors(tmp_path / "reg.safetensors")
    loaded = TabICLv2.from_checkpoint(path)
    assert loaded.config == ours.config
    for key, value in ours.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    X, y = random_table(4, 2, 25, 5, 6)
    torch.testing.assert_close(loaded(X, y), ours(X, y), atol=0, rtol=0)

    # The stored config is the reference's keyword set: the reference can be built from it.
    from safetensors import safe_open
    from tabicl._model.tabicl import TabICL

    with safe_open(str(path), framework="pt") as f:
        config = json.loads(f.metadata()["tabserve.config"])
    assert set(config) == set(REFERENCE_CONFIG_KEYS)
    ref = TabICL(**config).eval()
    ref.load_state_dict(load_checkpoint(path)[1])
    with torch.no_grad():
        expected = ref(X, y, inference_config=fp32_inference_config())
    torch.testing.assert_close(loaded(X, y), expected, atol=1e-5, rtol=0)


def test_from_checkpoint_device_argument():
    model = TabICLv2.from_checkpoint(reference_checkpoint("clf", "tiny"), device="cpu")
    assert next(model.parameters()).device.type == "cpu" and not model.training


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.pop("row_rope_interleaved"), r"lacks \['row_rope_interleaved'\]"),
        (lambda c: c.pop("max_classes"), "lacks"),
        (lambda c: c.update(row_rope_interleaved=True), "not a TabICLv2 checkpoint"),
        (
            lambda c: c.update(
                col_affine=True,
                col_feature_group=False,
                col_target_aware=False,
                col_ssmax="none",
                icl_ssmax="none",
                row_rope_interleaved=True,
            ),
            "v1",
        ),
        (lambda c: c.update(col_ssmax="ssmax"), "not a TabICLv2"),
        (lambda c: c.update(surprise=1), "unknown checkpoint config keys"),
        (lambda c: c.update(embed_dim="128"), "must be a number"),
        (lambda c: c.update(bias_free_ln=1), "must be a bool"),
        (lambda c: c.update(icl_nhead=7), "not divisible"),
        (lambda c: c.update(col_num_blocks=0), "positive"),
        (lambda c: c.update(bias_free_ln=True), "contradict the config"),
        (lambda c: c.update(max_classes=0), "contradict the config"),
        (lambda c: c.update(icl_num_blocks=3), "contradict the config"),
    ],
)
def test_bad_config_is_refused(tmp_path, payload, edit, match):
    edit(payload["config"])
    with pytest.raises((ConfigError, CheckpointError), match=match):
        TabICLv2.from_checkpoint(_save(tmp_path, payload))


def test_missing_entries_are_refused(tmp_path, payload):
    with pytest.raises(CheckpointError, match="expected 'config' and 'state_dict'"):
        TabICLv2.from_checkpoint(_save(tmp_path, {"state_dict": payload["state_dict"]}))
    payload["state_dict"].pop("icl_predictor.ln.weight")
    with pytest.raises(CheckpointError, match="missing"):
        TabICLv2.from_checkpoint(_save(tmp_path, payload))


@pytest.mark.parametrize(
    "values",
    [[float("nan")], [float("inf")], [-float("inf")], [float("inf"), -float("inf")]],
    ids=["nan", "inf", "-inf", "inf-and--inf"],
)
def test_non_finite_weights_are_refused_by_name(tmp_path, payload, values):
    state = payload["state_dict"]
    names = sorted(state)
    for name in (names[3], names[-1]):
        flat = state[name].view(-1)
        flat[torch.arange(len(values)) * 2 % flat.numel()] = torch.tensor(values)
    with pytest.raises(CheckpointError, match="NaN or infinite weights") as refused:
        load_checkpoint(_save(tmp_path, payload))
    assert str([names[3], names[-1]]) in str(refused.value)


def test_finite_weights_whose_sum_overflows_are_taken(tmp_path, payload):
    # float64 weights near the top of its range: their sum is infinite, each weight finite.
    state = payload["state_dict"]
    name = sorted(state)[0]
    state[name] = torch.full_like(state[name], 1.5e308, dtype=torch.float64)
    assert not state[name].sum().isfinite()
    _, loaded = load_checkpoint(_save(tmp_path, payload))
    assert torch.equal(loaded[name], state[name])


def test_corrupted_and_truncated_files_are_refused(tmp_path):
    data = reference_checkpoint("clf", "tiny").read_bytes()
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        TabICLv2.from_checkpoint(truncated)
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint at all" * 100)
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        TabICLv2.from_checkpoint(garbage)
    flipped = bytearray(data)
    middle = len(flipped) // 2
    flipped[middle : middle + 64] = bytes(64)
    corrupted = tmp_path / "corrupted.ckpt"
    corrupted.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        TabICLv2.from_checkpoint(corrupted)
    safetensors = our_model("clf", "tiny").save_safetensors(tmp_path / "model.safetensors")
    blob = safetensors.read_bytes()
    safetensors.write_bytes(blob[: len(blob) // 3])
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        TabICLv2.from_checkpoint(safetensors)
    with pytest.raises(FileNotFoundError):
        TabICLv2.from_checkpoint(tmp_path / "absent.ckpt")


class _NotAllowed:
    pass


def test_pickled_code_is_never_executed(tmp_path, payload):
    payload["extra"] = _NotAllowed()
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        TabICLv2.from_checkpoint(_save(tmp_path, payload))


def test_foreign_safetensors_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(CheckpointError, match="without a tabserve TabICLv2 config"):
        TabICLv2.from_checkpoint(path)


def test_a_fine_tuned_checkpoint_answers_as_tabicl_reads_it(tmp_path):
    """tabicl's fine-tuner (FinetunedTabICLClassifier) writes the pretraining layout plus the
    optimizer's and scheduler's states, the epoch and the best metric, for the zero-shot
    estimators to load by ``model_path``: the estimators read such a file as tabicl's do, with
    the same answers, and the tuned weights, not the base's, answer."""
    import numpy as np
    from tabicl import TabICLClassifier as ReferenceClassifier
    from tabserve.models.tabicl import TabICLClassifier

    base = checkpoint_payload(build_reference_model("clf", "tiny", seed=5))
    generator = torch.Generator().manual_seed(0)
    names = [name for name, value in base["state_dict"].items() if value.is_floating_point()]
    params = [torch.nn.Parameter(base["state_dict"][name].clone()) for name in names]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    for param in params:  # one step: AdamW moves every weight by about the learning rate
        param.grad = torch.randn(param.shape, generator=generator)
    optimizer.step()
    scheduler.step()
    tuned = {**base["state_dict"], **{name: p.detach().clone() for name, p in zip(names, params)}}
    payload = {
        "config": base["config"], "state_dict": tuned, "optimizer_state": optimizer.state_dict(),
        "scheduler_state": scheduler.state_dict(), "curr_step": 1, "epoch": 1, "best_metric": 0.75,
    }  # fmt: skip
    path, base_path = _save(tmp_path, payload, "best.ckpt"), _save(tmp_path, base, "base.ckpt")
    X, y = random_table(2, 1, 90, 30, 6, n_classes=3)
    X, y = X[0].numpy(), y[0].numpy()
    kwargs = {"device": "cpu", "n_estimators": 4}

    def answers(cls, model_path, **extra):
        return cls(model_path=str(model_path), **kwargs, **extra).fit(X[:90], y).predict_proba(X[90:])

    mine = answers(TabICLClassifier, path)
    reference = answers(ReferenceClassifier, path, use_amp=False, allow_auto_download=False)
    np.testing.assert_allclose(mine, reference, atol=1e-5, rtol=0)
    assert np.abs(mine - answers(TabICLClassifier, base_path)).max() > 1e-3
