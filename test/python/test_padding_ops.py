"""Padded-table operators (pad_to_bucket, pad_labels, prefix_attention, qassmax_scale) against
unpadded references on seeded random shapes, on CPU and (when present) CUDA."""

import math
import random

import pytest
import tabserve  # noqa: F401  (registers torch.ops.tabserve)
import torch
import torch.nn.functional as F
from cuda_helpers import requires_cuda
from tabicl_helpers import device_params
from tabserve import ops
from tabserve.buckets import BucketGrid
from torch import nn

try:  # the reference implementation, when installed
    from tabicl._model.ssmax import QASSMaxMLP as ReferenceQASSMax
except ImportError:  # pragma: no cover
    ReferenceQASSMax = None

# A small grid whose edges the random shapes straddle.
GRID = BucketGrid(
    train_rows=(1, 2, 4, 8, 16, 24, 32), test_rows=(1, 4, 8, 16), features=(1, 2, 3, 4, 8)
)


# -- unpadded references -----------------------------------------------------------------------


def reference_pad(x, n_train, bucket, fill):
    out = torch.full(
        (x.shape[0], bucket.rows, bucket.features), fill, dtype=x.dtype, device=x.device
    )
    n_test = x.shape[1] - n_train
    out[:, :n_train, : x.shape[2]] = x[:, :n_train]
    out[:, bucket.train_rows : bucket.train_rows + n_test, : x.shape[2]] = x[:, n_train:]
    return out


def random_tables(seed, count=40):
    """(n_train, n_test, n_features) cases: edges of GRID, 1 train / test row, 1-2 features."""
    rng = random.Random(seed)
    fixed = [
        (1, 1, 1),
        (1, 1, 2),
        (2, 1, 1),
        (1, 16, 1),
        (32, 16, 8),
        (9, 5, 5),
        (17, 9, 4),
        (25, 2, 3),
        (8, 0, 2),
        (3, 4, 2),
    ]
    return fixed + [
        (rng.randint(1, 32), rng.randint(0, 16), rng.randint(1, 8)) for _ in range(count)
    ]


# -- pad_to_bucket / pad_labels ------------------------------------------------------------------


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]
)
def test_pad_to_bucket_matches_reference(device, dtype):
    gen = torch.Generator().manual_seed(0)
    for n_train, n_test, n_features in random_tables(1):
        bucket = GRID.bucket_for(n_train, n_test, n_features)
        x = (torch.randn(3, n_train + n_test, n_features, generator=gen) * 5).to(dtype).to(device)
        fill = 1.0 if dtype == torch.bool else -7.0
        got = torch.ops.tabserve.pad_to_bucket(
            x, n_train, bucket.train_rows, bucket.test_rows, bucket.features, fill
        )
        assert got.is_contiguous()
        assert torch.equal(got, reference_pad(x, n_train, bucket, fill)), (n_train, n_test)


@pytest.mark.parametrize("device", device_params())
def test_pad_to_bucket_reads_strided_input(device):
    x = torch.randn(5, 4, 11, device=device).transpose(0, 2)  # [11, 4, 5], non-contiguous
    bucket = GRID.bucket_for(3, 8, 5)
    got = ops.pad_to_bucket(x, 3, bucket.train_rows, bucket.test_rows, bucket.features)
    assert torch.equal(got, reference_pad(x, 3, bucket, 0.0))


def test_pad_to_bucket_does_not_copy_a_table_on_the_grid():
    x = torch.randn(2, 8 + 4, 3)
    assert ops.pad_to_bucket(x, 8, 8, 4, 3) is x
    y = torch.randn(2, 8)
    assert ops.pad_labels(y, 8) is y
    # The operator itself always returns a new tensor (custom operators may not alias inputs).
    out = torch.ops.tabserve.pad_to_bucket(x, 8, 8, 4, 3)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("device", device_params())
