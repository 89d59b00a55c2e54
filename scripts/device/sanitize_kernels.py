"""Our CUDA kernels alone, for compute-sanitizer (scripts/device/check.sh, SAN_SCRIPT).

The pytest suites compare against PyTorch's own kernels (cuDNN SDPA, cat, ...), whose reports
bury ours, and a kernel-name filter makes initcheck blind to every write by the kernels it
skips (the inputs they build then read as "uninitialised", as on the H200). Here
every input is built on the host and copied to the device (copies initialise memory in
initcheck's tracking), strided views are slices (no kernel), and the only kernels that run are
tabserve's: small_head_attention (plain, RoPE in the kernel, per-entry n, one-chunk and streamed
keys, aligned and unaligned rows), qassmax_scale (the fused fp16 / bf16 kernel, head dims 16, 24
and 64, query-MLP widths 40 to 100, runs of several tiles per block), rotary_embedding,
feed_forward and norm_linear (Triton), feed_forward_resident (with skipped sets),
layer_norm_cast (every width its kernel takes, with and without a bias), table_checks (shared
and global bitmaps), all_equal. ``--only`` picks operators. Each output is
copied back and checked against the CPU kernel, so a run that reads garbage also fails here.
Exit status 1 on a mismatch.

    compute-sanitizer --tool initcheck --error-exitcode 1 python3 scripts/device/sanitize_kernels.py
"""

from __future__ import annotations

import argparse
import sys

import torch
from tabserve import ops
from tabserve.models.tabicl.network.layers import RotaryEmbedding

FAILURES: list[str] = []


