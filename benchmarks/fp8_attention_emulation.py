"""Would fp8 attention in the ICL stage pass the driver's reduced-precision gate? (CPU emulation)

The xlarge target (3x the reference's fp16 one-shot) is bound by the ICL stage's head-dim-64
attention: cuDNN's fp16 kernel is the fastest on the H200 (benchmarks/icl_attention.py), and
only fp8 tensor cores would run it much faster. No fp8 attention exists in torch 2.11, so before
anyone writes one this study asks what fp8 would do to the answers. It runs the full-size
random-weight model twice in fp32 on the CPU: as is, and with every head-dim-64 attention
call (the ICL stage's; the column and row stages have head dimension 16) replaced by an
emulation of an fp8 flash-attention kernel's rounding:

* Q, K and V rounded to ``float8_e4m3fn`` with one scale per tensor (amax / 448, as cuDNN's
  per-tensor descaling), scores and softmax in fp32;
* the unnormalised probabilities ``exp(s - rowmax)``, scaled by 256 (the largest power of two
  under e4m3's 448, so small weights keep more of their bits), rounded to e4m3 for the P @ V
  product; the row sum taken from the fp32 values, as the kernels accumulate it.

These are the roundings of ``tabserve::flash_attention(fp8=True)``; its composite computes them.

An fp16 emulation (the same steps with fp16 roundings) is the control: the error the shipped fp16
cells already carry. Each variant's class probabilities are compared with the unmodified fp32
model's by the driver's own gate (:data:`tabserve.bench.gates.LIMITS` ``"reduced"``: max
probability difference 2e-2, argmax agreement 99.5%).

Random weights, so the answer is about this model's numerics, not a real checkpoint's logit
scales; the train-row count is far below xlarge's 50,000 (CPU time), and the per-score
rounding does not depend on it.

    python benchmarks/fp8_attention_emulation.py          # 8 x (2,048 + 512) rows, 32 features
    python benchmarks/fp8_attention_emulation.py --quick  # a smaller table (about a minute)
    python benchmarks/fp8_attention_emulation.py --json out.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from tabserve.bench.gates import LIMITS, check, compare
from tabserve.bench.workloads import Workload, make_checkpoint, model_tables
from tabserve.kernels.flash_attention import flash_attention_composite
from tabserve.models.tabicl import layers
from tabserve.models.tabicl.model import TabICLv2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import environment, print_table, write_json


def emulated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fp8: bool):
    """fp32 attention with a low-precision kernel's roundings: the composite of
    ``tabserve::flash_attention`` (fp8: e4m3 operands and weights; else the operands and
    weights rounded to fp16, the control)."""
    if fp8:
        return flash_attention_composite(q, k, v, fp8=True)
    return flash_attention_composite(q.half(), k.half(), v.half()).float()


def icl_head_dim(model: TabICLv2) -> int:
    """The ICL stage's head dimension (64 in the released architecture), which must differ from
    the column and row stages' for :func:`icl_attention_replaced` to pick the ICL calls."""
    config = model.config
    head_dim = config.icl_dim // config.icl_nhead
    if head_dim in (config.embed_dim // config.col_nhead, config.embed_dim // config.row_nhead):
        raise ValueError(f"the ICL stage's head dimension {head_dim} is also another stage's")
    return head_dim


def icl_attention_replaced(fp8: bool, head_dim: int):
    """A stand-in for :func:`layers.batched_sdpa` that emulates fp8 (else fp16) on calls of head
    dimension ``head_dim`` (the ICL stage's) and counts them (``.calls``); other calls go to the
    original."""
    original = layers.batched_sdpa

    def attend(q, k, v):
        if q.shape[-1] != head_dim:
            return original(q, k, v)
        attend.calls += 1
        return emulated_attention(q, k, v, fp8)

    attend.calls = 0
    return attend


def run_variant(model, X, y, attend) -> tuple[torch.Tensor, float]:
    """Class probabilities with ``attend`` as the model's SDPA (None: unchanged), and seconds."""
    original = layers.batched_sdpa
    if attend is not None:
        layers.batched_sdpa = attend
    try:
        start = time.perf_counter()
        with torch.no_grad():
            probs = model(X, y, return_logits=False)
        return probs, time.perf_counter() - start
    finally:
        layers.batched_sdpa = original


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--n-train", type=int, default=2048)
    parser.add_argument("--n-test", type=int, default=512)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument(
        "--quick", action="store_true", help="2 members, 512 + 128 rows, 16 features"
    )
    parser.add_argument("--checkpoint", help="a v2 classifier checkpoint (default: random weights)")
    parser.add_argument(
        "--size",
        choices=("full", "tiny"),
        default="full",
        help="the random-weight model's size (tiny: the tests')",
    )
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.members, args.n_train, args.n_test, args.features = 2, 512, 128, 16

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or make_checkpoint("clf", Path(tmp) / "v2.ckpt", size=args.size)
        model = TabICLv2.from_checkpoint(path).eval()
    head_dim = icl_head_dim(model)
    workload = Workload(
        "fp8-study", args.members, args.n_train, args.n_test, args.features, args.classes
    )
    limits = LIMITS["reduced"]
    rows, results = [], []
    for seed in args.seeds:
        X, y = model_tables(workload, seed)
        reference, seconds = run_variant(model, X, y, None)
        for label, fp8 in (("fp16 (control)", False), ("fp8 e4m3", True)):
            attend = icl_attention_replaced(fp8, head_dim)
            probs, variant_seconds = run_variant(model, X, y, attend)
            figures = compare("clf", probs, reference)
            failures = check(figures, limits)
            results.append(
                {
                    "seed": seed,
                    "variant": label,
                    "icl_calls": attend.calls,
                    **figures,
                    "failures": failures,
                    "seconds": variant_seconds,
                    "reference_seconds": seconds,
                }
            )
            rows.append(
                [
                    seed,
                    label,
                    attend.calls,
                    f"{figures['max_prob_diff']:.2e}",
                    f"{figures['argmax_agreement']:.4f}",
                    "pass" if not failures else "; ".join(failures),
                ]
            )
    print_table(
        f"ICL attention rounding against fp32 ({args.members} x ({args.n_train:,} + "
        f"{args.n_test:,}) rows, {args.features} features, "
        f"{'checkpoint ' + str(args.checkpoint) if args.checkpoint else 'random weights'})",
        ["seed", "variant", "ICL calls", "max prob diff", "argmax agreement", "reduced gate"],
        rows,
    )
    payload = {
        "settings": vars(args),
        "limits": {
            "max_prob_diff": limits.max_prob_diff,
            "min_argmax_agreement": limits.min_argmax_agreement,
        },
        "results": results,
        "environment": environment(),
    }
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