def test_pad_labels_matches_reference(device):
    for shape, bucket in [((3, 5), 8), ((1,), 1), ((2, 2, 7), 16), ((4, 0), 2)]:
        y = torch.randint(0, 12, shape, device=device).float()
        got = ops.pad_labels(y, bucket, fill=-1.0)
        expected = F.pad(y, (0, bucket - shape[-1]), value=-1.0)
        assert torch.equal(got, expected), shape


# -- prefix_attention ---------------------------------------------------------------------------


def attention_case(seed, device, dtype=torch.float32, per_batch=False):
    rng = random.Random(seed)
    batch, heads = rng.randint(1, 4), rng.randint(1, 3)
    queries, keys = rng.randint(1, 40), rng.randint(1, 40)
    head_dim = rng.choice([8, 16, 64]) if dtype != torch.float32 else rng.choice([4, 8, 16, 64])
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(batch, heads, length, head_dim, generator=gen).to(dtype).to(device)
        for length in (queries, keys, keys)
    )
    if per_batch:
        n = torch.tensor([rng.randint(1, keys) for _ in range(batch)], device=device)
    else:
        n = torch.tensor(rng.randint(1, keys), device=device)
    return q, k, v, n


def sliced_reference(q, k, v, n, scale=None, dtype=None):
    """SDPA over k[:, :, :n], per batch entry when n is [B]."""
    dtype = dtype or q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    counts = n.reshape(-1).tolist() * (q.shape[0] if n.dim() == 0 else 1)
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                q[b : b + 1], k[b : b + 1, :, :c], v[b : b + 1, :, :c], scale=scale
            )
            for b, c in enumerate(counts)
        ]
    )


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prefix_attention_equals_sdpa_on_sliced_keys_cpu(per_batch, dtype):
    for seed in range(40):
        q, k, v, n = attention_case(seed, "cpu", dtype, per_batch)
        got = ops.prefix_attention(q, k, v, n)
        torch.testing.assert_close(got, sliced_reference(q, k, v, n), atol=1e-6, rtol=0)


def test_prefix_attention_cpu_half_precision_accumulates_in_fp32():
    for dtype in (torch.float16, torch.bfloat16):
        for seed in range(10):
            q, k, v, n = attention_case(seed, "cpu", dtype, per_batch=seed % 2 == 1)
            got = ops.prefix_attention(q, k, v, n)
            assert got.dtype == dtype
            expected = sliced_reference(q, k, v, n, dtype=torch.float32).to(dtype)
            assert torch.equal(got, expected)


def test_prefix_attention_scale_int32_counts_and_value_head_dim():
    q, k = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 9, 8)
    v = torch.randn(2, 2, 9, 3)  # Dv != D
    n = torch.tensor([4, 9], dtype=torch.int32)
    got = ops.prefix_attention(q, k, v, n, scale=0.3)
    assert got.shape == (2, 2, 5, 3)
    torch.testing.assert_close(got, sliced_reference(q, k, v, n, scale=0.3), atol=1e-6, rtol=0)


def test_prefix_attention_output_layout_matches_the_fake_kernel():
    q, k, v, n = attention_case(3, "cpu")
    got = ops.prefix_attention(q, k, v, n)
    expected = q.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[3]).transpose(1, 2)
    assert got.stride() == expected.stride()


def test_one_compiled_graph_serves_every_key_count():
    torch._dynamo.reset()
    calls = []

    def count_compiles(gm, example_inputs):
        calls.append(gm)
        return gm

    @torch.compile(backend=count_compiles, fullgraph=True)
    def attend(q, k, v, n):
        return ops.prefix_attention(q, k, v, n)

    q, k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    for count in (1, 7, 16, 3):
        n = torch.tensor(count)
        torch.testing.assert_close(
            attend(q, k, v, n), sliced_reference(q, k, v, n), atol=1e-6, rtol=0
        )
    assert len(calls) == 1


# -- qassmax_scale --------------------------------------------------------------------------------