def host(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    error = (got.cpu().float() - want.float()).abs().max().item()
    status = "ok" if error <= tol else "MISMATCH"
    print(f"{status:8} {name}: max |error| {error:.2e} (tolerance {tol:g})", flush=True)
    if error > tol:
        FAILURES.append(name)


def heads_view(packed: torch.Tensor, part: int, heads: int) -> torch.Tensor:
    """Head-split view [B, heads, L, 16] of a packed [B, L, 3 E (+ spare)] projection."""
    width = heads * 16
    return packed[..., part * width : (part + 1) * width].unflatten(-1, (heads, 16)).transpose(1, 2)


def small_head_cases(dtype) -> None:
    # (batch, heads, queries, keys, spare columns, rotary, per-entry n)
    cases = [
        (6, 8, 68, 68, 0, True, False),  # the row stage
        (5, 8, 20, 20, 2, True, False),  # unaligned rows
        (2, 2, 150, 150, 0, True, False),  # streamed keys with RoPE
        (3, 8, 4, 68, 0, False, False),  # the CLS block
        (2, 8, 128, 300, 2, False, True),  # streamed, per-entry n, unaligned
        (2, 4, 200, 128, 0, False, True),  # one chunk, per-entry n
        (600, 8, 68, 68, 0, True, True),  # resident blocks walking units (double-buffered)
    ]
    for i, (batch, heads, queries, keys, spare, rotary, per_entry) in enumerate(cases):
        width = 3 * heads * 16 + spare
        qs, kv = host(batch, queries, width, seed=i), host(batch, keys, width, seed=100 + i)
        q, k, v = heads_view(qs, 0, heads), heads_view(kv, 1, heads), heads_view(kv, 2, heads)
        n = torch.tensor([keys - 3 * (j % 2) for j in range(batch)]) if per_entry else None
        tables = None
        if rotary:
            tables = RotaryEmbedding(16, 1e5).tables(max(queries, keys), "cpu", dtype)
        want = ops.small_head_attention(q.to(dtype), k.to(dtype), v.to(dtype), n, rotary=tables)
        device_q, device_kv = qs.to(dtype).to("cuda"), kv.to(dtype).to("cuda")
        got = ops.small_head_attention(
            heads_view(device_q, 0, heads),
            heads_view(device_kv, 1, heads),
            heads_view(device_kv, 2, heads),
            None if n is None else n.to("cuda"),
            rotary=None if tables is None else tuple(t.to("cuda") for t in tables),
        )
        check(f"small_head_attention {dtype} case {i}", got, want, 2e-2)


def qassmax_cases(dtype) -> None:
    for i, (shape, hidden, per_entry) in enumerate(
        [
            ((2, 8, 100, 64), 64, False),
            ((3, 8, 33, 16), 64, True),
            ((1, 8, 4500, 64), 40, False),  # more tiles than resident blocks: runs of tiles
            ((2, 2, 50, 24), 100, True),  # rows off the vector path, padded dims and units
        ]
    ):
        batch, heads, _, dim = shape
        base = [
            host(64, 1, seed=1),
            host(64, seed=2),
            host(heads * dim, 64, seed=3),
            host(heads * dim, seed=4),
        ]
        query = [
            host(hidden, dim, seed=5),
            host(hidden, seed=6),
            host(dim, hidden, seed=7),
            host(dim, seed=8),
        ]
        base = [0.3 * t for t in base]
        query = [0.3 * t for t in query]
        q = host(*shape, seed=9 + i, dtype=dtype)
        n = torch.tensor([5, 70, 900][:batch]) if per_entry else torch.tensor(700)
        want = ops.qassmax_scale(q.float(), n, base, query)
        got = ops.qassmax_scale(
            q.to("cuda"), n.to("cuda"), [t.to("cuda") for t in base], [t.to("cuda") for t in query]
        )
        check(f"qassmax_scale {dtype} case {i}", got, want, 5e-2 * want.abs().max().item())


def rotary_cases(dtype) -> None:
    qs = host(4, 68, 3 * 8 * 16, seed=20)
    cos, sin = RotaryEmbedding(16, 1e5).tables(68, "cpu", dtype)
    want = ops.rotary_embedding(heads_view(qs.to(dtype), 0, 8), cos, sin)
    got = ops.rotary_embedding(
        heads_view(qs.to(dtype).to("cuda"), 0, 8), cos.to("cuda"), sin.to("cuda")
    )
    check(f"rotary_embedding {dtype}", got, want, 1e-2)


def feed_forward_cases(dtype) -> None:
    from tabserve.kernels import feed_forward as ff

    for i, (tokens, dim, hidden, norm_bias) in enumerate(
        [(1000, 128, 256, True), (77, 32, 192, False)]
    ):
        x = host(tokens, dim, seed=30 + i)
        params = [1 + 0.1 * host(dim, seed=31), 0.1 * host(dim, seed=32) if norm_bias else None]
        params += [host(hidden, dim, seed=33) / dim**0.5, 0.1 * host(hidden, seed=34)]
        params += [host(dim, hidden, seed=35) / hidden**0.5, 0.1 * host(dim, seed=36)]
        update = host(tokens, dim, seed=37, dtype=torch.float16) if norm_bias else None
        want = ff.feed_forward_composite(x, update, *params, 1e-5, torch.float32)
        device_params = [None if p is None else p.to("cuda") for p in (update, *params)]
        got = torch.ops.tabserve.feed_forward(x.to("cuda"), *device_params, 1e-5, dtype)
        check(f"feed_forward {dtype} case {i}", got, want, 5e-2)
        for gelu in (g for g in ff.GELUS if g != ff.GELU):  # the other GELU forms
            with ff.gelu_override(gelu):
                got = torch.ops.tabserve.feed_forward(x.to("cuda"), *device_params, 1e-5, dtype)
            check(f"feed_forward {dtype} case {i}, {gelu} GELU", got, want, 5e-2)
        if update is None:
            continue
        # The out-projection folded in: the sum held in the output across a block barrier.
        fold = [host(dim, dim, seed=38) / dim**0.5, 0.1 * host(dim, seed=39)]
        want = ff.feed_forward_composite(x, update, *params, 1e-5, torch.float32, None, 0.0, *fold)
        on_device = [t.to("cuda") for t in fold]
        got = torch.ops.tabserve.feed_forward(
            x.to("cuda"), *device_params, 1e-5, dtype, None, 0.0, *on_device
        )
        check(f"feed_forward {dtype} case {i} with the out-projection", got, want, 5e-2)
        # The rows layout (row_prefix): 2 tables x 5 sets x 100 tokens, 4 leading tokens.
        if tokens % 10 == 0:
            sets = [t.view(2, 5, tokens // 10, dim) for t in (x, update)]
            prefix = host(4, dim, seed=45)
            extra = (None, 0.0, *fold, prefix)
            want = ff.feed_forward_composite(sets[0], sets[1], *params, 1e-5, torch.float32, *extra)
            got = torch.ops.tabserve.feed_forward(
                sets[0].to("cuda"), sets[1].to("cuda"), *device_params[1:], 1e-5, dtype,
                None, 0.0, *on_device, prefix.to("cuda"),
            )  # fmt: skip
            check(f"feed_forward {dtype} case {i} in the rows layout", got, want, 5e-2)


def feed_forward_resident_cases(dtype) -> None:
    """fp32 stream with the attention half's output; the half stream alone without a norm bias;
    more tiles than one pass of the persistent grid (the staging rows reused across tiles)."""
    for i, (tokens, x_dtype, update, norm_bias) in enumerate(
        [(1000, torch.float32, True, True), (77, dtype, False, False), (20000, dtype, True, True)]
    ):
        x = host(tokens, 128, seed=50 + i, dtype=x_dtype)
        args = [x, host(tokens, 128, seed=51, dtype=dtype) if update else None]
        args += [1 + 0.1 * host(128, seed=52), 0.1 * host(128, seed=53) if norm_bias else None]
        args += [
            (host(256, 128, seed=54) / 128**0.5).to(dtype),
            (0.1 * host(256, seed=55)).to(dtype),
        ]
        args += [
            (host(128, 256, seed=56) / 256**0.5).to(dtype),
            (0.1 * host(128, seed=57)).to(dtype),
        ]
        want = torch.ops.tabserve.feed_forward_resident(*args, 1e-5)
        on_device = [None if a is None else a.to("cuda") for a in args]
        got = torch.ops.tabserve.feed_forward_resident(*on_device, 1e-5)
        check(f"feed_forward_resident {dtype} case {i}", got, want, 5e-2)
        # Skipped sets (runs of tokens // 10, every third one) written by the epilogue.
        skip = torch.arange(10) % 3 == 0
        x_sets = x[: tokens // 10 * 10]
        set_args = [x_sets.unflatten(0, (10, -1))] + [
            a[: tokens // 10 * 10].unflatten(0, (10, -1)) if a is not None and j == 0 else a
            for j, a in enumerate(args[1:])
        ]
        want = torch.ops.tabserve.feed_forward_resident(*set_args, 1e-5, skip, -100.0)
        on_device = [None if a is None else a.to("cuda") for a in set_args]
        got = torch.ops.tabserve.feed_forward_resident(*on_device, 1e-5, skip.to("cuda"), -100.0)
        check(f"feed_forward_resident {dtype} case {i} with skipped sets", got, want, 5e-2)


def layer_norm_cast_cases(dtype) -> None:
    """Every width the kernel takes, a bias and none, a row count that leaves a block's last
    warps without a row."""
    for i, (rows, width, bias) in enumerate([(1003, 128, True), (77, 256, False),
                                             (501, 512, True), (9, 1024, True)]):  # fmt: skip
        x = 3 * host(rows, 1, seed=60 + i) + host(rows, width, seed=61 + i)
        params = [1 + 0.2 * host(width, seed=62), 0.1 * host(width, seed=63) if bias else None]
        want = ops.layer_norm_cast(x, *params, 1e-5, dtype)
        on_device = [None if p is None else p.to("cuda") for p in params]
        got = ops.layer_norm_cast(x.to("cuda"), *on_device, 1e-5, dtype)
        check(f"layer_norm_cast {dtype} case {i}", got, want, 5e-2)


def all_equal_cases() -> None:
    """Sets of every kind of verdict: all the value, the other value at varied places, at a
    stride boundary (4,096) of a long set; fp32 and fp16; few sets, and more sets than one pass
    of the grid's blocks."""
    for i, (sets, rows, dim, dtype) in enumerate(
        [
            (7, 50, 128, torch.float32),
            (5, 4096 // 128 + 3, 128, torch.float16),
            (3000, 4, 8, torch.float32),
        ]
    ):
        x = torch.full((sets, rows, dim), -100.0, dtype=dtype)
        flat = x.view(sets, -1)
        size = flat.shape[1]
        for s in range(1, sets, 2):  # every other set gets one other value, at varied places
            flat[s, (s * 977) % size] = 1.0
        if size > 4096:
            flat[2 % sets, 4096] = 0.5
        want = ops.all_equal(x, -100.0, 2)
        check(f"all_equal case {i}", ops.all_equal(x.to("cuda"), -100.0, 2), want, 0.0)


def norm_linear_cases(dtype) -> None:
    from tabserve.kernels import norm_linear as nl

    for i, (tokens, dim, out_features) in enumerate([(1000, 128, 384), (77, 32, 64)]):
        x = host(tokens, dim, seed=40 + i)
        params = [1 + 0.1 * host(dim, seed=41), 0.1 * host(dim, seed=42)]
        params += [host(out_features, dim, seed=43) / dim**0.5, 0.1 * host(out_features, seed=44)]
        want = ops.norm_linear(x, *params, 1e-5, torch.float32)
        got = ops.norm_linear(x.to("cuda"), *(p.to("cuda") for p in params), 1e-5, dtype)
        check(f"norm_linear {dtype} case {i}", got, want, 5e-2)
        # RoPE in the epilogue: tokens as rows of 20 (positions 0..19), the first 2 x 64 (or
        # all 64) outputs rotated in heads of 16.
        rows = x.view(-1, 20, dim) if tokens % 20 == 0 else x.view(1, tokens, dim)
        cos, sin = RotaryEmbedding(16, 1e5).tables(rows.shape[1], "cpu", torch.float16)
        rotary = min(128, out_features)
        want = ops.norm_linear(rows, *params, 1e-5, torch.float32, (cos, sin), rotary)
        got = ops.norm_linear(
            rows.to("cuda"), *(p.to("cuda") for p in params), 1e-5, dtype,
            (cos.to("cuda"), sin.to("cuda")), rotary,
        )  # fmt: skip
        check(f"norm_linear {dtype} case {i} with RoPE", got, want, 5e-2)
        for rotation in (r for r in nl.ROTATIONS if r != nl.ROTATION):
            with nl.rotation_override(rotation):
                got = ops.norm_linear(
                    rows.to("cuda"), *(p.to("cuda") for p in params), 1e-5, dtype,
                    (cos.to("cuda"), sin.to("cuda")), rotary,
                )  # fmt: skip
            check(f"norm_linear {dtype} case {i} with RoPE, {rotation} rotation", got, want, 5e-2)
        # A slice along L read in place (the inducing points' train rows).
        if tokens % 20 == 0:
            part = rows[:, :13]
            want = ops.norm_linear(part.contiguous(), *params, 1e-5, torch.float32)
            got = ops.norm_linear(
                rows.to("cuda")[:, :13], *(p.to("cuda") for p in params), 1e-5, dtype
            )
            check(f"norm_linear {dtype} case {i} on a slice", got, want, 5e-2)


def table_checks_cases() -> None:
    """Labels with faults and gaps, a strided table with NaN / inf, the shared bitmap and the
    global one (past 393,216 train rows)."""
    for i, (tables, n, classes) in enumerate([(3, 700, 7), (2, 400_000, 1000)]):
        X = host(tables, 5, n + 3, seed=20 + i).transpose(1, 2)  # strided: features outermost
        X[0, 1, 2] = float("nan")
        y = (torch.arange(n).repeat(tables, 1) % classes).double()
        y[-1, 3] = 0.5
        y[0, 4] = float("inf")
        want = ops.table_checks(X, y, True)
        got = ops.table_checks(X.to("cuda"), y.to("cuda"), True)
        check(f"table_checks case {i}", got, want, 0.0)


#: Each operator's cases, per matmul dtype (None: the operator's cases take no dtype).
GROUPS = {
    "small_head_attention": small_head_cases,
    "qassmax_scale": qassmax_cases,
    "rotary_embedding": rotary_cases,
    "feed_forward": feed_forward_cases,
    "feed_forward_resident": feed_forward_resident_cases,
    "norm_linear": norm_linear_cases,
    "layer_norm_cast": layer_norm_cast_cases,
    "table_checks": None,
    "all_equal": None,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(GROUPS), help="these operators only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    chosen = args.only or list(GROUPS)
    for dtype in (torch.float16, torch.bfloat16):
        for name in chosen:
            if GROUPS[name] is not None:
                GROUPS[name](dtype)
    if "table_checks" in chosen:
        table_checks_cases()
    if "all_equal" in chosen:
        all_equal_cases()
    torch.cuda.synchronize()
    print(f"{len(FAILURES)} mismatches" + (f": {FAILURES}" if FAILURES else ""))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
