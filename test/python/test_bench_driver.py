"""The TabICLv2 benchmark driver (``tabserve.bench``): tables, isolation, gates, promotion, report.

CPU only. One end-to-end run of the CLI on a tiny random-weight model and the smallest quick
workload; everything else is unit-level (subprocess failures are provoked with ``python -c``).
"""

import gzip
import json
import re
import statistics
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("tabicl")
pytest.importorskip("sklearn")

from tabserve.bench import cells as cells_mod
from tabserve.bench import gates, measure, report, runner, timing
from tabserve.bench.cells import CELLS, Cell, cell_by_name, select_cells, skip_reason
from tabserve.bench.cli import main
from tabserve.bench.workloads import (
    WORKLOADS,
    host_table,
    make_checkpoint,
    model_tables,
    stream_shapes,
    workload_by_name,
)

# -- cell and workload tables -------------------------------------------------------------------


def test_cell_names_are_unique_numbered_and_cover_the_issue():
    names = [c.name for c in CELLS]
    assert len(set(names)) == len(names)
    assert [int(n.split("-")[0][1:]) for n in names] == list(range(len(names)))
    assert {c.name for c in CELLS if c.baseline} == {"c0-ref-fp32", "c1-ref-fp16"}
    assert {c.precision for c in CELLS} == set(cells_mod.PRECISIONS)
    assert {c.compile for c in CELLS} == set(cells_mod.COMPILE_MODES)
    backends = {b for c in CELLS for b in c.attention.values()}
    assert backends >= {"cudnn", "flash", "efficient"}
    assert any(c.kv_cache for c in CELLS) and any(c.buckets for c in CELLS)
    assert any(c.regional for c in CELLS) and any(c.cuda_graphs for c in CELLS)


def test_the_device_script_names_only_cells_the_driver_has():
    """scripts/device_bench.sh's default cell lists reach the driver only on the GPU machine,
    where a misspelt name would cost a device call."""
    script = (Path(__file__).parents[2] / "scripts" / "device_bench.sh").read_text()
    named = set(re.findall(r"(?<![\w-])c\d+-[a-z0-9]+(?:-[a-z0-9]+)*", script))
    known = {c.name for c in CELLS}
    assert named - known == set()
    assert len(named) >= 10  # the pattern finds the script's cells (`cut -c1-220` is not one)


def test_every_tabserve_cell_is_a_recipe_with_its_fused_operators():
    from tabserve.models.tabicl.recipes import recipe_from_cell

    for cell in cells_mod.recipe_cells():
        recipe = recipe_from_cell(cell.recipe(), name=cell.name)
        assert (recipe.fused_ffn, recipe.fused_norm_linear, recipe.freeze) == (
            cell.fused_ffn,
            cell.fused_norm_linear,
            cell.freeze,
        ), cell.name
        assert recipe.cuda_graphs == cell.cuda_graphs and recipe.attention == cell.attention
        assert recipe.kv_graphs == cell.kv_graphs, cell.name
        assert recipe.shape_graphs == cell.shape_graphs, cell.name
        assert recipe.icl_one_pass == cell.icl_one_pass, cell.name
    assert cell_by_name("c36-fp16-compile-head16-row-fused").fused_norm_linear
    from tabserve.models.tabicl import recipes

    # the named fp8 recipes are their cells' (c57, c59, c61), field for field
    base = "fp16-compile-head16-fused-frozen-kvgraphs-ropeproj-outproj-rowtokens"
    fp8_named = ((57, "-iclfp8"), (59, "-iclfp8-colflash"), (61, "-iclfp8-colflash-iclonepass"))
    for number, suffix in fp8_named:
        (cell,) = select_cells([f"c{number}-*"])
        measured = recipe_from_cell(cell.recipe(), name=base + suffix)
        assert recipes.RECIPES[base + suffix].replace(description="") == measured.replace(
            description=""
        ), number

    assert cells_mod.KERNEL_BACKENDS == recipes.KERNEL_BACKENDS
    assert cells_mod.ATTENTION_BACKENDS == recipes.ATTENTION_BACKENDS
    assert cell_by_name("c39-fp16-buckets-compile-cudagraphs-head16-row-fused-frozen").freeze
    with pytest.raises(ValueError, match="freeze is Inductor's freezing of compiled graphs"):
        Cell("cx", "tabserve", "fp16", "bad", freeze=True)
    for fused in ("fused_ffn", "fused_norm_linear"):
        with pytest.raises(ValueError, match=f"{fused} runs under bf16 / fp16 autocast only"):
            Cell("cx", "tabserve", "fp32", "bad", **{fused: True})


def test_skip_reasons_never_fake_a_recipe():
    for cell in CELLS:
        reason = skip_reason(cell, "cpu")
        if cell.precision == "fp8":
            assert "transformer_engine" in reason or "not implemented" in reason
        elif cell.pending:
            assert reason.startswith("skipped: not implemented")
        elif "cpu" not in cell.devices:
            assert reason == "skipped: no CUDA device"
        else:
            assert reason is None
    runnable_on_cpu = {c.name for c in CELLS if skip_reason(c, "cpu") is None}
    assert {"c0-ref-fp32", "c2-fp32"} <= runnable_on_cpu


def test_cell_validation_selection_and_recipe():
    with pytest.raises(ValueError, match="precision"):
        Cell("cx", "tabserve", "fp12", "bad")
    with pytest.raises(ValueError, match="attention"):
        Cell("cx", "tabserve", "fp16", "bad", attention={"col": "warp"})
    with pytest.raises(KeyError, match="known"):
        cell_by_name("c99-nothing")
    assert [c.name for c in select_cells(["c1-ref*", "c2-fp32"])] == ["c1-ref-fp16", "c2-fp32"]
    with pytest.raises(KeyError, match=r"no cell matches \['zz\*'\]"):
        select_cells(["c1-ref*", "zz*"])
    # The order named is the order run (a deadline cuts the cells named last), each cell once.
    named = [c.name for c in select_cells(["c56*", "c1-ref-fp16", "c5-fp16", "c1*"])]
    assert named[0].startswith("c56-") and named[1:3] == ["c1-ref-fp16", "c5-fp16"]
    assert len(named) == len(set(named)) and named[3:] == [
        c.name for c in CELLS if c.name.startswith("c1") and c.name != "c1-ref-fp16"
    ]
    recipe = cell_by_name("c9-fp16-flash-cudnn-icl").recipe()
    assert recipe["attention"] == {"col": "flash", "row": "flash", "icl": "cudnn"}
    assert "description" not in recipe and "pending" not in recipe
    assert cell_by_name("c7-fp16-flash").uniform_attention == "flash"
    assert cell_by_name("c9-fp16-flash-cudnn-icl").uniform_attention is None