def reference_qassmax(heads, head_dim, elementwise, seed):
    torch.manual_seed(seed)
    if ReferenceQASSMax is not None:
        module = ReferenceQASSMax(heads, head_dim, elementwise=elementwise)
    else:  # pragma: no cover - same formula, written out
        from tabserve.models.tabicl.network.layers import QASSMax

        module = QASSMax(heads, head_dim)
    for p in module.parameters():  # the reference zero-initialises query_mlp's last layer
        nn.init.normal_(p, std=0.5)
    return module


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("elementwise", [True, False])
def test_qassmax_scale_equals_reference_with_the_real_count(device, elementwise):
    if ReferenceQASSMax is None and not elementwise:
        pytest.skip("tabicl not installed: only the element-wise variant has a reference")
    for seed in range(12):
        rng = random.Random(seed)
        heads, head_dim = rng.choice([1, 2, 8]), rng.choice([4, 16, 64])
        module = reference_qassmax(heads, head_dim, elementwise, seed).to(device)
        q = torch.randn(rng.randint(1, 3), heads, rng.randint(1, 20), head_dim, device=device)
        n = rng.choice([1, 2, 9, 1000, 65537])
        with torch.no_grad():
            expected = module(q, n)
            got = ops.qassmax_scale(
                q, torch.tensor(n, device=device), module.base_mlp, module.query_mlp
            )
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("device", device_params())
def test_qassmax_scale_per_batch_counts_and_leading_axes(device):
    module = reference_qassmax(4, 16, True, 0).to(device)
    q = torch.randn(3, 4, 7, 16, device=device)
    counts = [1, 50, 8]
    with torch.no_grad():
        got = ops.qassmax_scale(
            q, torch.tensor(counts, device=device), module.base_mlp, module.query_mlp
        )
        # Entry b against the reference with n = counts[b]. The per-batch base MLP is one GEMM
        # over all counts (the reference's has one row): BLAS may sum in another order (seen:
        # 4.5e-6 on the H200 machine's CPU with these deliberately large random weights).
        for b, count in enumerate(counts):
            torch.testing.assert_close(got[b], module(q, count)[b], atol=1e-5, rtol=1e-5)
        # Extra leading axes (the column stage's [tables, columns, heads, L, D]) with one count.
        q5 = torch.randn(2, 3, 4, 5, 16, device=device)
        torch.testing.assert_close(
            ops.qassmax_scale(
                q5, torch.tensor(12, device=device), module.base_mlp, module.query_mlp
            ),
            module(q5.flatten(0, 1), 12).view_as(q5),
            atol=1e-6,
            rtol=0,
        )


def test_qassmax_scale_keeps_strides():
    module = reference_qassmax(2, 8, True, 1)
    q = torch.randn(3, 6, 2, 8).transpose(1, 2)  # head-split projection layout
    with torch.no_grad():
        got = ops.qassmax_scale(q, torch.tensor(4), module.base_mlp, module.query_mlp)
    assert got.stride() == q.stride()


# -- padded attention equals unpadded attention ---------------------------------------------------


