// The tabserve operator library. Each op family adds its schemas with TORCH_LIBRARY_FRAGMENT in
// its own file (csrc/ops/<family>.cpp) and its CUDA kernels in csrc/ops/cuda/<family>.cu; the
// fake (meta) kernels live in python/tabserve/ops.py.
#include <torch/library.h>

TORCH_LIBRARY(tabserve, m) { m.set_python_module("tabserve.ops"); }
