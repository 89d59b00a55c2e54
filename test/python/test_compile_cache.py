"""tabserve.compile_cache: artifacts saved by one process make a fresh process's compile a cache
hit (Dynamo counters decide), and bad files are refused with a clear error before torch reads
them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tabserve import compile_cache
from tabserve.compile_cache import CompileCacheError

# One process of a "server": optionally load artifacts, compile and run f, report the Inductor
# cache counters and the output; optionally save the artifacts.
SERVER = textwrap.dedent(
    """
    import json, sys, torch
    from torch._dynamo.utils import counters
    from tabserve import compile_cache

    mode, path = sys.argv[1], sys.argv[2]
    report = {}
    if mode == "save":
        try:
            compile_cache.save(path)
        except compile_cache.CompileCacheError as error:
            report["empty_save"] = str(error)
    if mode == "load":
        report["header"] = compile_cache.load(path)

    def f(x, w):
        return torch.tanh(x @ w) * 2 + x.sum(-1, keepdim=True).cos()

    compiled = torch.compile(f, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 7, generator=g), torch.randn(7, 7, generator=g)
    report["output"] = compiled(x, w).tolist()
    report["inductor"] = dict(counters["inductor"])
    if mode == "save":
        report["saved"] = compile_cache.save(path, recipe="test", grid=[[8, 16]])
    print(json.dumps(report))
    """
)


def _server(tmp_path, mode: str, cache_dir: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / cache_dir))
    done = subprocess.run(
        [sys.executable, "-c", SERVER, mode, str(tmp_path / "artifacts.bin")],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_restarted_process_compiles_from_the_saved_artifacts(tmp_path):
    first = _server(tmp_path, "save", "cache-a")
    assert "no compile-cache artifacts" in first["empty_save"]
    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1
    saved = first["saved"]
    assert saved["bytes"] > 0 and saved["artifacts"].get("inductor", 0) >= 1
    assert saved["tags"] == {"recipe": "test", "grid": [[8, 16]]}

    # Empty caches of its own: only the artifacts can make it a hit.
    second = _server(tmp_path, "load", "cache-b")
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert second["header"]["tags"] == saved["tags"]
    assert second["output"] == first["output"]
    x = torch.tensor(first["output"])
    assert torch.isfinite(x).all()


def _write(path, header: dict | None, payload: bytes = b"x", magic=compile_cache.MAGIC):
    line = b"" if header is None else json.dumps(header).encode() + b"\n"
    path.write_bytes(magic + line + payload)
    return path


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: _write(p, {}, magic=b"something else\n"), "not a tabserve compile cache"),
        (lambda p: _write(p, None, payload=b"{not json"), "truncated or its header is not JSON"),
        (lambda p: _write(p, compile_cache.environment(), payload=b""), "truncated"),
        (
            lambda p: _write(p, {**compile_cache.environment(), "torch": "1.0.0"}),
            "made for another environment (torch: file '1.0.0'",
        ),
        (
            lambda p: _write(p, {**compile_cache.environment(), "gpu": "Some Other GPU"}),
            "gpu: file 'Some Other GPU'",
        ),
        (lambda p: _write(p, compile_cache.environment(), b"\x00garbage"), "could not read"),
    ],
    ids=["magic", "header", "no-payload", "torch-version", "gpu", "payload"],
)
def test_bad_files_are_refused_with_the_reason(tmp_path, make, message):
    path = make(tmp_path / "bad.bin")
    with pytest.raises(CompileCacheError, match=message.replace("(", r"\(")):
        compile_cache.load(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        compile_cache.load(tmp_path / "nowhere.bin")


SERVED = textwrap.dedent(
    """
    import copy, json, sys
    from tabicl_helpers import our_model, random_table
    from tabserve.buckets import BucketGrid
    from tabserve.models.tabicl.serving.options import ServingOptions
    from tabserve.models.tabicl.serving.served import ServedTabICL
    from torch._dynamo.utils import counters

    mode, path = sys.argv[1], sys.argv[2]
    header = ServedTabICL.load_compile_cache(path) if mode == "load" else None
    grid = BucketGrid(train_rows=(16,), test_rows=(8,), features=(6,))
    model = copy.deepcopy(our_model("clf", "tiny"))
    served = ServedTabICL(model, ServingOptions(buckets=True, compile="default"), grid)
    served.warm_up(tables=2)
    X, y = random_table(3, 2, 12, 5, 4, 3)
    report = {"inductor": dict(counters["inductor"]), "header": header,
              "max_diff": float((served(X, y) - our_model("clf", "tiny")(X, y)).abs().max())}
    if mode == "save":
        report["saved"] = served.save_compile_cache(path)
    print(json.dumps(report))
    """
)


def test_served_model_restarts_from_its_compile_cache(tmp_path):
    """ServedTabICL (bucketed Inductor compile, CPU): the restarted server's warm-up hits the
    cache for its bucket and serves the same predictions."""
    here = os.path.dirname(__file__)
    runs = {}
    for mode, cache in (("save", "a"), ("load", "b")):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / cache))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
        done = subprocess.run(
            [sys.executable, "-c", SERVED, mode, str(tmp_path / "served.bin")],
            env=env, capture_output=True, text=True, timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs["save"]["saved"]["tags"]["options"]["compile"] == "default"
    assert runs["load"]["header"]["tags"]["grid"]["train_rows"] == [16]
    assert runs["load"]["inductor"].get("fxgraph_cache_hit", 0) >= 1
    assert runs["load"]["inductor"].get("fxgraph_cache_miss", 0) == 0
    for run in runs.values():
        assert run["max_diff"] <= 1e-5