@pytest.mark.parametrize("device", device_params())
def test_padded_attention_block_equals_unpadded(device):
    """The ICL attention pattern on a padded table: every row queries the first n_train rows,
    QASSMax uses n = n_train. Real rows of the padded result equal the unpadded result."""
    heads, head_dim = 2, 8
    dim = heads * head_dim
    torch.manual_seed(0)
    project = nn.Linear(dim, 3 * dim).to(device)
    qassmax = reference_qassmax(heads, head_dim, True, 2).to(device)
    embed = nn.Linear(1, dim).to(device)

    def split(t):
        return t.unflatten(-1, (heads, head_dim)).transpose(1, 2)

    for n_train, n_test, n_features in random_tables(2, count=20):
        bucket = GRID.bucket_for(n_train, n_test, n_features)
        x = torch.randn(2, n_train + n_test, n_features, device=device)
        padded = ops.pad_to_bucket(
            x, n_train, bucket.train_rows, bucket.test_rows, bucket.features, fill=3.0
        )
        with torch.no_grad():
            # Rows become tokens: the feature sum stands in for the earlier stages.
            def tokens(table, features):
                return embed(table[..., :features].sum(-1, keepdim=True))

            q, k, v = (split(t) for t in project(tokens(x, n_features)).chunk(3, -1))
            expected = F.scaled_dot_product_attention(
                qassmax(q, n_train), k[:, :, :n_train], v[:, :, :n_train]
            )
            n = torch.tensor(n_train, device=device)
            pq, pk, pv = (split(t) for t in project(tokens(padded, n_features)).chunk(3, -1))
            got = ops.prefix_attention(
                ops.qassmax_scale(pq, n, qassmax.base_mlp, qassmax.query_mlp), pk, pv, n
            )
        real = torch.cat(
            [got[:, :, :n_train], got[:, :, bucket.train_rows : bucket.train_rows + n_test]], dim=2
        )
        atol = 1e-6 if device == "cpu" else 2e-5
        torch.testing.assert_close(real, expected, atol=atol, rtol=0)


# -- operator plumbing ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", device_params())
def test_opcheck_every_operator(device):
    x = torch.randn(2, 7, 3, device=device)
    torch.library.opcheck(torch.ops.tabserve.pad_to_bucket.default, (x, 4, 8, 4, 4, -1.0))
    torch.library.opcheck(
        torch.ops.tabserve.pad_labels.default, (torch.randn(2, 5, device=device), 8, 0.0)
    )
    q, k, v = (torch.randn(2, 2, length, 8, device=device) for length in (5, 9, 9))
    for n in (torch.tensor(4, device=device), torch.tensor([3, 9], device=device)):
        torch.library.opcheck(
            torch.ops.tabserve.prefix_attention.default, (q, k, v, n, None, "auto")
        )
    module = reference_qassmax(2, 8, True, 0).to(device)
    weights = [
        p.detach()
        for mlp in (module.base_mlp, module.query_mlp)
        for p in (mlp[0].weight, mlp[0].bias, mlp[2].weight, mlp[2].bias)
    ]
    torch.library.opcheck(
        torch.ops.tabserve.qassmax_scale.default, (q, torch.tensor([3, 9], device=device), *weights)
    )


BAD_PADS = [
    (lambda x: (x[0], 2, 4, 4, 4), "x must be a 3-D tensor"),
    (lambda x: (x, 8, 8, 4, 4), "n_train must be in"),
    (lambda x: (x, 3, 2, 4, 4), "train_bucket .* must hold"),
    (lambda x: (x, 3, 4, 1, 4), "test_bucket .* must hold"),
    (lambda x: (x, 3, 4, 4, 2), "feature_bucket .* must hold"),
]


@pytest.mark.parametrize("args, match", BAD_PADS)
def test_pad_rejects_bad_arguments_by_name(args, match):
    x = torch.randn(2, 7, 3)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.tabserve.pad_to_bucket(*args(x))


def test_pad_labels_rejects_small_bucket_and_scalars():
    with pytest.raises(RuntimeError, match="train_bucket .* must hold"):
        ops.pad_labels(torch.zeros(2, 5), 4)
    with pytest.raises(RuntimeError, match="y_train must have at least 1 dimension"):
        ops.pad_labels(torch.tensor(1.0), 4)


