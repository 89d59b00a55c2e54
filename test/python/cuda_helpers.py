"""What the CUDA tests share: whether this machine has a GPU, and the skip that says a test needs
one (conftest gives every test skipped for that reason the ``cuda`` mark, which the GPU
machine's test stages select)."""

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
#: The reason every CUDA test gives for skipping without a GPU.
NO_GPU = "needs a CUDA GPU"
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU)
