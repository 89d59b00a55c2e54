"""Ahead-of-time bucket packages: a served model's padded forward, compiled per bucket with
AOTInductor, saved to a directory and loaded by a restarted server without tracing or compiling.

Compile-cache artifacts (:mod:`tabserve.compile_cache`) spare a restart Inductor's code generation
but not Dynamo's tracing nor the reload of every graph, about 20 s per bucket on the H200 for the
small workload. A bucket package is the bucket's whole forward as one shared library
(``torch.export`` of :meth:`TabICLv2.padded_forward` at the bucket's static shapes, the recipe's
precision and attention backends baked in, then ``torch._inductor.aoti_compile_and_package``);
loading one takes milliseconds and its first call runs compiled kernels at once. The real
train-row and feature counts stay device tensors, so one package serves every table of its bucket.

Layout of a directory: ``manifest.json`` (:func:`environment`, the recipe, the grid and one entry
per package: bucket, batch size, file name) and one ``bucket-<train>x<test>x<features>-b<batch>.pt2``
per entry.

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

from tabserve.buckets import Bucket

MANIFEST = "manifest.json"
FORMAT = "tabserve-aot-buckets/1"


class AotPackageError(ValueError):
    """A bucket directory that is missing, malformed, or made for another environment, recipe or
    bucket grid."""


def environment() -> dict:
    """What a package depends on; a directory made under a different value is refused."""
    from tabserve import compile_cache

    return compile_cache.environment()


class _PaddedCore(torch.nn.Module):
    """The exported function: the padded forward under the recipe's precision context."""

    def __init__(self, served):
        super().__init__()
        self.model = served.model
        self.recipe = served.recipe
        self.device = served.device

    def forward(self, X: Tensor, y_train: Tensor, n_train: Tensor, n_features: Tensor) -> Tensor:
        with self.recipe.context(self.device):
            return self.model.padded_forward(X, y_train, n_train, n_features)


def _file_name(bucket: Bucket, batch: int) -> str:
    return f"bucket-{bucket.train_rows}x{bucket.test_rows}x{bucket.features}-b{batch}.pt2"


def example_inputs(served, bucket: Bucket, batch: int) -> tuple[Tensor, ...]:
    """Random inputs of a bucket's padded forward (the shapes are what the package fixes)."""
    from .serving import _counts

    generator = torch.Generator().manual_seed(0)
    rows = bucket.train_rows + bucket.test_rows
    X = torch.randn(batch, rows, bucket.features, generator=generator).to(served.device)
    y = torch.arange(bucket.train_rows).remainder(2).float().repeat(batch, 1).to(served.device)
    return (X, y, *_counts(served.device, bucket.train_rows, bucket.features))


@torch.no_grad()
def export(served, directory: str | os.PathLike, buckets: Sequence[Bucket], tables: int) -> dict:
    """Compiles one package per bucket for batches of ``tables`` tables into ``directory`` and
    writes its manifest; returns the manifest."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    core = _PaddedCore(served)
    entries = []
    for bucket in buckets:
        inputs = example_inputs(served, bucket, tables)
        program = torch.export.export(core, inputs, strict=False)
        name = _file_name(bucket, tables)
        torch._inductor.aoti_compile_and_package(program, package_path=str(directory / name))
        entries.append({"bucket": dataclasses.asdict(bucket), "batch": tables, "file": name})
    manifest = {
        "format": FORMAT,
        **environment(),
        "recipe": served.recipe.name,
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
    """Loads every package of ``directory`` made for ``served``'s environment, recipe and grid:
    ``{(bucket, batch): runner}``.

    Raises:
        FileNotFoundError: no manifest, or a package file it names is missing.
        AotPackageError: a malformed manifest, or one made under another torch / tabserve / GPU,
            recipe or bucket grid (the message names the difference).
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    expected = {
        **environment(),
        "recipe": served.recipe.name,
        "grid": json.loads(json.dumps(dataclasses.asdict(served.grid))),
    }
    for key, value in expected.items():
        if manifest.get(key) != value:
            raise AotPackageError(
                f"{directory / MANIFEST}: made for {key} {manifest.get(key)!r}, "
                f"this server has {value!r}; export the packages again"
            )
    runners = {}
    for entry in manifest.get("packages", []):
        path = directory / entry["file"]
        if not path.is_file():
            raise FileNotFoundError(f"{path}: named by the manifest, missing")
        bucket = Bucket(**entry["bucket"])
        runners[(bucket, int(entry["batch"]))] = torch._inductor.aoti_load_package(str(path))
    return runners
