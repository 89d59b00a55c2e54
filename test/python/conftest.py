"""Settings every test process shares."""

import os
import sys
import tempfile

import pytest
from cuda_helpers import NO_GPU

# The per-user cache (the benchmark driver's own promotions, read by recipe="auto") goes to a
# folder made for this pytest run, so tests neither read nor write the user's real one; child
# processes inherit it.
os.environ["TABSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="tabserve-test-cache-")


@pytest.fixture(autouse=True)
def _background_compiles_end_with_their_test():
    """A test that queued background warm-ups waits for them before the next test starts: a
    warm-up pauses while estimator calls run, so one left behind would otherwise compile (and
    count graphs, and hold tensors) inside a later test."""
    yield
    background = sys.modules.get("tabserve.models.tabicl.serving.background")
    if background is not None:
        assert background.wait_for_compiles(600), "a background warm-up outlived its test by 600 s"


def pytest_collection_modifyitems(items):
    """A test that skips without a GPU is a CUDA test: ``-m cuda`` (the GPU machine's test
    stages) selects it, whichever helper or decorator gave it the skip."""
    for item in items:
        if any(mark.kwargs.get("reason") == NO_GPU for mark in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)