def test_ffn_projecting_tile_is_a_checked_per_process_measurement_knob(tmp_path, monkeypatch):
    """``ffn_projecting_tile``: refused without the folded out-projection or with a malformed
    tile; left out of the recipe a promoted cell rebuilds (a measurement knob); set in the
    cell's own process when its engine is prepared; refused by ABBA between cells whose tiles
    differ (one process for both)."""
    import dataclasses

    from tabserve.bench.engines import TabserveEngine
    from tabserve.kernels import feed_forward

    c50 = next(c for c in CELLS if c.ffn_projecting_tile is not None)
    assert c50.ffn_projecting_tile == (32, 4, 2) and "ffn_projecting_tile" not in c50.recipe()
    bad_fields = [
        {"fused_out_projection": False},
        {"ffn_projecting_tile": (48, 4, 2)},
        {"ffn_projecting_tile": (32, 0, 2)},
        {"ffn_projecting_tile": (32, 4)},
    ]
    for bad in bad_fields:
        with pytest.raises(ValueError, match="ffn_projecting_tile is"):
            dataclasses.replace(c50, **bad)
    monkeypatch.setattr(feed_forward, "PROJECTING_LONG_CONFIG", feed_forward.LONG_CONFIG)
    checkpoint = make_checkpoint("clf", tmp_path / "tiny.ckpt", size="tiny")
    on_cpu = dataclasses.replace(
        c50, precision="bf16", compile=None, freeze=False, kv_graphs=False, devices=("cpu",),
        attention={},
    )  # fmt: skip
    TabserveEngine(on_cpu, workload_by_name("small-quick"), checkpoint, torch.device("cpu"))
    assert feed_forward.PROJECTING_LONG_CONFIG == (32, 4, 2)
    # A served cell (buckets here; c50's kv_graphs on CUDA) sets it too.
    monkeypatch.setattr(feed_forward, "PROJECTING_LONG_CONFIG", feed_forward.LONG_CONFIG)
    served = dataclasses.replace(on_cpu, buckets="default")
    engine = TabserveEngine(served, workload_by_name("small-quick"), checkpoint, torch.device("cpu"))
    assert engine.served is not None and feed_forward.PROJECTING_LONG_CONFIG == (32, 4, 2)
    ab = _ab_of(c50, dataclasses.replace(c50, ffn_projecting_tile=None), tmp_path, checkpoint)
    assert ab["status"] == "skipped" and "process or model" in ab["reason"]
    # Never promoted while the tile is not the default: "auto" would serve the recipe without it.
    monkeypatch.setattr(feed_forward, "PROJECTING_LONG_CONFIG", feed_forward.LONG_CONFIG)
    passed = {"status": "ok", "gate": {"passed": True}}
    assert not gates.promotable(passed, c50)
    assert gates.promotable(passed, dataclasses.replace(c50, ffn_projecting_tile=None))


def test_ffn_gelu_is_a_checked_per_process_measurement_knob(tmp_path, monkeypatch):
    """``ffn_gelu``: one of the kernel's GELU forms, with the fused feed-forward only; left out
    of the recipe; set in the cell's own process (served or not); promoted only while its form
    is the kernel's default; ABBA refuses cells whose forms differ."""
    import dataclasses

    from tabserve.bench.engines import TabserveEngine
    from tabserve.kernels import feed_forward

    c52 = next(c for c in CELLS if c.ffn_gelu is not None)
    assert c52.ffn_gelu == "rational" and "ffn_gelu" not in c52.recipe()
    assert c52.kernel_knobs() == {"ffn_gelu": "rational"}
    for bad in ({"ffn_gelu": "tanh"}, {"fused_ffn": False, "fused_out_projection": False,
                                          "fused_row_tokens": False}):  # fmt: skip
        with pytest.raises(ValueError, match="ffn_gelu is the fused feed-forward's GELU form"):
            dataclasses.replace(c52, **bad)
    monkeypatch.setattr(feed_forward, "GELU", "erf")
    checkpoint = make_checkpoint("clf", tmp_path / "tiny.ckpt", size="tiny")
    on_cpu = dataclasses.replace(
        c52, precision="bf16", compile=None, freeze=False, kv_graphs=False, devices=("cpu",),
        attention={}, buckets="default",
    )  # fmt: skip
    TabserveEngine(on_cpu, workload_by_name("small-quick"), checkpoint, torch.device("cpu"))
    assert feed_forward.GELU == "rational"
    # Promoted only while its form is the kernel's default: a recipe then runs what it ran.
    passed = {"status": "ok", "gate": {"passed": True}}
    assert gates.promotable(passed, c52)
    monkeypatch.setattr(feed_forward, "GELU", "erf")
    assert not gates.promotable(passed, c52)
    ab = _ab_of(c52, dataclasses.replace(c52, ffn_gelu=None), tmp_path, checkpoint)
    assert ab["status"] == "skipped" and "ffn_gelu" in ab["reason"]


def test_checks_first_is_a_per_model_measurement_knob(tmp_path):
    """``checks_first`` (c53): the model reads its checks' verdict before the network; a knob
    of tabserve's model only, left out of the recipe, set on the cell's model, never promoted
    while deferring is the default, refused by ABBA against a cell without it."""
    import dataclasses

    from tabserve.bench.engines import TabserveEngine

    c53 = next(c for c in CELLS if c.checks_first)
    c52 = next(c for c in CELLS if c.name.startswith("c52-"))
    assert c53 == dataclasses.replace(c52, name=c53.name, description=c53.description,
                                      checks_first=True)  # fmt: skip
    assert c53.kernel_knobs() == {"ffn_gelu": "rational", "checks_first": True}
    assert c53.recipe() == c52.recipe()
    with pytest.raises(ValueError, match="checks_first is a setting of tabserve's model"):
        dataclasses.replace(CELLS[0], checks_first=True)
    checkpoint = make_checkpoint("clf", tmp_path / "tiny.ckpt", size="tiny")
    for cell, defers in ((c53, False), (c52, True)):
        on_cpu = dataclasses.replace(
            cell, precision="bf16", compile=None, freeze=False, kv_graphs=False,
            devices=("cpu",), attention={},
        )  # fmt: skip
        engine = TabserveEngine(on_cpu, workload_by_name("small-quick"), checkpoint,
                                torch.device("cpu"))  # fmt: skip
        assert engine.model.defer_checks is defers
    passed = {"status": "ok", "gate": {"passed": True}}
    assert gates.promotable(passed, c52) and not gates.promotable(passed, c53)
    ab = _ab_of(c52, c53, tmp_path, checkpoint)
    assert ab["status"] == "skipped" and "checks_first" in ab["reason"]


def _ab_of(cell_a, cell_b, tmp_path, checkpoint) -> dict:
    """ABBA of two cells on the quick workload (CUDA: refused before any job where the cells
    cannot share a process)."""
    return runner.run_ab(
        [cell_a, cell_b],
        workload_by_name("small-quick"),
        run_dir=tmp_path,
        device="cuda",
        checkpoint=checkpoint,
        timeout_s=10,
    )


def test_workloads_match_the_issue():
    shapes = {w.name: (w.members, w.n_train, w.n_test, w.n_features) for w in WORKLOADS}
    assert shapes["small"] == (8, 512, 64, 8)
    assert shapes["medium"] == (8, 1024, 256, 20)
    assert shapes["large"] == (8, 8192, 2048, 64)
    assert shapes["xlarge"] == (8, 50000, 1000, 100)
    assert workload_by_name("many-class").n_classes == 25
    assert workload_by_name("regression").task == "reg"
    assert workload_by_name("stream").stream == 32
    assert not workload_by_name("many-class").cacheable


def test_generated_tables_are_seeded_random_and_complete():
    small = workload_by_name("small-quick")
    X, y = model_tables(small, seed=3)
    assert X.shape == (2, 160, 8) and y.shape == (2, 128) and X.dtype == torch.float32
    assert (X != 0).float().mean() > 0.99
    assert all(set(row.tolist()) == set(range(small.n_classes)) for row in y.long())
    X2, _ = model_tables(small, seed=3)
    assert torch.equal(X, X2)
    X_train, y_train, X_test = host_table(small, seed=0)
    assert X_train.shape == (128, 8) and y_train.shape == (128,) and X_test.shape == (32, 8)
    stream = workload_by_name("stream")
    shapes = stream_shapes(stream, seed=0)
    assert shapes == stream_shapes(stream, seed=0) and len(set(shapes)) == 32
    for n_train, n_test, n_features, n_classes in shapes:
        assert 64 <= n_train <= 8192 and 1 <= n_test <= 2048 and 2 <= n_features <= 64
        assert 2 <= n_classes <= 10