BAD_ATTENTION = [
    ({"q": torch.randn(2, 5, 8)}, "q, k and v must be 4-D"),
    ({"q": torch.randint(0, 3, (2, 2, 5, 8))}, "q must be a floating-point tensor"),
    ({"k": torch.randn(2, 2, 9, 8).double()}, "k has dtype"),
    ({"v": torch.randn(3, 2, 9, 8)}, "k and v must have q's batch and heads"),
    ({"k": torch.randn(2, 2, 9, 4)}, "k must have q's head_dim"),
    ({"v": torch.randn(2, 2, 7, 8)}, "v must have as many keys as k"),
    ({"k": torch.randn(2, 2, 0, 8), "v": torch.randn(2, 2, 0, 8)}, "k must hold at least one key"),
    ({"n": torch.tensor(3.0)}, "n_keys must be an int32 or int64 tensor"),
    ({"n": torch.tensor([1, 2, 3])}, "n_keys must be 0-d or have shape \\[2\\]"),
    ({"n": torch.tensor(0)}, "n_keys must be in \\[1, 9\\]"),
    ({"n": torch.tensor([4, 10])}, "n_keys must be in \\[1, 9\\].*batch entry 1"),
    ({"backend": "cudnn"}, 'backend must be one of "auto"'),
]


@pytest.mark.parametrize("change, match", BAD_ATTENTION)
def test_prefix_attention_rejects_bad_arguments_by_name(change, match):
    args = {
        "q": torch.randn(2, 2, 5, 8),
        "k": torch.randn(2, 2, 9, 8),
        "v": torch.randn(2, 2, 9, 8),
        "n": torch.tensor(4),
        "backend": "auto",
    }
    args.update(change)
    with pytest.raises(RuntimeError, match=match):
        ops.prefix_attention(args["q"], args["k"], args["v"], args["n"], backend=args["backend"])


def test_qassmax_scale_rejects_bad_arguments_by_name():
    module = reference_qassmax(2, 8, True, 0)
    q = torch.randn(2, 2, 5, 8)
    with pytest.raises(RuntimeError, match="n_keys must be an int32 or int64"):
        ops.qassmax_scale(q, torch.tensor(2.0), module.base_mlp, module.query_mlp)
    with pytest.raises(RuntimeError, match="n_keys must be 0-d or have shape"):
        ops.qassmax_scale(q[0], torch.tensor([1, 2]), module.base_mlp, module.query_mlp)
    with pytest.raises(RuntimeError, match="base_weight2 has shape"):
        other = reference_qassmax(3, 8, True, 0)
        ops.qassmax_scale(q, torch.tensor(2), other.base_mlp, module.query_mlp)
    with pytest.raises(RuntimeError, match="query_weight1 has shape"):
        other = reference_qassmax(2, 4, True, 0)
        ops.qassmax_scale(q, torch.tensor(2), module.base_mlp, other.query_mlp)
    with pytest.raises(RuntimeError, match="q must be"):
        ops.qassmax_scale(q[0, 0], torch.tensor(2), module.base_mlp, module.query_mlp)


# -- CUDA only ------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("backend", ["auto", "efficient", "masked"])
@pytest.mark.parametrize("per_batch", [False, True])
def test_prefix_attention_cuda_fp32_equals_sdpa_on_sliced_keys(backend, per_batch):
    for seed in range(30):
        q, k, v, n = attention_case(seed, "cuda", torch.float32, per_batch)
        got = ops.prefix_attention(q, k, v, n, backend=backend)
        expected = sliced_reference(q.double(), k.double(), v.double(), n.cpu()).float()
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)


