"""Operators whose CUDA kernels are Triton programs (registered in ``torch.ops.tabserve`` on
import, schema, composite CPU kernel, Triton CUDA kernel and fake kernel in one file each)."""
