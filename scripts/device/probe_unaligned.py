"""Which kernel faults on unaligned head-split views (fp16): PyTorch's SDPA or
tabserve.ops.small_head_attention. Run each case in its own process with CUDA_LAUNCH_BLOCKING=1:
    python scripts/device/probe_unaligned.py sdpa|op"""

import sys

import tabserve  # noqa: F401
import torch
import torch.nn.functional as F
from tabserve import ops

g = torch.Generator().manual_seed(5)
qs = torch.randn(3, 128, 385, generator=g).half().cuda()
kv = torch.randn(3, 300, 385, generator=g).half().cuda()


def split(t, i):
    return t[..., i * 128 : (i + 1) * 128].unflatten(-1, (8, 16)).transpose(1, 2)


q, k, v = split(qs, 0), split(kv, 1), split(kv, 2)
try:
    for count in (300, 17, 1):
        if sys.argv[1] == "sdpa":
            F.scaled_dot_product_attention(q[1:2], k[1:2, :, :count], v[1:2, :, :count])
        else:
            ops.small_head_attention(q, k, v, torch.tensor(count, device="cuda"))
        torch.cuda.synchronize()
    print(sys.argv[1], "ok")
except RuntimeError as error:  # the probe reports, it does not judge (AcceleratorError too)
    print(sys.argv[1], "failed:", str(error).split("\n")[0])
