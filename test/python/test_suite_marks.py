"""The test suite's own marks: the GPU machine's test stages select CUDA tests with ``-m cuda``,
so every test that skips without a GPU must carry the mark, whichever helper skipped it."""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_every_test_that_skips_without_a_gpu_is_selected_by_the_cuda_mark():
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", "cuda", str(HERE / "test_many_tables.py"), str(HERE / "test_all_equal.py")],
        capture_output=True, text=True, cwd=HERE.parents[1], timeout=300,
    )  # fmt: skip
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    selected = {
        line.split("::")[1].split("[")[0] for line in collected.stdout.splitlines() if "::" in line
    }
    # skipped by the estimators' helper (tabicl_helpers.requires_cuda), by a file's own skipif
    assert "test_cuda_packed_regression_with_frames_answers_as_each_tasks_own_estimator" in selected
    assert {"test_cuda_equals_cpu", "test_cuda_long_sets_and_many_sets"} <= selected
    assert "test_classifier_answers_are_each_tasks_own_estimators" not in selected  # CPU tests stay out
    assert "test_cpu_equals_aten" not in selected