@requires_cuda
@pytest.mark.parametrize("backend", ["auto", "flash", "efficient", "masked"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefix_attention_cuda_half_precision(backend, dtype):
    atol = 2e-3 if dtype == torch.float16 else 1.6e-2
    for seed in range(30):
        q, k, v, n = attention_case(seed, "cuda", dtype, per_batch=seed % 2 == 1)
        got = ops.prefix_attention(q, k, v, n, backend=backend)
        expected = sliced_reference(q, k, v, n.cpu(), dtype=torch.float32)
        torch.testing.assert_close(got.float(), expected, atol=atol, rtol=0)


@requires_cuda
@pytest.mark.parametrize(
    "dtype, head_dim, value_dim",
    [(torch.float16, 4, 4), (torch.bfloat16, 12, 12), (torch.float32, 2, 2), (torch.float16, 8, 4)],
)
def test_prefix_attention_cuda_auto_runs_shapes_no_fused_kernel_takes(dtype, head_dim, value_dim):
    """Head dims the fused kernels have no kernel for (the tiny test models' fp16 head dim 4 made
    the memory-efficient kernel fail with "cutlassF: no kernel found"): "auto" falls back to the
    masked SDPA and stays exact; an explicit fused backend is refused by name."""
    gen = torch.Generator().manual_seed(head_dim)
    q, k, v = (
        torch.randn(3, 2, length, dim, generator=gen).to(dtype).cuda()
        for length, dim in ((7, head_dim), (11, head_dim), (11, value_dim))
    )
    n = torch.tensor([11, 4, 1], device="cuda")
    got = ops.prefix_attention(q, k, v, n)
    expected = sliced_reference(q, k, v, n.cpu(), dtype=torch.float64)
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=0)
    for backend in ("flash", "efficient"):
        with pytest.raises(RuntimeError, match=f'backend "{backend}" needs'):
            ops.prefix_attention(q, k, v, n, backend=backend)


@requires_cuda
def test_prefix_attention_cuda_clamps_out_of_range_counts():
    q, k, v = (torch.randn(2, 2, length, 8, device="cuda") for length in (5, 9, 9))
    got = ops.prefix_attention(q, k, v, torch.tensor([0, 50], device="cuda"))
    expected = sliced_reference(q, k, v, torch.tensor([1, 9]))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)


@requires_cuda
@pytest.mark.parametrize("backend", ["auto", "efficient", "masked"])
def test_prefix_attention_cuda_graph_replays_for_every_count(backend):
    dtype = torch.float16
    q, k, v = (torch.randn(4, 8, length, 64, device="cuda", dtype=dtype) for length in (40, 64, 64))
    n = torch.tensor(64, device="cuda")
    module = reference_qassmax(8, 64, True, 0).cuda().half()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):  # warm-up outside capture
            ops.prefix_attention(
                ops.qassmax_scale(q, n, module.base_mlp, module.query_mlp), k, v, n, backend=backend
            )
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = ops.prefix_attention(
            ops.qassmax_scale(q, n, module.base_mlp, module.query_mlp), k, v, n, backend=backend
        )
    for count in (1, 17, 64, 33):
        n.fill_(count)
        graph.replay()
        with torch.no_grad():
            eager = ops.prefix_attention(
                ops.qassmax_scale(q, n, module.base_mlp, module.query_mlp), k, v, n, backend=backend
            )
            expected = sliced_reference(
                module(q, count), k, v, torch.tensor(count), dtype=torch.float32
            )
        assert torch.equal(out, eager)
        # The fused fp16 QASSMax may round a scaled query 1 ulp apart from the module's cuBLAS
        # sums (tested above): a few fp16 ulp of the attention output.
        torch.testing.assert_close(out.float(), expected, atol=6e-3, rtol=0)


def qassmax_float64(q, counts, weights):
    """QASSMax in float64 with the weights rounded to q's dtype (as the operator uses them)."""
    bw1, bb1, bw2, bb2, qw1, qb1, qw2, qb2 = (w.to(q.dtype).double() for w in weights)
    heads = q.shape[-3]
    x = q.double()
    log_n = torch.tensor(counts, dtype=torch.float64).clamp_min(1).log().reshape(-1, 1)
    base = F.linear(F.gelu(F.linear(log_n, bw1, bb1)), bw2, bb2)  # [1 or batch, heads * (D or 1)]
    base = base.view(base.shape[0], *[1] * (q.dim() - 4), heads, 1, -1)
    modulation = 1 + torch.tanh(F.linear(F.gelu(F.linear(x, qw1, qb1)), qw2, qb2))
    return x * base * modulation