def test_stream_warms_every_bucket_it_visits_with_another_table():
    """A bucketed cell's stream warm-up covers each bucket of the stream once, with a table of
    the bucket's own shape (not the stream's), so the timed fresh tables must neither recompile
    nor capture; an unbucketed cell has no grid and warms on two other tables."""
    from tabserve.bench.measure import stream_warm_shapes
    from tabserve.buckets import BucketGrid

    stream = workload_by_name("stream")
    shapes = stream_shapes(stream, seed=0)
    warm = stream_warm_shapes(cell_by_name("c18-fp16-buckets-cudagraphs"), stream, shapes, 0)
    grid = BucketGrid()
    visited = {grid.bucket_for(*s[:3]) for s in shapes}
    assert {grid.bucket_for(*w[:3]) for w in warm} == visited and len(warm) == len(visited)
    assert not set(warm) & set(shapes)  # other tables than the timed ones
    assert [tuple(w[:3]) for w in warm] == [
        (b.train_rows, b.test_rows, b.features) for b in (grid.bucket_for(*w[:3]) for w in warm)
    ]
    plain = stream_warm_shapes(cell_by_name("c5-fp16"), stream, shapes, 0)
    assert plain == stream_shapes(stream, seed=1000)[:2]

# -- subprocess isolation -----------------------------------------------------------------------


def _child(tmp_path, code, timeout=30):
    result = tmp_path / "result.json"
    script = f"import json, os, sys, time\nRESULT = {str(result)!r}\n{code}"
    return runner.run_isolated([sys.executable, "-c", script], result, timeout)


def test_isolated_success_keeps_the_child_result(tmp_path):
    out = _child(tmp_path, "json.dump({'status': 'ok', 'x': 1}, open(RESULT, 'w'))")
    assert out["status"] == "ok" and out["x"] == 1 and out["returncode"] == 0
    assert "log_tail" not in out


def test_isolated_crash_keeps_phases_measured_before_it(tmp_path):
    code = "json.dump({'status': 'running', 'cold': {'first_call_ms': 5}}, open(RESULT, 'w'))\n"
    code += "print('about to crash', flush=True)\nos.abort()"
    out = _child(tmp_path, code)
    assert out["status"] == "crashed" and out["reason"] == "killed by SIGABRT"
    assert out["cold"] == {"first_call_ms": 5} and "about to crash" in out["log_tail"]


def test_isolated_timeout_kills_the_process_group(tmp_path):
    code = "import subprocess\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    code += "time.sleep(60)"
    out = _child(tmp_path, code, timeout=1.5)
    assert out["status"] == "timeout" and out["wall_s"] < 20
    assert out["reason"] == "timeout after 1.5 s"


def test_isolated_oom_and_silent_exit_are_reported(tmp_path):
    out = _child(tmp_path, "print('torch.OutOfMemoryError: CUDA out of memory'); sys.exit(1)")
    assert out["status"] == "oom" and out["reason"] == "exit code 1"
    out = _child(tmp_path, "pass")
    assert out["status"] == "crashed" and out["reason"] == "exited without a final result"


def test_a_cell_whose_model_does_not_load_is_a_failed_result(tmp_path):
    out = runner.run_cell(
        cell_by_name("c2-fp32"),
        workload_by_name("small-quick"),
        run_dir=tmp_path,
        device="cpu",
        checkpoint=tmp_path / "missing.ckpt",
        timeout_s=120,
        timing={},
    )
    assert out["status"] == "failed" and out["reason"].startswith("loading:")
    skipped = runner.run_cell(
        cell_by_name("c21-fp8-te"),
        workload_by_name("small-quick"),
        run_dir=tmp_path,
        device="cuda",
        checkpoint=tmp_path / "missing.ckpt",
        timeout_s=1,
        timing={},
    )
    assert skipped["status"] == "skipped"


def test_warm_cache_cell_primes_then_restarts_from_the_saved_artifacts(tmp_path, monkeypatch):
    """c20: a priming process saves the artifacts, the measured process loads them; both start
    with their own empty compile caches. The processes are stubbed: the wiring is under test."""
    calls = []

    def fake_run(command, result_path, timeout_s, env):
        spec = json.loads(Path(command[-1]).read_text())
        calls.append((spec, env))
        if spec.get("compile_cache_mode") == "save":
            return {"status": "ok", "cold": {"first_call_ms": 30_000.0}, "wall_s": 40.0,
                    "compile_cache": {"bytes": 10, "artifacts": {"inductor": 2}}}
        return {"status": "ok", "cold": {"first_call_ms": 900.0}}

    monkeypatch.setattr(runner, "run_isolated", fake_run)
    cell = cell_by_name("c20-fp16-buckets-warm-cache")
    args = dict(run_dir=tmp_path, device="cuda", checkpoint=tmp_path / "m.ckpt", timeout_s=9,
                timing={})
    result = runner.run_cell(cell, workload_by_name("small"), **args)
    (prime, prime_env), (measured, measured_env) = calls
    assert prime["compile_cache_mode"] == "save" and measured["compile_cache_mode"] == "load"
    assert prime["compile_cache"] == measured["compile_cache"] and prime["outputs"] is None
    assert prime_env["TORCHINDUCTOR_CACHE_DIR"] != measured_env["TORCHINDUCTOR_CACHE_DIR"]
    assert result["status"] == "ok" and result["priming"]["cold_ms"] == 30_000.0
    assert result["priming"]["compile_cache"]["artifacts"] == {"inductor": 2}
    # both processes know when they were spawned (ready_ms); the restart skips the KV and
    # estimator phases, which recompile and belong to other cells
    assert prime["spawned_at"] <= measured["spawned_at"]
    assert {"kv", "end_to_end"} <= set(measured["skip_phases"]) and "skip_phases" not in prime
    printed = report.render({
        "settings": {"device": "cuda", "checkpoint_note": "x"},
        "environment": {"gpu": "G", "torch": "t", "tabicl": "2", "tabserve": "0"},
        "results": [{**result, "ready_ms": 21_700.0}], "promotion": {}})
    assert ("small / c20-fp16-buckets-warm-cache: first answer 21.7 s after the process was "
            "spawned (first call 900.0 ms; priming 30000 ms)") in printed

    def failing_prime(command, result_path, timeout_s, env):
        return {"status": "failed", "reason": "priming: nothing compiled"}

    monkeypatch.setattr(runner, "run_isolated", failing_prime)
    failed = runner.run_cell(cell, workload_by_name("small"), **args)
    assert failed["status"] == "failed" and failed["reason"].startswith("priming the compile cache")


# -- gates and promotion ------------------------------------------------------------------------


def _probs(seed, rows=200, classes=4):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(2, rows, classes, generator=g) * 3, -1)


def test_gate_limits_by_precision():
    ref = _probs(0)
    fp32, fp16 = cell_by_name("c2-fp32"), cell_by_name("c5-fp16")
    ok = gates.gate(fp16, "clf", {"one_shot": ref + 1e-3}, "c0-ref-fp32", {"one_shot": ref})
    assert ok["passed"] is True and ok["one_shot"]["argmax_agreement"] == 1.0
    bad = gates.gate(fp32, "clf", {"one_shot": ref + 1e-3}, "c0-ref-fp32", {"one_shot": ref})
    assert bad["passed"] is False and bad["one_shot"]["failures"] == ["max_prob_diff > 0.0001"]
    flipped = gates.gate(fp16, "clf", {"one_shot": _probs(1)}, "c0-ref-fp32", {"one_shot": ref})
    assert flipped["passed"] is False
    assert "argmax_agreement < 0.995" in flipped["one_shot"]["failures"]
    kv_bad = gates.gate(
        fp16, "clf", {"one_shot": ref, "kv": _probs(1)}, "c0-ref-fp32", {"one_shot": ref}
    )
    assert kv_bad["passed"] is False and kv_bad["one_shot"]["failures"] == []


