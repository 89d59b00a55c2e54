"""What a wheel install gets: the declared dependencies, one version, the console script, the
type marker, and a clear refusal of a torch other than the one the extension was built for."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tabserve

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_every_imported_third_party_package_is_declared():
    declared = {name.split(">")[0].split("=")[0].split("[")[0] for name in PROJECT["dependencies"]}
    for requirement in ("torch", "numpy", "pandas", "pyarrow", "scikit-learn", "platformdirs",
                        "huggingface_hub"):  # fmt: skip
        assert requirement in declared
    assert "tabicl==2.2.0" in PROJECT["optional-dependencies"]["bench"]


def test_the_version_is_written_once_and_reported():
    assert PROJECT.get("dynamic") == ["version"] and "version" not in PROJECT
    child = subprocess.run(
        [sys.executable, "-m", "tabserve.bench", "--version"], capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    assert child.stdout.strip() == f"tabserve {tabserve.__version__}"


def test_the_console_script_names_the_driver():
    module, _, function = PROJECT["scripts"]["tabserve-bench"].partition(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_the_package_is_marked_typed():
    assert (Path(tabserve.__file__).parent / "py.typed").is_file()


def test_another_torch_than_the_built_one_is_refused(monkeypatch):
    build_info = pytest.importorskip("tabserve._build_info")
    monkeypatch.setattr(build_info, "TORCH_VERSION", "1.0.0+cpu")
    with pytest.raises(ImportError, match=r"built against torch 1\.0\.0\+cpu, but this process has torch"):
        tabserve._check_torch_version()
