"""Builds the tabserve operator library (`tabserve._C`) with torch.utils.cpp_extension.

CPU kernels are always built. CUDA kernels (csrc/ops/cuda/*.cu) are built when nvcc and a CUDA
build of torch are present, for the architectures in TORCH_CUDA_ARCH_LIST (default: the visible
GPUs', else :data:`DEFAULT_CUDA_ARCHS`). TABSERVE_CPU_ONLY=1 forces a CPU-only build.

The library is built without debug information (a CPU build is about 0.5 MB instead of 16);
TABSERVE_DEBUG=1 builds it with host debug information.
"""

import glob
import os
import shutil


def _find_cuda_home():
    """torch guesses CUDA_HOME as the parent of the nvcc on PATH, which is wrong when that nvcc is
    a link or a wrapper script (/usr/local/bin/nvcc): prefer a toolkit folder that has libcudart."""
    nvcc = shutil.which("nvcc")
    candidates = ["/usr/local/cuda"]
    if nvcc:
        candidates.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for home in candidates:
        if glob.glob(os.path.join(home, "lib*", "libcudart.so*")) or glob.glob(
            os.path.join(home, "targets", "*", "lib", "libcudart.so*")
        ):
            return home
    return None


if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ and _find_cuda_home():
    os.environ["CUDA_HOME"] = _find_cuda_home()

import torch  # noqa: E402
from setuptools import find_packages, setup  # noqa: E402
from torch.utils.cpp_extension import (  # noqa: E402
    CUDA_HOME,
    BuildExtension,
    CppExtension,
    CUDAExtension,
)

HERE = os.path.dirname(os.path.abspath(__file__))
#: Architectures built when TORCH_CUDA_ARCH_LIST is unset and no GPU is visible (a build machine):
#: the kernels' tensor-core tiles need sm80 or newer; sm80 code runs on every 8.x GPU, sm90 is
#: the H100 / H200, and its PTX is compiled by the driver for later GPUs.
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"
DEBUG = os.environ.get("TABSERVE_DEBUG", "0") == "1"


def _record_torch_version() -> None:
    """Writes the torch version the extension is built against into the package: the compiled
    operators link to that torch's C++ ABI, and ``import tabserve`` refuses another one."""
    path = os.path.join(HERE, "python", "tabserve", "_build_info.py")
    text = (
        '"""Written by setup.py when the extension is built; not edited by hand."""\n\n'
        f"TORCH_VERSION = {torch.__version__!r}\n"
    )
    with open(path, "w") as file:
        file.write(text)


_record_torch_version()


def _with_cuda() -> bool:
    if os.environ.get("TABSERVE_CPU_ONLY", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def _choose_cuda_archs() -> None:
    """torch reads the architectures from the visible GPUs when TORCH_CUDA_ARCH_LIST is unset,
    and fails (IndexError) on a machine with nvcc and no GPU: name a default there."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.is_available():
        return
    os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS
    print(
        f"tabserve: no GPU visible; building the CUDA kernels for {DEFAULT_CUDA_ARCHS} "
        "(set TORCH_CUDA_ARCH_LIST to choose, or TABSERVE_CPU_ONLY=1 for none)"
    )


def _extension():
    sources = sorted(glob.glob("csrc/ops/*.cpp")) + ["csrc/python_module.cpp"]
    # No -std flag: torch.utils.cpp_extension adds the standard its own headers need (C++17 or
    # C++20 depending on the torch release); forcing one can break the ABI with another torch.
    # -fopenmp: at::parallel_for is an inline template that only runs in parallel when the
    # extension itself is compiled with OpenMP (torch's libgomp serves it at run time).
    # -ffp-contract=off: no fused multiply-add where an operator promises the ATen composite's
    # separately rounded products and sums (rotary_embedding).
    # -g0 / --strip-debug: Python's own compiler flags carry -g.
    cxx = ["-O3", "-fopenmp", "-ffp-contract=off", "-fdiagnostics-color=always"]
    cxx += ["-g"] if DEBUG else ["-g0"]
    link = ["-fopenmp"] + ([] if DEBUG else ["-Wl,--strip-debug"])
    if not _with_cuda():
        return CppExtension("tabserve._C", sources, extra_compile_args={"cxx": cxx},
                            extra_link_args=link, py_limited_api=False)
    _choose_cuda_archs()
    sources += sorted(glob.glob("csrc/ops/cuda/*.cu"))
    nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
    return CUDAExtension("tabserve._C", sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc},
                         extra_link_args=link)


setup(
    package_dir={"": "python"},
    packages=find_packages("python"),
    # The promotions recipe="auto" reads: found in site-packages after a wheel install.
    package_data={"tabserve": ["py.typed"], "tabserve.models.tabicl.serving": ["promotions.json"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
