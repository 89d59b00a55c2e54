"""Ahead-of-time bucket packages: a served model's padded forward, compiled per bucket with
AOTInductor, saved to a directory and loaded by a restarted server without tracing or compiling.

Compile-cache artifacts (:mod:`tabserve.compile_cache`) spare a restart Inductor's code generation
but not Dynamo's tracing nor the reload of every graph, about 20 s per bucket on the H200 for the
small workload. A bucket package is the bucket's whole forward as one shared library
(``torch.export`` of :meth:`TabICLv2.padded_forward` at the bucket's static shapes, the options'
precision and attention backends baked in, then ``torch._inductor.aoti_compile_and_package``);
loading one takes milliseconds and its first call runs compiled kernels at once. The real
train-row and feature counts stay device tensors, so one package serves every table of its bucket.

Layout of a directory: ``manifest.json`` (:func:`environment`, the options, the grid and one entry
per package: kind, bucket, batch size, file name) and one ``.pt2`` per entry:
``bucket-<train>x<test>x<features>-b<batch>.pt2`` for the one-shot forward, with ``kv_cache``
also ``build-cache-<train>x0x<features>-b<batch>.pt2`` (the cache of a padded train block) and
``forward-cached-<train>x<test>x<features>-b<batch>.pt2`` (test rows against that cache).

Security: a package holds compiled code that runs when loaded. Load only directories your own
deployment wrote, like a compile cache; model checkpoints, by contrast, load without executing code.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from tabserve.buckets import Bucket

from ..network.model import padded_counts
from .options import describe

MANIFEST = "manifest.json"
FORMAT = "tabserve-aot-buckets/1"


#: Loading CUDA packages crashed the process on the H200 (a segmentation fault inside
#: ``torch._inductor.aoti_load_package``, torch 2.11.0+cu130; docs/guide/serving.md), so
#: :func:`load` refuses them unless this variable is ``1`` (for whoever investigates the crash).
ALLOW_CUDA_ENV = "TABSERVE_ALLOW_CUDA_AOT"


class AotPackageError(ValueError):
    """A bucket directory that is missing, malformed, or made for another environment, options or
    bucket grid, or packages this build refuses to load (CUDA: :data:`ALLOW_CUDA_ENV`)."""


def _package_options(served) -> str:
    """The served options a package is made for: all but ``cuda_graphs``, which replays the
    packages' kernels from a graph without changing what they compute."""
    return describe(served.options.replace(cuda_graphs=False))


def refuse_cuda_packages(device: torch.device | str) -> None:
    """Raises :class:`AotPackageError` for packages of a CUDA model unless :data:`ALLOW_CUDA_ENV`
    is ``1``: a crash of the server process is worse than serving without the packages."""
    if torch.device(device).type == "cuda" and os.environ.get(ALLOW_CUDA_ENV) != "1":
        raise AotPackageError(
            "loading AOT bucket packages on CUDA is disabled: torch's AOTInductor loader crashed "
            "the process on them (segmentation fault, torch 2.11, see docs/guide/serving.md); serve "
            f"with compile-cache artifacts instead, or set {ALLOW_CUDA_ENV}=1 to try anyway"
        )


def environment() -> dict:
    """What a package depends on; a directory made under a different value is refused."""
    from tabserve import compile_cache

    return compile_cache.environment()


class _Core(torch.nn.Module):
    """An exported function: one of the model's padded entry points under the options'
    precision context (``padded_forward``, ``padded_build_cache`` or ``padded_forward_cached``)."""

    def __init__(self, served, entry: str):
        super().__init__()
        self.model = served.model
        self.options = served.options
        self.device = served.device
        self.entry = entry

    def forward(self, *inputs):
        with self.options.context(self.device):
            return getattr(self.model, self.entry)(*inputs)


#: Package kinds: the ServedTabICL path each one replaces, and the model entry point it exports.
KINDS = {
    "forward": "padded_forward",
    "build_cache": "padded_build_cache",
    "forward_cached": "padded_forward_cached",
}


class _Runner:
    """A loaded package, called with contiguous inputs: AOTInductor's kernels assume the strides
    of the example inputs (contiguous, see :func:`export`) and do not check them; a strided view
    passed as is would be read as if it were contiguous."""

    def __init__(self, package):
        self.package = package

    def __call__(self, *inputs):
        return self.package(*tree_map(_contiguous, inputs))


def _contiguous(value):
    return value.contiguous() if isinstance(value, Tensor) else value


def _file_name(kind: str, bucket: Bucket, batch: int) -> str:
    prefix = "bucket" if kind == "forward" else kind.replace("_", "-")
    return f"{prefix}-{bucket.train_rows}x{bucket.test_rows}x{bucket.features}-b{batch}.pt2"