def test_gate_regression_padding_and_missing_reference():
    cell = cell_by_name("c4-bf16")
    mean = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)) + 3
    verdict = gates.gate(cell, "reg", {"one_shot": mean * 1.001}, "c2-fp32", {"one_shot": mean})
    # The largest error over the reference's root mean square (it was unseeded, and a bound of
    # 2e-3 on this figure failed now and then).
    error = (mean * 1.001).double() - mean.double()
    expected = error.abs().max() / mean.double().pow(2).mean().sqrt()
    assert verdict["passed"] is True
    assert verdict["one_shot"]["mean_rel_error"] == pytest.approx(float(expected), rel=1e-6)
    verdict = gates.gate(cell, "reg", {"one_shot": mean * 1.1}, "c2-fp32", {"one_shot": mean})
    assert verdict["passed"] is False
    padded = {"one_shot": mean, "padded": mean, "unpadded": mean + 1e-5}
    verdict = gates.gate(cell, "reg", padded, "c2-fp32", {"one_shot": mean})
    assert verdict["passed"] is False and verdict["padded"]["failures"]
    assert gates.gate(cell, "reg", {"one_shot": mean}, None, None)["passed"] is None
    shape = gates.gate(cell, "reg", {"one_shot": mean[:, :3]}, "c2-fp32", {"one_shot": mean})
    assert shape["passed"] is False and shape["one_shot"]["failures"] == ["shape"]


def test_gate_of_padding_under_the_cells_own_recipe():
    """``padded_recipe``: padded against unpadded under the cell's own kernels; fp32 cells to
    1e-5 (compiled kernels' summation order), reduced precision to 5e-3, a quarter of the
    reduced-precision gate, and the failure is named in the table's gate column."""
    ref = _probs(0)
    fp32, fp16 = cell_by_name("c22-fp32-buckets"), cell_by_name("c18-fp16-buckets-cudagraphs")

    def verdict(cell, diff):
        outputs = {"one_shot": ref, "padded_recipe": ref + diff, "unpadded_recipe": ref}
        return gates.gate(cell, "clf", outputs, "c0-ref-fp32", {"one_shot": ref})

    assert verdict(fp32, 5e-6)["passed"] is True
    failed = verdict(fp32, 5e-5)
    assert failed["passed"] is False and failed["one_shot"]["failures"] == []
    assert failed["padded_recipe"]["failures"] == ["max_prob_diff > 1e-05"]
    passed = verdict(fp16, 2e-3)
    assert passed["passed"] is True
    assert passed["padded_recipe"]["max_prob_diff"] == pytest.approx(2e-3, rel=1e-4)  # fp32 sums
    assert report._gate_text(passed) == "pass 0.0e+00 pad 2e-03"
    failed = verdict(fp16, 1e-2)
    assert failed["passed"] is False
    assert report._gate_text(failed) == "FAIL padded_recipe: max_prob_diff > 0.005"


def test_a_padding_gate_that_could_not_run_fails_the_gate():
    """A padding cell whose gates' phase raised has no padded outputs to compare: its gate
    fails (named in the table) instead of passing on its other routes."""
    ref = _probs(0)
    cell = cell_by_name("c22-fp32-buckets")
    result = {"cell": cell.name, "workload": "w", "status": "ok", "outputs": "x"}
    result["padding_gates"] = {"error": "RuntimeError", "message": "boom"}
    reference = {"cell": "c0-ref-fp32", "workload": "w", "status": "ok", "outputs": "r"}
    workloads = {"w": workload_by_name("small-quick")}
    cells = {c.name: c for c in CELLS}
    outputs = {"x": {"one_shot": ref}, "r": {"one_shot": ref}}
    gates.apply_gates([reference, result], cells, workloads, lambda r: outputs[r["outputs"]])
    assert result["gate"]["one_shot"]["failures"] == [] and result["gate"]["passed"] is False
    assert report._gate_text(result["gate"]) == "FAIL padding_gates: RuntimeError: boom"
    del result["padding_gates"]
    gates.apply_gates([reference, result], cells, workloads, lambda r: outputs[r["outputs"]])
    assert result["gate"]["passed"] is True


def _result(cell, ms, passed, status="ok", workload="w", kv=None):
    result = {"cell": cell, "workload": workload, "status": status, "one_shot": {"median_ms": ms}}
    if kv is not None:
        result["kv"] = {"median_ms": kv}
    result["gate"] = {"passed": passed}
    return result


def test_promotion_takes_the_fastest_passing_non_baseline_cell():
    cells = {c.name: c for c in CELLS}
    results = [
        _result("c1-ref-fp16", 1.0, True),  # baseline: never promoted
        _result("c5-fp16", 2.0, False),  # fastest tabserve cell, but failed its gate
        _result("c6-fp16-cudnn", 2.5, None),  # unchecked: never promoted
        _result("c7-fp16-flash", 3.0, True, status="timeout"),
        _result("c4-bf16", 4.0, True, kv=0.5),
        _result("c2-fp32", 5.0, True, kv=0.4),
    ]
    promoted = gates.promote(results, cells)["w"]
    assert promoted["one_shot"]["cell"] == "c4-bf16" and promoted["one_shot"]["median_ms"] == 4.0
    assert promoted["kv_predict"]["cell"] == "c2-fp32"
    assert promoted["one_shot"]["recipe"]["precision"] == "bf16"
    # no fp8 cell promoted: no second entry per route
    assert not any(key.endswith(gates.WITHOUT_FP8) for key in promoted)


def test_promotion_names_the_fastest_cell_without_fp8_where_an_fp8_one_wins():
    cells = {c.name: c for c in CELLS}
    fp8_cells = [c for c in CELLS if c.name.startswith(("c57-", "c59-"))]
    assert fp8_cells and all(gates.uses_fp8(c) for c in fp8_cells)
    assert not gates.uses_fp8(cell_by_name("c4-bf16"))
    results = [
        _result(fp8_cells[1].name, 1.0, True, kv=0.9),  # fastest one-shot, fp8
        _result(fp8_cells[0].name, 1.5, True, kv=0.2),  # fastest KV, fp8 too
        _result("c4-bf16", 4.0, True, kv=0.5),
        _result("c2-fp32", 5.0, True, kv=0.4),
        _result("c5-fp16", 0.5, False),  # faster, but failed its gate
    ]
    promoted = gates.promote(results, cells)["w"]
    assert promoted["one_shot"]["cell"] == fp8_cells[1].name
    assert promoted["one_shot_without_fp8"]["cell"] == "c4-bf16"
    assert promoted["kv_predict"]["cell"] == fp8_cells[0].name
    assert promoted["kv_predict_without_fp8"]["cell"] == "c2-fp32"




def test_abba_summary():
    summary = timing.abba_summary([10, 10, 10, 10], [11, 11, 12, 12])
    assert summary["windows"] == 2 and summary["consistent"]
    assert summary["change_median"] == pytest.approx(0.15)
    assert summary["first_half_mean"] == pytest.approx(0.1)
    with pytest.raises(ValueError):
        timing.abba_summary([1, 2, 3], [1, 2, 3])