def random_qassmax_case(seed, dtype, elementwise):
    rng = random.Random(seed)
    heads, head_dim = rng.choice([1, 2, 8]), rng.choice([4, 16, 24, 64, 80])
    module = reference_qassmax(heads, head_dim, elementwise, seed)
    weights = [
        p.detach()
        for mlp in (module.base_mlp, module.query_mlp)
        for p in (mlp[0].weight, mlp[0].bias, mlp[2].weight, mlp[2].bias)
    ]
    layout = rng.choice(["4d", "5d", "projection"])
    gen = torch.Generator().manual_seed(seed)
    batch, rows = rng.randint(1, 4), rng.choice([1, 5, 128, 300])
    if layout == "5d":  # the column stage's [tables, columns, heads, L, D]
        q = torch.randn(batch, 2, heads, rows, head_dim, generator=gen)
    elif layout == "projection":  # [B, L, heads, D] seen as [B, heads, L, D]
        q = torch.randn(batch, rows, heads, head_dim, generator=gen).transpose(1, 2)
    else:
        q = torch.randn(batch, heads, rows, head_dim, generator=gen)
    per_batch = layout != "5d" and rng.random() < 0.5
    counts = [rng.choice([0, 1, 7, 512, 10_000]) for _ in range(batch if per_batch else 1)]
    return q.to(dtype), counts, per_batch, weights


def assert_within_the_composites_error(got, q, counts, per_batch, weights):
    """``got`` (CUDA) against float64 maths: within twice the CPU composite's error plus 4 ulp of
    the largest output (half-precision intermediates flip at rounding boundaries when sums run
    in another order), in q's dtype and strides."""
    n = torch.tensor(counts if per_batch else counts[0])
    with torch.no_grad():
        composite = ops.qassmax_scale(q, n, weights[:4], weights[4:])
    assert got.dtype == q.dtype and got.stride() == q.stride()
    exact = qassmax_float64(q, counts, weights)
    bound = 4 * torch.finfo(q.dtype).eps * exact.abs().max().item()
    fused_error = (got.cpu().double() - exact).abs().max().item()
    composite_error = (composite.double() - exact).abs().max().item()
    assert fused_error <= 2 * composite_error + bound, (fused_error, composite_error)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("elementwise", [True, False])
def test_qassmax_scale_cuda_within_the_composites_error(dtype, elementwise):
    """The fused CUDA kernel (the composite for head dims above 64) against float64 maths, on
    4-D, 5-D and head-split layouts with shared and per-batch n. fp32 runs the composite on
    CUDA too, equal to the reference module (test_qassmax_scale_equals_reference_...): its
    cuBLAS sums cancel by more than a few ulp with these deliberately large weights (seen on the
    H200), so the float64 bound here is for the half-precision kernel only."""
    if ReferenceQASSMax is None and not elementwise:
        pytest.skip("tabicl not installed: only the element-wise variant has a reference")
    for seed in range(16):
        q, counts, per_batch, weights = random_qassmax_case(seed, dtype, elementwise)
        n = torch.tensor(counts if per_batch else counts[0], device="cuda")
        with torch.no_grad():
            got = ops.qassmax_scale(
                q.cuda(), n, [w.cuda() for w in weights[:4]], [w.cuda() for w in weights[4:]]
            )
        assert_within_the_composites_error(got, q, counts, per_batch, weights)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_qassmax_scale_cuda_any_mlp_width_and_many_tiles(dtype):
    """The kernel pads the query MLP's hidden width to its tensor-core tiles (16) and walks many
    64-row tiles per block: widths off that grid (1, 40, 100, 128, and 129 past the kernel's
    limit: the composite), base MLPs of any width, both output variants, and long query runs
    (several tiles per block, a partial last tile) against float64 maths."""
    rng = random.Random(5)
    for case, (query_hidden, base_hidden) in enumerate(
        [(1, 3), (40, 64), (100, 37), (128, 200), (129, 8)]
    ):
        heads, head_dim = rng.choice([2, 8]), rng.choice([16, 24, 64])
        query_out = head_dim if case % 2 == 0 else 1
        base_out = head_dim if case % 3 else 1
        gen = torch.Generator().manual_seed(case)
        shapes = [
            (base_hidden, 1),
            (base_hidden,),
            (heads * base_out, base_hidden),
            (heads * base_out,),
            (query_hidden, head_dim),
            (query_hidden,),
            (query_out, query_hidden),
            (query_out,),
        ]
        weights = [torch.randn(*shape, generator=gen) * 0.5 for shape in shapes]
        q = torch.randn(3, heads, rng.choice([700, 2049]), head_dim, generator=gen).to(dtype)
        counts = [rng.randint(1, 9000) for _ in range(3)]
        with torch.no_grad():
            got = ops.qassmax_scale(
                q.cuda(),
                torch.tensor(counts, device="cuda"),
                [w.cuda() for w in weights[:4]],
                [w.cuda() for w in weights[4:]],
            )
        assert_within_the_composites_error(got, q, counts, True, weights)