def example_inputs(served, bucket: Bucket, batch: int) -> tuple[Tensor, ...]:
    """Random inputs of a bucket's padded forward (the shapes are what the package fixes)."""
    generator = torch.Generator().manual_seed(0)
    rows = bucket.train_rows + bucket.test_rows
    X = torch.randn(batch, rows, bucket.features, generator=generator).to(served.device)
    y = torch.arange(bucket.train_rows).remainder(2).float().repeat(batch, 1).to(served.device)
    return (X, y, *padded_counts(served.device, bucket.train_rows, bucket.features))


def _package(served, directory: Path, kind: str, bucket: Bucket, batch: int, inputs) -> dict:
    # Contiguous examples: the package's kernels are specialised to these strides.
    inputs = tree_map(_contiguous, tuple(inputs))
    program = torch.export.export(_Core(served, KINDS[kind]), inputs, strict=False)
    name = _file_name(kind, bucket, batch)
    torch._inductor.aoti_compile_and_package(program, package_path=str(directory / name))
    return {"kind": kind, "bucket": dataclasses.asdict(bucket), "batch": batch, "file": name}


@torch.no_grad()
def export(
    served,
    directory: str | os.PathLike,
    buckets: Sequence[Bucket],
    tables: int,
    kv_cache: bool = False,
) -> dict:
    """Compiles one package per bucket for batches of ``tables`` tables into ``directory`` and
    writes its manifest; returns the manifest. With ``kv_cache`` also the cache build of each
    bucket's train block (once per train-row and feature bucket) and the cached forward of its
    test block."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for bucket in buckets:
        X, y, n_train, n_features = example_inputs(served, bucket, tables)
        inputs = (X, y, n_train, n_features)
        entries.append(_package(served, directory, "forward", bucket, tables, inputs))
        if not kv_cache:
            continue
        train = Bucket(bucket.train_rows, 0, bucket.features)
        build = (X[:, : bucket.train_rows], y, n_train, n_features)
        done = {(e["kind"], e["file"]) for e in entries}
        if ("build_cache", _file_name("build_cache", train, tables)) not in done:
            entries.append(_package(served, directory, "build_cache", train, tables, build))
        col, icl = _Core(served, KINDS["build_cache"])(*tree_map(_contiguous, build))
        cached = (X[:, bucket.train_rows :], col, icl, n_train, n_features)
        entries.append(_package(served, directory, "forward_cached", bucket, tables, cached))
    manifest = {
        "format": FORMAT,
        **environment(),
        "options": _package_options(served),
        "grid": dataclasses.asdict(served.grid),
        "packages": entries,
    }
    temporary = directory / (MANIFEST + ".tmp")
    temporary.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(temporary, directory / MANIFEST)
    return manifest


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of ``directory``.

    Raises:
        FileNotFoundError: no manifest.
        AotPackageError: not a tabserve bucket-package manifest.
    """
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except ValueError as error:
        raise AotPackageError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise AotPackageError(f"{path} is not a {FORMAT} manifest")
    return manifest


def load(served, directory: str | os.PathLike) -> dict:
    """Loads every package of ``directory`` made for ``served``'s environment, options and grid:
    ``{kind: {(bucket, batch): runner}}`` for the kinds of :data:`KINDS`.

    Raises:
        FileNotFoundError: no manifest, or a package file it names is missing.
        AotPackageError: a malformed manifest, or one made under another torch / tabserve / GPU,
            options or bucket grid (the message names the difference); a CUDA model without
            :data:`ALLOW_CUDA_ENV` (:func:`refuse_cuda_packages`).
    """
    refuse_cuda_packages(served.device)
    directory = Path(directory)
    manifest = read_manifest(directory)
    expected = {
        **environment(),
        "options": _package_options(served),
        "grid": json.loads(json.dumps(dataclasses.asdict(served.grid))),
    }
    for key, value in expected.items():
        if manifest.get(key) != value:
            raise AotPackageError(
                f"{directory / MANIFEST}: made for {key} {manifest.get(key)!r}, "
                f"this server has {value!r}; export the packages again"
            )
    runners = {kind: {} for kind in KINDS}
    for entry in manifest.get("packages", []):
        path = directory / entry["file"]
        if not path.is_file():
            raise FileNotFoundError(f"{path}: named by the manifest, missing")
        kind = entry.get("kind", "forward")
        if kind not in KINDS:
            raise AotPackageError(f"{directory / MANIFEST}: unknown package kind {kind!r}")
        package = torch._inductor.aoti_load_package(str(path))
        runners[kind][(Bucket(**entry["bucket"]), int(entry["batch"]))] = _Runner(package)
    return runners