def test_timing_noise_flag():
    quiet = timing.Timing([10.0, 10.1, 10.2, 9.9, 10.0]).as_dict()
    noisy = timing.Timing([10.0, 14.0, 7.0, 12.0, 9.0]).as_dict()
    assert not quiet["noisy"] and noisy["noisy"]
    assert quiet["p20_ms"] <= quiet["median_ms"] <= quiet["p80_ms"] <= quiet["p90_ms"]


def test_table_is_fixed_width():
    text = report.format_table(("name", ">ms"), [("a", "1.5"), ("longer", "10.25")])
    lines = text.splitlines()
    assert lines == ["name       ms", "------  -----", "a         1.5", "longer  10.25"]


def test_plot_labels_bars_with_short_ids_in_cell_number_order(tmp_path, monkeypatch):
    assert report.cell_id("c52-fp16-compile-head16") == "c52" and report.cell_id("solo") == "solo"
    names = ["c10-fp16-compile", "c2-fp32", "x-other", "c1-ref-fp16"]
    assert sorted(names, key=report._cell_number) == [
        "c1-ref-fp16", "c2-fp32", "c10-fp16-compile", "x-other"]

    import matplotlib.axes

    ticks = []
    original = matplotlib.axes.Axes.set_yticks

    def recording(self, y, labels=None, **kw):
        ticks.append(list(labels))
        return original(self, y, labels, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_yticks", recording)
    timed = {"median_ms": 2.0, "p20_ms": 1.9, "p80_ms": 2.1}
    results = [
        {"cell": name, "workload": "w", "status": "ok", "one_shot": dict(timed),
         "speedup": {"one_shot": {"ref16": 1.5}}}
        for name in names
    ]
    document = {"results": results}
    assert report.plot(document, tmp_path / "p.png").stat().st_size > 0
    # Both panels of the one workload: latency and speedup, ids in number order.
    assert ticks == [["c1", "c2", "c10", "x"]] * 2


# -- the CLI, end to end ------------------------------------------------------------------------


def test_quick_cpu_run_writes_schema_table_plot_and_recipes(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--device", "cpu", "--quick", "--model-size", "tiny", "--workloads", "small-quick"]
    argv += ["--cells", "c0-ref-fp32", "c2-fp32", "c5-fp16", "c16*", "c22*", "--budget", "0.05"]
    argv += ["--out", str(out), "--quiet", "--timeout", "120"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    document = json.loads(out.read_text())

    assert document["schema"] == report.SCHEMA
    env = document["environment"]
    for key in ("torch", "cuda", "cudnn", "driver", "gpu", "tabserve", "tabicl"):
        assert key in env
    assert "RANDOM weights" in document["settings"]["checkpoint_note"]
    by_cell = {r["cell"]: r for r in document["results"]}
    assert by_cell["c5-fp16"] == {
        "cell": "c5-fp16",
        "workload": "small-quick",
        "status": "skipped",
        "reason": "skipped: no CUDA device",
    }
    assert by_cell["c16-fp16-buckets-compile"]["reason"] == "skipped: no CUDA device"
    for name in ("c0-ref-fp32", "c2-fp32", "c22-fp32-buckets"):
        result = by_cell[name]
        assert result["status"] == "ok", (name, result.get("reason"), result.get("log_tail"))
        one = result["one_shot"]
        assert 0 < one["p20_ms"] <= one["median_ms"] <= one["p80_ms"]
        assert one["repeats"] >= 3 and isinstance(one["noisy"], bool)
        assert result["cold"]["first_call_ms"] > 0 and result["cold"]["jit"]["graph_breaks"] == 0
        assert result["kv"]["median_ms"] > 0 and result["end_to_end"]["fit_ms"] > 0
        # spawn to first answer: includes the first call, and the process start before it
        assert result["ready_ms"] > result["cold"]["first_call_ms"] + result["load_ms"] > 0
    assert by_cell["c0-ref-fp32"]["gate"]["note"] == "is the fp32 reference"
    gate = by_cell["c2-fp32"]["gate"]
    assert gate["passed"] is True and gate["one_shot"]["max_prob_diff"] < 1e-4
    assert by_cell["c2-fp32"]["speedup"]["one_shot"]["ref32"] > 0
    padded = by_cell["c22-fp32-buckets"]["gate"]
    assert padded["passed"] is True and padded["padded"]["max_prob_diff"] <= 1e-6
    assert padded["padded_recipe"]["max_prob_diff"] <= 1e-5
    assert "padded_recipe" not in by_cell["c2-fp32"]["gate"]  # pads nothing
    # The gates run in their own phase, after the cold call and the ready time.
    assert by_cell["c22-fp32-buckets"]["padding_gates"]["routes"] == ["padded", "padded_recipe"]
    assert by_cell["c2-fp32"]["padding_gates"] == {"skipped": "the cell pads nothing"}
    promoted = document["promotion"]["small-quick"]["one_shot"]["cell"]
    assert promoted in ("c2-fp32", "c22-fp32-buckets")

    assert "Latency (ms" in printed and "c2-fp32" in printed and "Skipped cells:" in printed
    assert "  c5-fp16 (small-quick): skipped: no CUDA device" in printed
    assert f"small-quick: one_shot {promoted}" in printed
    assert out.with_suffix(".png").stat().st_size > 1000
    recipes = json.loads((tmp_path / "recipes.json").read_text())
    assert recipes["devices"]["cpu"]["workloads"]["small-quick"]["one_shot"]["cell"] == promoted


@pytest.mark.parametrize(
    "graphs", [("kv_graphs",), ("shape_graphs",), ("kv_graphs", "shape_graphs")]
)
def test_graph_cells_gate_their_padded_test_rows(tmp_path, monkeypatch, graphs):
    """A kv_graphs cell's padding gate compares its KV-cached prediction with test rows padded
    (one fewer than the workload's, off the test buckets) against the plain model's; a
    shape_graphs cell's likewise its one-shot call; a cell with both, both (joined along the
    test rows). The graphs need CUDA: here a served model replays through a CPU stand-in."""
    import dataclasses

    from tabserve.bench.engines import TabserveEngine
    from tabserve.models.tabicl import serving
    from test_padded_inference import _ReplayOnCPU

    class ServedOnCPU(serving.ServedTabICL):
        def __init__(self, model, recipe, grid=None):
            super().__init__(model, recipe.replace(kv_graphs=False, shape_graphs=False), grid)
            self.recipe = recipe
            self._raw_forward_cached = self._graph_core(self.model.forward_cached_raw)
            self._raw_forward = self._graph_core(serving._one_shot_core(self.model))

    monkeypatch.setattr(serving, "_BucketGraph", _ReplayOnCPU)
    monkeypatch.setattr(serving, "ServedTabICL", ServedOnCPU)
    workload = workload_by_name("small-quick")
    checkpoint = make_checkpoint("clf", tmp_path / "tiny.ckpt", size="tiny")
    engine = TabserveEngine(cell_by_name("c2-fp32"), workload, checkpoint, torch.device("cpu"))
    assert engine.padding_gate(*model_tables(workload, 0, torch.device("cpu"))) is None
    engine.cell = dataclasses.replace(engine.cell, **dict.fromkeys(graphs, True))
    X, y = model_tables(workload, 0, torch.device("cpu"))
    padded, unpadded = engine.padding_gate(X, y)
    assert padded.shape == unpadded.shape
    rows = (workload.n_test - 1) * len(graphs)  # 31 rows each: bucket 32
    assert padded.shape[:2] == (workload.members, rows)
    figures = gates.compare("clf", padded, unpadded)
    assert not gates.check(figures, gates.LIMITS["padded"]) and figures["max_prob_diff"] <= 1e-6


def test_recipe_padding_gate_compares_the_cells_own_call(tmp_path, monkeypatch):
    """The recipe's padding gate: the padded side is the cell's timed call itself, on a table
    with one train and one test row fewer than the workload's (both blocks off the grid), the
    unpadded side the same recipe's kernels on a plain model. A fault in the timed path only
    (here: one probability moved) fails it; the fp32 eager gate cannot see such a fault."""
    from tabserve.bench.engines import TabserveEngine

    workload = workload_by_name("small-quick")
    checkpoint = make_checkpoint("clf", tmp_path / "tiny.ckpt", size="tiny")
    cpu = torch.device("cpu")
    X, y = model_tables(workload, 0, cpu)
    plain = TabserveEngine(cell_by_name("c2-fp32"), workload, checkpoint, cpu)
    assert plain.recipe_padding_gate(X, y) is None
    engine = TabserveEngine(cell_by_name("c22-fp32-buckets"), workload, checkpoint, cpu)
    calls = []
    one_shot = engine.one_shot
    engine.one_shot = lambda X, y: calls.append((X.shape, y.shape)) or one_shot(X, y)
    padded, unpadded = engine.recipe_padding_gate(X, y)
    n_train, n_test = workload.n_train, workload.n_test
    table = (workload.members, n_train + n_test - 2, X.shape[2])
    assert calls == [(table, (workload.members, n_train - 1))]
    assert padded.shape == unpadded.shape and padded.shape[1] == n_test - 1
    figures = gates.compare("clf", padded, unpadded)
    assert not gates.check(figures, gates.LIMITS["padded_recipe_fp32"])

    def faulty(X, y):
        out = one_shot(X, y).clone()
        least = out[0, 0].argmin()
        out[0, 0] = 0.0
        out[0, 0, least] = 1.0  # certain of the least likely class: off by >= 1 / K
        return out

    engine.one_shot = faulty
    figures = gates.compare("clf", *engine.recipe_padding_gate(X, y))
    assert gates.check(figures, gates.LIMITS["padded_recipe_fp32"])
    assert gates.check(figures, gates.LIMITS["padded_recipe_reduced"])


def test_ab_mode_alternates_two_cells_on_one_model(tmp_path):
    # In-process (the CLI runs this same function in a subprocess): saves an interpreter start.
    checkpoint = make_checkpoint("clf", tmp_path / "tiny.ckpt", size="tiny")
    spec = {
        "mode": "ab",
        "cells": ["c2-fp32", "c13-fp32-kv"],
        "workload": "small-quick",
        "device": "cpu",
        "checkpoint": str(checkpoint),
        "windows": 2,
        "ab_calls": 1,
        "result": str(tmp_path / "ab.json"),
    }
    ab = measure.run_ab(spec)
    assert json.loads((tmp_path / "ab.json").read_text()) == ab
    assert ab["status"] == "ok" and ab["bitwise_equal"] is True
    assert len(ab["slots_ms"]["A"]) == 4 and ab["summary"]["windows"] == 2
    assert ab["outputs_stable"] == {"A": True, "B": True}
    assert "outputs bitwise equal: True" in report.render_ab(ab)
    assert "B's output unchanged after the windows: True" in report.render_ab(ab)


def test_deadline_reports_unstarted_jobs_as_skipped_and_still_writes_the_report(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--device", "cpu", "--quick", "--model-size", "tiny", "--workloads", "small-quick"]
    argv += ["--cells", "c2-fp32", "c13-fp32-kv", "--deadline", "0", "--out", str(out)]
    assert main(argv + ["--quiet", "--no-plot"]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["cell"] for r in results] == ["c2-fp32", "c13-fp32-kv"]
    for result in results:
        assert result["status"] == "skipped"
        assert result["reason"] == "skipped: the run's --deadline of 0 s had passed"


def test_cells_without_an_fp32_cell_get_a_gate_only_reference(tmp_path, capsys):
    # c13 alone would be unchecked (no fp32 outputs in the run): the driver adds a gate-only
    # c0-ref-fp32 job (one call, no timing) so the gate runs and the cell can be promoted.
    out = tmp_path / "bench.json"
    argv = ["--device", "cpu", "--quick", "--model-size", "tiny", "--workloads", "small-quick"]
    argv += ["--cells", "c13-fp32-kv", "--budget", "0.02", "--out", str(out)]
    assert main(argv + ["--quiet", "--no-plot", "--timeout", "120"]) == 0
    document = json.loads(out.read_text())
    by_cell = {r["cell"]: r for r in document["results"]}
    assert list(by_cell) == ["c0-ref-fp32", "c13-fp32-kv"]
    reference = by_cell["c0-ref-fp32"]
    assert reference["status"] == "ok" and reference["gate_only"] is True
    assert reference["cold"]["first_call_ms"] > 0
    assert "one_shot" not in reference and "kv" not in reference
    gate = by_cell["c13-fp32-kv"]["gate"]
    assert gate["reference"] == "c0-ref-fp32" and gate["passed"] is True
    assert gate["one_shot"]["max_prob_diff"] < 1e-4
    assert document["promotion"]["small-quick"]["one_shot"]["cell"] == "c13-fp32-kv"
    assert {c["name"] for c in document["cells"]} == {"c0-ref-fp32", "c13-fp32-kv"}
    printed = capsys.readouterr().out
    assert "gate-ref" in printed
    # The plot draws the timed cell only (a gate-only row has no one-shot figures).
    assert report.plot(document, tmp_path / "bench.png").stat().st_size > 0

    # Opting out leaves the gate unchecked, and nothing is promoted.
    out2 = tmp_path / "bench2.json"
    argv2 = argv[:-1] + [str(out2), "--no-gate-reference"]
    assert main(argv2 + ["--quiet", "--no-plot", "--timeout", "120"]) == 0
    document = json.loads(out2.read_text())
    (result,) = document["results"]
    assert result["gate"]["passed"] is None and document["promotion"] == {}

    # Merging: the gate-only result never replaces the earlier measured one.
    measured = {"workload": "small-quick", "cell": "c0-ref-fp32", "status": "ok",
                "one_shot": {"median_ms": 5.0}}
    first = dict(document, results=[measured])
    second = dict(document, results=[dict(reference)])
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, doc in zip(paths, (first, second)):
        path.write_text(json.dumps(doc))
    merged_out = tmp_path / "merged.json"
    argv3 = ["--merge", *map(str, paths), "--out", str(merged_out), "--no-plot"]
    argv3 += ["--recipes", str(tmp_path / "r.json")]
    assert main(argv3) == 0
    (kept,) = json.loads(merged_out.read_text())["results"]
    assert kept["one_shot"]["median_ms"] == 5.0 and not kept.get("gate_only")


def test_gate_reference_cell_choice():
    from tabserve.bench.cli import gate_reference_cell

    assert gate_reference_cell([cell_by_name("c13-fp32-kv")], "cpu").name == "c0-ref-fp32"
    assert gate_reference_cell([cell_by_name("c2-fp32"), cell_by_name("c13-fp32-kv")], "cpu") is None
    assert gate_reference_cell([], "cpu") is None


# -- the profiler script (benchmarks/profile_tabiclv2.py) -----------------------------------------


def test_aot_restart_cell_exports_then_serves_from_the_packages(tmp_path, capsys):
    """c28 for real on CPU: the priming process exports the workload's bucket package, the
    measured process loads it, answers from it (gated against fp32) and reports ready_ms."""
    out = tmp_path / "aot.json"
    argv = ["--device", "cpu", "--model-size", "tiny", "--workloads", "small-quick", "--cells"]
    argv += ["c28-fp32-buckets-aot-restart", "--budget", "0.05", "--out", str(out), "--quiet"]
    assert main(argv + ["--no-plot", "--timeout", "300"]) == 0
    document = json.loads(out.read_text())
    result = {r["cell"]: r for r in document["results"]}["c28-fp32-buckets-aot-restart"]
    assert result["status"] == "ok", (result.get("reason"), result.get("log_tail"))
    assert result["aot"]["packages"] == 1 and result["aot"]["load_ms"] > 0
    assert result["priming"]["compile_cache"] == {"aot": ["bucket-128x32x8-b2.pt2"]}
    assert result["cold"]["jit"]["graphs"] == 0  # the restart traced nothing
    assert result["gate"]["passed"] is True and result["gate"]["one_shot"]["max_prob_diff"] < 1e-5
    assert result["ready_ms"] > result["cold"]["first_call_ms"]
    assert result["kv"] == {"skipped": "a warm-cache cell measures the restart's first answer and one-shot"}
    assert "small-quick" not in document["promotion"]  # packages are not a recipe name
    assert "c28-fp32-buckets-aot-restart: first answer" in capsys.readouterr().out


def test_targets_read_the_promoted_cells_and_never_call_unmeasured_met():
    from tabserve.bench import targets

    def ok(cell, workload, **phases):
        return {"cell": cell, "workload": workload, "status": "ok", **phases}

    def memory(allocated):
        return {"median_ms": 1.0, "memory": {"peak_allocated_bytes": allocated, "peak_reserved_bytes": 0}}

    results = [
        ok("c10", "large", speedup={"one_shot": {"ref16": 4.2, "ref32": 9.9}, "kv": {"ref16": 3.0}}),
        ok("c1-ref-fp16", "xlarge", one_shot=memory(100)),
        ok("c5", "xlarge", one_shot=memory(120), speedup={"one_shot": {"ref16": 3.5}}),
        ok("c18", "stream", stream={"fresh_over_warm_p50": 1.1, "recompiles": 2}),
        ok("c20", "small", priming={"cold_ms": 1.0}, ready_ms=21_700.0),
        {"cell": "c20", "workload": "large", "status": "timeout", "priming": {}, "ready_ms": 9.0},
    ]
    def best(cell):
        return {"cell": cell, "median_ms": 1.0}

    promotion = {"large": {"one_shot": best("c10"), "kv_predict": best("c10")},
                 "xlarge": {"one_shot": best("c5")}, "stream": {"stream": best("c18")}}
    rows = {r["target"]: r for r in targets.evaluate({"results": results, "promotion": promotion})}
    verdict = {name: row["verdict"] for name, row in rows.items()}
    assert verdict["large one-shot vs reference fp16"] == "met"  # 4.2 >= 4
    assert verdict["large one-shot vs reference fp32"] == "missed"  # 9.9 < 10
    assert verdict["large KV-cached predict vs reference cached fp16"] == "missed"
    assert verdict["small one-shot vs reference fp16"] == "not measured"  # nothing promoted
    assert verdict["xlarge one-shot vs reference fp16"] == "met"
    assert rows["xlarge peak memory over reference fp16"]["value"] == pytest.approx(1.2)
    assert verdict["xlarge peak memory over reference fp16"] == "missed"
    stream_target = "stream fresh p50 over warm, 0 recompiles / captures"
    assert verdict[stream_target] == "missed"  # fast, but recompiled
    for captures, expected in ((3, "missed"), (0, "met"), (None, "met")):  # None: no graphs
        quiet = dict(results[3], stream={"fresh_over_warm_p50": 1.1, "recompiles": 0,
                                         "captures": captures})
        again = {"results": [*results[:3], quiet, *results[4:]], "promotion": promotion}
        rows = {r["target"]: r for r in targets.evaluate(again)}
        assert rows[stream_target]["verdict"] == expected, captures
    restart = rows["restart from compile-cache artifacts, s"]  # the timed-out restart is ignored
    assert (restart["cell"], restart["workload"], restart["value"], restart["verdict"]) == (
        "c20", "small", 21.7, "met")
    # A cell that captures graphs: its timed replays' peak misses the pool, the cold call's not.
    graphed = ok("c5", "xlarge", one_shot=memory(30), cold={"memory": {"peak_allocated_bytes": 90}},
                 captures=1, speedup={"one_shot": {"ref16": 3.5}})  # fmt: skip
    rows = {r["target"]: r for r in targets.evaluate(
        {"results": [*results[:2], graphed, *results[3:]], "promotion": promotion})}  # fmt: skip
    assert rows["xlarge peak memory over reference fp16"]["value"] == pytest.approx(0.9)
    assert targets.peak_allocated(dict(graphed, captures=None), "one_shot") == 30
    printed = report.render({"settings": {"device": "cuda", "checkpoint_note": "x"},
                             "environment": {"gpu": "G", "torch": "t", "tabicl": "2", "tabserve": "0"},
                             "results": results, "promotion": promotion})
    assert "Targets (issues 5 and 6" in printed and "not measured" in printed


def test_merged_reference_history_and_the_fastest_reference_column(tmp_path, capsys):
    """Merging keeps every run's reference medians (a merged document brings its own runs' and
    counts each run once); the speedup targets keep their same-run verdict and add the figure
    against the fastest reference run in the document (hand-computed below)."""
    from tabserve.bench import targets

    FAST = "c39-fp16-buckets-compile-cudagraphs-head16-row-fused-frozen"

    def run(reference_ms, cell_ms, created):
        results = [
            {
                "workload": "small",
                "cell": "c1-ref-fp16",
                "status": "ok",
                "one_shot": {"median_ms": reference_ms},
                "kv": {"median_ms": 20.0},
            },
            {
                "workload": "small",
                "cell": FAST,
                "status": "ok",
                "one_shot": {"median_ms": cell_ms},
                "kv": {"median_ms": 1.0},
                "gate": {"passed": True},
            },
        ]
        return {
            "schema": report.SCHEMA,
            "created": created,
            "environment": {"gpu": "G", "torch": "t", "tabicl": "2", "tabserve": "0"},
            "settings": {"device": "cuda", "checkpoint_note": "x"},
            "workloads": [{"name": "small"}],
            "results": results,
        }

    assert report.reference_medians(run(30.0, 4.0, "a")["results"]) == {
        "small": {"one_shot": {"c1-ref-fp16": [30.0]}, "kv": {"c1-ref-fp16": [20.0]}}
    }
    paths = []
    for i, (reference_ms, cell_ms) in enumerate([(30.0, 4.0), (50.0, 3.5)]):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run(reference_ms, cell_ms, str(i))))
    merged = tmp_path / "merged.json"
    argv = ["--merge", *map(str, paths), "--out", str(merged), "--no-plot"]
    assert main(argv) == 0
    document = json.loads(merged.read_text())
    assert document["reference_medians"]["small"]["one_shot"]["c1-ref-fp16"] == [30.0, 50.0]
    assert document["reference_medians"]["small"]["kv"]["c1-ref-fp16"] == [20.0]
    # Merging the merged document with one of its runs again adds no run twice.
    again = tmp_path / "again.json"
    assert main(["--merge", str(merged), str(paths[1]), "--out", str(again), "--no-plot"]) == 0
    history = json.loads(again.read_text())["reference_medians"]["small"]["one_shot"]
    assert history == {"c1-ref-fp16": [30.0, 50.0]}
    promotion = {"small": {"one_shot": {"cell": FAST, "median_ms": 3.5}}}
    rows = {r["target"]: r for r in targets.evaluate(dict(document, promotion=promotion))}
    small = rows["small one-shot vs reference fp16"]
    assert small["value"] == pytest.approx(50.0 / 3.5) and small["verdict"] == "met"
    assert small["vs_fastest_reference"] == pytest.approx(30.0 / 3.5)
    assert small["reference_runs"] == 2
    assert "8.57 (2 runs)" in capsys.readouterr().out
    # A later run of the reference alone (or of other cells) leaves the cell's speedup the one
    # of its own run: 50 / 3.5, not 20 / 3.5 against the later, faster reference.
    later = run(20.0, 3.0, "2")
    later["results"] = later["results"][:1]
    paths.append(tmp_path / "run2.json")
    paths[-1].write_text(json.dumps(later))
    assert main(["--merge", str(merged), str(paths[2]), "--out", str(again), "--no-plot"]) == 0
    by_cell = {r["cell"]: r for r in json.loads(again.read_text())["results"]}
    assert by_cell[FAST]["speedup"]["one_shot"]["ref16"] == pytest.approx(50.0 / 3.5)
    # A run without a reference cell takes the merged document's.
    alone = run(99.0, 5.0, "3")
    alone["results"] = alone["results"][1:]
    alone["results"][0]["cell"] = "c33-fp16-buckets-compile-cudagraphs-head16-row"
    paths.append(tmp_path / "run3.json")
    paths[-1].write_text(json.dumps(alone))
    assert main(["--merge", str(again), str(paths[3]), "--out", str(again), "--no-plot"]) == 0
    by_cell = {r["cell"]: r for r in json.loads(again.read_text())["results"]}
    assert by_cell[FAST]["speedup"]["one_shot"]["ref16"] == pytest.approx(50.0 / 3.5)
    new = by_cell["c33-fp16-buckets-compile-cudagraphs-head16-row"]["speedup"]
    assert new["one_shot"]["ref16"] == pytest.approx(20.0 / 5.0)


def test_stream_reports_fresh_over_warm_and_recompiles(tmp_path, capsys):
    """The stream phase times each fresh table once, then the same tables warm: the issue-5
    stream target (fresh p50 over the warm latency of the same bucket) comes out per cell."""
    out = tmp_path / "stream.json"
    argv = ["--device", "cpu", "--model-size", "tiny", "--workloads", "stream-quick", "--cells"]
    argv += ["c2-fp32", "c22-fp32-buckets", "--budget", "0.05", "--out", str(out), "--quiet"]
    assert main(argv + ["--no-plot", "--timeout", "300"]) == 0
    by_cell = {r["cell"]: r for r in json.loads(out.read_text())["results"]}
    for name in ("c2-fp32", "c22-fp32-buckets"):
        stream = by_cell[name]["stream"]
        assert len(stream["warm_samples_ms"]) == len(stream["shapes"]) == 4
        ratios = [f / w for f, w in zip(stream["samples_ms"], stream["warm_samples_ms"])]
        assert stream["fresh_over_warm_p50"] == pytest.approx(statistics.median(ratios))
        assert stream["warm_median_ms"] == pytest.approx(statistics.median(stream["warm_samples_ms"]))
        assert stream["recompiles"] == 0  # eager cells: nothing to compile
        assert stream["captures"] is None  # nor to capture
    printed = capsys.readouterr().out
    assert "fresh/warm p50" in printed and "target <= 1.25x" in printed


def test_profiler_splits_eager_time_by_stage_and_writes_tables(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import profile_tabiclv2

    out, js = tmp_path / "profile.txt", tmp_path / "profile.json"
    argv = ["--device", "cpu", "--workload", "small-quick", "--model-size", "tiny", "--repeats", "2"]
    argv += ["--cells", "c2-fp32", "c5-fp16", "--out", str(out), "--json", str(js)]
    assert profile_tabiclv2.main(argv + ["--trace", str(tmp_path / "traces")]) == 0
    eager, cuda_only = json.loads(js.read_text())
    assert eager["cell"] == "c2-fp32" and len(eager["wall_ms_all"]) == 2
    assert eager["wall_ms_median"] > 0
    # Every stage ran and was timed; together they fit in the same calls' wall time (read
    # against those calls, not the separately timed ones: a busy CI box slows one set alone).
    assert all(eager["stage_gpu_ms"][s] > 0 for s in ("col", "row", "icl"))
    assert len(eager["stage_call_wall_ms"]) == 2
    assert sum(eager["stage_gpu_ms"].values()) <= 1.5 * max(eager["stage_call_wall_ms"])
    # A cell that cannot run on this device is reported, not fatal.
    assert cuda_only == {"cell": "c5-fp16", "workload": "small-quick",
                         "skipped": "skipped: no CUDA device"}
    assert "device_busy_ms" not in eager  # CPU: no kernel timeline
    top = eager["top_rows"]  # the heaviest operators as data, heaviest first
    assert 0 < len(top) <= profile_tabiclv2.TOP_ROWS and all(r["calls"] >= 1 for r in top)
    assert [r["self_ms"] for r in top] == sorted((r["self_ms"] for r in top), reverse=True)
    assert any(r["name"].startswith("aten::") for r in top)
    text = out.read_text()
    assert "c2-fp32 on small-quick: kernels by device time" in text and "aten::" in text
    # The profiled call as a Perfetto trace, for the cell that ran (the skipped one has none).
    (trace,) = (tmp_path / "traces").iterdir()
    assert trace.name == "trace_small-quick_c2-fp32.json.gz"
    names = {e.get("name") for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]}
    assert any(str(n).startswith("aten::") for n in names)


def test_profiler_profiles_the_kv_cached_prediction(tmp_path, monkeypatch):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import profile_tabiclv2
    from tabserve.bench import engines

    calls = []  # which engine methods the profiled and timed calls went through
    for method in ("one_shot", "build_cache", "predict_cached"):
        original = getattr(engines.TabserveEngine, method)
        monkeypatch.setattr(
            engines.TabserveEngine,
            method,
            lambda self, *a, _m=method, _f=original: calls.append(_m) or _f(self, *a),
        )
    js = tmp_path / "profile.json"
    argv = ["--device", "cpu", "--workload", "small-quick", "--model-size", "tiny", "--repeats", "2"]
    argv += ["--cells", "c2-fp32", "--phase", "kv", "--out", str(tmp_path / "p.txt")]
    assert profile_tabiclv2.main(argv + ["--json", str(js)]) == 0
    (summary,) = json.loads(js.read_text())
    assert summary["phase"] == "kv" and len(summary["wall_ms_all"]) == 2
    # One cache build, then only cached predictions: 3 warm-up, 2 timed, 2 stage-timed, 1 profiled.
    assert calls == ["build_cache"] + ["predict_cached"] * 8
    with pytest.raises(SystemExit):
        profile_tabiclv2.main(argv[:-4] + ["--phase", "nope"])


def test_skipped_phases_are_reported_not_measured(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--device", "cpu", "--quick", "--model-size", "tiny", "--workloads", "small-quick"]
    argv += ["--cells", "c2-fp32", "--skip-phases", "kv", "end_to_end", "--budget", "0.02"]
    assert main(argv + ["--out", str(out), "--quiet", "--no-plot", "--timeout", "120"]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["status"] == "ok" and result["one_shot"]["median_ms"] > 0
    for phase in ("kv", "end_to_end"):
        assert result[phase] == {"skipped": "not measured in this run (--skip-phases)"}
    with pytest.raises(SystemExit):
        main(argv[:-2] + ["--skip-phases", "one_shot"])