@requires_cuda
def test_qassmax_scale_cuda_keeps_a_strided_head_dim():
    """q whose head_dim is not contiguous (the kernel's rows need it): the composite, in q's
    strides, within its error against float64 maths."""
    module = reference_qassmax(2, 16, True, 3)
    weights = [
        p.detach()
        for mlp in (module.base_mlp, module.query_mlp)
        for p in (mlp[0].weight, mlp[0].bias, mlp[2].weight, mlp[2].bias)
    ]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 16, 5, 2, generator=gen).half().permute(0, 3, 2, 1)  # stride(-1) = 10
    with torch.no_grad():
        got = ops.qassmax_scale(
            q.cuda(),
            torch.tensor(40, device="cuda"),
            [w.cuda() for w in weights[:4]],
            [w.cuda() for w in weights[4:]],
        )
    assert_within_the_composites_error(got, q, [40], False, weights)


@requires_cuda
def test_qassmax_scale_cuda_per_batch_counts_past_the_grid_limit():
    module = reference_qassmax(1, 16, True, 4)
    weights = [
        p.detach()
        for mlp in (module.base_mlp, module.query_mlp)
        for p in (mlp[0].weight, mlp[0].bias, mlp[2].weight, mlp[2].bias)
    ]
    q = torch.randn(70_000, 1, 3, 16, generator=torch.Generator().manual_seed(0)).half()
    counts = torch.randint(-2, 3000, (70_000,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ops.qassmax_scale(
            q.cuda(),
            counts.cuda(),
            [w.cuda() for w in weights[:4]],
            [w.cuda() for w in weights[4:]],
        )
    assert_within_the_composites_error(got, q, counts.tolist(), True, weights)


@requires_cuda
def test_pad_to_bucket_cuda_equals_cpu_on_a_large_table():
    x = torch.randn(8, 3000 + 700, 37)
    got = ops.pad_to_bucket(x.cuda(), 3000, 3072, 768, 40, fill=-2.0)
    assert torch.equal(got.cpu(), ops.pad_to_bucket(x, 3000, 3072, 768, 40, fill=-2.0))


@requires_cuda
def test_cuda_ops_reject_mixed_devices():
    q, k, v = (torch.randn(2, 2, length, 8, device="cuda") for length in (5, 9, 9))
    with pytest.raises(RuntimeError, match="n_keys is on cpu"):
        ops.prefix_attention(q, k, v, torch.tensor(3))
    with pytest.raises(RuntimeError, match="k is on cpu"):
        ops.prefix_attention(q, k.cpu(), v, torch.tensor(3, device="cuda"))


def test_log_n_is_computed_once_in_double():
    # The reference rounds math.log(n) to q's dtype once; so does the operator.
    module = reference_qassmax(1, 4, True, 3)
    q = torch.randn(1, 1, 3, 4)
    for n in (3, 2**31 - 1):
        with torch.no_grad():
            torch.testing.assert_close(
                ops.qassmax_scale(q, torch.tensor(n), module.base_mlp, module.query_mlp),
                module(q, n),
                atol=1e-6,
                rtol=0,
            )
    assert math.log(1) == 0.0
