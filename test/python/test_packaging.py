"""What a wheel install gets: the declared dependencies, one version, the console script, the
type marker, and a clear refusal of a torch other than the one the extension was built for."""

from __future__ import annotations

import importlib
import os
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
                        "psutil", "huggingface_hub"):  # fmt: skip
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


def test_the_package_declares_its_license():
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License")
    assert PROJECT["license"] == "BSD-3-Clause" and PROJECT["license-files"] == ["LICENSE"]


def test_the_built_library_carries_no_debug_information():
    import shutil

    from tabserve import _C

    if shutil.which("readelf") is None:
        pytest.skip("needs binutils' readelf")
    if os.environ.get("TABSERVE_DEBUG") == "1":
        pytest.skip("TABSERVE_DEBUG=1 builds with debug information")
    sections = subprocess.run(
        ["readelf", "-S", "-W", _C.__file__], capture_output=True, text=True, check=True
    ).stdout
    assert ".text" in sections and ".debug_info" not in sections


SETUP_ARCHS = """
import runpy, setuptools
setuptools.setup = lambda **kwargs: None  # the configuration only, no build
runpy.run_path("setup.py", run_name="__main__")
from torch.utils.cpp_extension import _get_cuda_arch_flags
print("flags", " ".join(_get_cuda_arch_flags()))
"""


def test_a_build_machine_without_a_gpu_gets_default_cuda_architectures():
    """The README's install command on a machine with nvcc and no GPU: torch cannot read the
    architectures from a GPU, so the build names its defaults instead of failing."""
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None or CUDA_HOME is None:
        pytest.skip("needs a CUDA build of torch and nvcc")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_CUDA_ARCH_LIST", "TABSERVE_CPU_ONLY")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    child = subprocess.run(
        [sys.executable, "-c", SETUP_ARCHS], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    assert "no GPU visible; building the CUDA kernels for 8.0;9.0+PTX" in child.stdout
    flags = child.stdout.split("flags ", 1)[1].split()
    assert "-gencode=arch=compute_80,code=sm_80" in flags
    assert "-gencode=arch=compute_90,code=sm_90" in flags
    assert "-gencode=arch=compute_90,code=compute_90" in flags


LAYERS = ("network", "serving", "sklearn")  # each may import only those before it


def test_the_tabicl_packages_import_only_downward():
    import ast

    package = ROOT / "python" / "tabserve" / "models" / "tabicl"
    for rank, layer in enumerate(LAYERS):
        for path in sorted((package / layer).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom):
                    continue
                name = "." * node.level + (node.module or "")
                absolute = name.removeprefix("tabserve.models.tabicl.") if not node.level else None
                if node.level == 2 or absolute is not None and absolute != name:
                    target = (absolute or name[2:]).split(".")[0]
                    assert target in LAYERS[: rank + 1], f"{path.name} imports {name} (above {layer})"
                elif node.level > 2:
                    raise AssertionError(f"{path.name} imports {name}, outside the TabICLv2 packages")
