"""small_head_attention (csrc/ops/attention.cpp, csrc/ops/cuda/attention.cu): float64 softmax maths
over the first n keys, on seeded shapes of TabICLv2's column and row stages (head-split views of
packed projections, broadcast queries, padded keys); its checks, opcheck, torch.compile, CUDA
graph replay with a new n, and the model stages on it. CPU, and CUDA when present."""

import copy

import pytest
import tabserve  # noqa: F401  (registers torch.ops.tabserve)
import torch
from cuda_helpers import requires_cuda
from tabicl_helpers import our_model, random_table
from tabserve import ops
from tabserve.models.tabicl.network.stage_kernels import StageKernels, use_stage_kernels

cuda_only = [pytest.mark.cuda, requires_cuda]


def exact(q, k, v, n=None, scale=0.25):
    """float64 attention of q over the first n keys (n: None, an int, or one int per batch)."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    counts = [k.shape[2]] * q.shape[0] if n is None else n
    counts = [counts] * q.shape[0] if isinstance(counts, int) else counts
    out = []
    for b, count in enumerate(counts):
        scores = q[b] @ k[b, :, :count].transpose(-1, -2) * scale
        out.append(torch.softmax(scores, -1) @ v[b, :, :count])
    return torch.stack(out)


def packed_qkv(seed, batch, heads, queries, keys, dtype, device, spare=0):
    """q, k, v as the model makes them: head-split views of packed projections [B, L, 3 E]
    (``spare`` extra columns make the rows unaligned for vector loads)."""
    g = torch.Generator().manual_seed(seed)
    width = 3 * heads * 16 + spare
    qs = torch.randn(batch, queries, width, generator=g).to(dtype).to(device)
    kv = torch.randn(batch, keys, width, generator=g).to(dtype).to(device)

    def split(t, i):
        heads_part = t[..., i * heads * 16 : (i + 1) * heads * 16]
        return heads_part.unflatten(-1, (heads, 16)).transpose(1, 2)

    return split(qs, 0), split(kv, 1), split(kv, 2)


# (batch, heads, queries, keys, n): the stages' shapes at small sizes, and edges.
CASES = [
    (6, 8, 68, 68, None),  # row stage: every token over every token
    (6, 8, 4, 68, None),  # row stage, last block: the CLS tokens only
    (3, 8, 128, 300, [300, 17, 1]),  # column stage, inducing points over padded train rows
    (3, 8, 250, 128, None),  # column stage, every row over the induced tokens
    (2, 1, 1, 1, None),  # one query, one key
    (2, 2, 17, 129, 128),  # one key past a chunk, n shared (0-d)
    (1, 3, 33, 257, [256]),  # keys over two chunks, n at the edge
]


def _n_tensor(n, device, dtype=torch.int64):
    if n is None:
        return None
    return torch.tensor(n[0] if isinstance(n, list) and len(n) == 1 else n, dtype=dtype).to(device)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-h{}-q{}-k{}-n{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cpu_equals_float64_maths(case, dtype):
    batch, heads, queries, keys, n = case
    q, k, v = packed_qkv(1, batch, heads, queries, keys, dtype, "cpu")
    out = ops.small_head_attention(q, k, v, _n_tensor(n, "cpu"))
    n_exact = n[0] if isinstance(n, list) and len(n) == 1 else n
    expected = exact(q, k, v, n_exact)
    tolerance = {torch.float32: 2e-6, torch.float64: 1e-12, torch.bfloat16: 1e-2}[dtype]
    assert out.dtype == dtype and out.shape == (batch, heads, queries, 16)
    assert out.transpose(1, 2).is_contiguous()  # heads merge back with a view
    assert (out.double() - expected).abs().max().item() <= tolerance


def test_broadcast_queries_and_scale():
    # The inducing points are one query set for every column: stride 0 over the batch.
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 8, 128, 16, generator=g).expand(5, 8, 128, 16)
    k, v = (torch.randn(5, 8, 40, 16, generator=g) for _ in range(2))
    out = ops.small_head_attention(q, k, v, scale=0.7)
    assert (out.double() - exact(q, k, v, scale=0.7)).abs().max().item() <= 2e-6


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda q, k, v: (q[0], k, v, None), "must be 4-D"),
        (lambda q, k, v: (q[..., :8], k[..., :8], v[..., :8], None), "q must have head_dim 16"),
        (lambda q, k, v: (q, k.double(), v, None), "k has dtype"),
        (lambda q, k, v: (q, k, v[:, :, :3], None), "v must have as many keys as k"),
        (lambda q, k, v: (q, k[:1], v[:1], None), "k must have q's batch and heads"),
        (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0], None), "at least one key"),
        (lambda q, k, v: (q.long(), k.long(), v.long(), None), "floating-point"),
        (lambda q, k, v: (q, k, v, torch.tensor(2.0)), "int32 or int64"),
        (lambda q, k, v: (q, k, v, torch.tensor([1, 2, 3])), "must be 0-d or have shape"),
        (lambda q, k, v: (q, k, v, torch.tensor(0)), "n_keys must be in [1, 5]"),
        (lambda q, k, v: (q, k, v, torch.tensor([1, 6])), "got 6 at batch entry 1"),
        (lambda q, k, v: (q, k.to("meta"), v, None), "k is on meta"),
    ],
)
def test_bad_arguments_are_named(make, message):
    q, k, v = (torch.randn(2, 3, 4 if i == 0 else 5, 16) for i in range(3))
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[")):
        ops.small_head_attention(*make(q, k, v))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
def test_opcheck(device):
    dtype = torch.float32 if device == "cpu" else torch.float16
    q, k, v = packed_qkv(3, 2, 2, 9, 21, dtype, device)
    op = torch.ops.tabserve.small_head_attention.default
    torch.library.opcheck(op, (q, k, v))
    torch.library.opcheck(op, (q, k, v, torch.tensor([21, 4], device=device), 0.5))
    torch.library.opcheck(op, (q, k, v, torch.tensor(7, dtype=torch.int32, device=device)))
    cos, sin = rope_tables(21, dtype, device)
    torch.library.opcheck(op, (q, k, v, torch.tensor([3, 21], device=device), None, cos, sin))


def rope_tables(length, dtype, device, base=10_000.0):
    """The row stage's RoPE tables (fp32 [length, 16]), as the model builds them."""
    from tabserve.models.tabicl.network.layers import RotaryEmbedding

    return RotaryEmbedding(16, base).to(device).tables(length, device, dtype)


def rotated(x, tables):
    """x rotated by the model's ATen composite (rotate-half in fp32, back to x's dtype)."""
    from tabserve.models.tabicl.network.layers import rotate_half

    cos, sin = (t[: x.shape[-2]] for t in tables)
    return rotate_half(x, cos, sin)


ROPE_CASES = [
    (6, 8, 68, 68, None),  # the row stage
    (5, 8, 20, 20, [20, 3, 1, 20, 7]),  # padded features: a count per row
    (2, 2, 150, 150, 140),  # more tokens than one staged chunk (keys streamed)
    (3, 8, 4, 68, None),  # the CLS block: 4 queries at positions 0-3 over every token
]


@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: "b{}-h{}-q{}-k{}".format(*c[:4]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_rotary_tables_equal_rotating_first(case, dtype):
    batch, heads, queries, keys, n = case
    q, k, v = packed_qkv(11, batch, heads, queries, keys, dtype, "cpu")
    tables = rope_tables(max(queries, keys) + 3, dtype, "cpu")  # longer tables are fine
    count = _n_tensor(n, "cpu")
    got = ops.small_head_attention(q, k, v, count, rotary=tables)
    assert torch.equal(
        got, ops.small_head_attention(rotated(q, tables), rotated(k, tables), v, count)
    )
    n_exact = n[0] if isinstance(n, list) and len(n) == 1 else n
    expected = exact(rotated(q.double(), tables), rotated(k.double(), tables), v, n_exact)
    tolerance = 2e-6 if dtype == torch.float32 else 3e-2
    assert (got.double() - expected).abs().max().item() <= tolerance


@pytest.mark.parametrize(
    "tables, message",
    [
        (lambda c, s: (c, None), "rotary_cos and rotary_sin must be given together"),
        (lambda c, s: (c[:4], s[:4]), "rotary_cos must be \\[L, 16\\] with L >= max"),
        (lambda c, s: (c, s[:, :8]), "rotary_sin must be \\[L, 16\\]"),
        (lambda c, s: (c.double(), s.double()), "rotary_cos must be float32"),
        (lambda c, s: (c, s.to("meta")), "rotary_sin is on meta"),
    ],
)
def test_bad_rotary_tables_are_named(tables, message):
    q, k, v = packed_qkv(12, 2, 2, 5, 6, torch.float32, "cpu")
    cos, sin = tables(*rope_tables(6, torch.float32, "cpu"))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.tabserve.small_head_attention(q, k, v, None, None, cos, sin)


def test_compiles_in_one_graph_with_n_from_a_tensor():
    torch._dynamo.reset()

    def attend(q, k, v, n):
        return ops.small_head_attention(q, k, v, n).transpose(1, 2).flatten(-2) * 2

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    q, k, v = packed_qkv(4, 2, 8, 10, 30, torch.float32, "cpu")
    for n in (30, 11, 1):
        count = torch.tensor(n)
        assert torch.equal(compiled(q, k, v, count), attend(q, k, v, count))


def test_stage_kernel_choice_reaches_the_attention_layers():
    from tabserve.models.tabicl.network.layers import SHORT_KEYS

    model = copy.deepcopy(our_model("clf", "tiny"))  # our_model is cached: change a copy
    use_stage_kernels(model.row_interactor, StageKernels(attention="head16"))
    row = [m.small_heads for m in model.row_interactor.modules() if hasattr(m, "small_heads")]
    col = [m.small_heads for m in model.col_embedder.modules() if hasattr(m, "small_heads")]
    assert row and all(row) and col and not any(col)
    use_stage_kernels(model.col_embedder, StageKernels(attention="head16-short"))
    limits = {
        m.small_head_max_keys
        for stage in (model.row_interactor, model.col_embedder)
        for m in stage.modules()
        if hasattr(m, "small_heads")
    }
    assert limits == {None, SHORT_KEYS}
    # On the CPU (fp32) the kernel does not apply: the stages run SDPA (the CLS block's keys,
    # handed over unrotated for the kernel, are rotated before it), same numbers.
    X, y = random_table(7, 2, 12, 4, 5, 3)
    assert torch.equal(model(X, y), our_model("clf", "tiny")(X, y))


def test_row_stage_options_put_the_kernel_in_the_row_stage_only():
    """``attention={"row": "head16"}`` reaches the row stage's attention layers through
    ServedTabICL, and only those."""
    from tabserve.models.tabicl.serving.options import ServingOptions
    from tabserve.models.tabicl.serving.served import ServedTabICL

    model = copy.deepcopy(our_model("clf", "tiny"))
    ServedTabICL(model, ServingOptions(precision="fp16", attention={"row": "head16"}))
    row = [m.small_heads for m in model.row_interactor.modules() if hasattr(m, "small_heads")]
    others = [
        m.small_heads
        for stage in (model.col_embedder, model.icl_predictor)
        for m in stage.modules()
        if hasattr(m, "small_heads")
    ]
    assert row and all(row) and others and not any(others)


# -- CUDA ---------------------------------------------------------------------------------------

CUDA_CASES = CASES + [
    (2, 8, 128, 8192, [8192, 5000]),  # inducing points over 8,192 padded train rows
    (2, 8, 2000, 128, None),  # many query tiles over one staged chunk (blocks of 32 tiles)
    (40, 8, 68, 68, [68] * 20 + [10] * 20),  # row stage with padded features
    (3, 3, 20, 50, [50, 7, 1]),  # every head of an entry in one block, per-entry n
    (2, 16, 64, 128, None),  # 16 heads' keys exceed one block's staging: a block per head
    (2, 2, 200, 300, [300, 150]),  # streamed keys, 13 query tiles over two blocks per head
    # More units than resident blocks: each block walks units, staging the next one's keys
    # while it attends over the current one's (both buffers, counts changing between units).
    (1200, 8, 68, 68, [68, 41, 9] * 400),
]

#: RoPE in the kernel, on CUDA: also the resident blocks walking many units (keys rotated in
#: shared memory after each unit's copies land).
CUDA_ROPE_CASES = ROPE_CASES + [(1200, 8, 68, 68, [68, 41, 9] * 400)]


def on_cuda_cases(cases):
    """A CUDA test over ``cases`` x (fp16, bf16) x (aligned, unaligned rows)."""

    def decorate(test):
        for mark in (
            requires_cuda,
            pytest.mark.cuda,
            pytest.mark.parametrize("case", cases, ids=lambda c: "b{}-h{}-q{}-k{}".format(*c[:4])),
            pytest.mark.parametrize("spare", [0, 1], ids=["aligned", "unaligned"]),
            pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"]),
        ):
            test = mark(test)
        return test

    return decorate


@on_cuda_cases(CUDA_CASES)
def test_cuda_equals_float64_maths_within_the_fused_kernels_error(case, dtype, spare):
    """Within 2x the error of PyTorch's SDPA on the same half-precision inputs (plus 1 ulp of
    the output dtype), and within an absolute bound, for aligned and unaligned rows."""
    batch, heads, queries, keys, n = case
    q, k, v = packed_qkv(5, batch, heads, queries, keys, dtype, "cuda", spare)
    n_exact = n[0] if isinstance(n, list) and len(n) == 1 else n
    for index_dtype in (torch.int64, torch.int32):
        out = ops.small_head_attention(q, k, v, _n_tensor(n, "cuda", index_dtype))
        expected = exact(q, k, v, n_exact)
        error = (out.double().cpu() - expected).abs().max().item()
        counts = [keys] * batch if n_exact is None else n_exact
        counts = [counts] * batch if isinstance(counts, int) else counts
        # SDPA on fresh copies: PyTorch's fused kernels assume aligned rows ("misaligned
        # address" on the unaligned views on the H200, scripts/probe_unaligned.py); a size-1
        # view counts as contiguous, so copy with clone, not contiguous().
        sdpa = torch.cat(
            [
                torch.nn.functional.scaled_dot_product_attention(
                    q[b : b + 1].clone(memory_format=torch.contiguous_format),
                    k[b : b + 1, :, :c].clone(memory_format=torch.contiguous_format),
                    v[b : b + 1, :, :c].clone(memory_format=torch.contiguous_format),
                )
                for b, c in enumerate(counts)
            ]
        )
        sdpa_error = (sdpa.double().cpu() - expected).abs().max().item()
        ulp = torch.finfo(dtype).eps * expected.abs().max().item()
        assert error <= 2 * sdpa_error + ulp, (error, sdpa_error)
        assert error <= (2e-2 if dtype == torch.bfloat16 else 3e-3)


@pytest.mark.cuda
@requires_cuda
def test_cuda_clamps_counts_and_takes_a_batch_past_the_grid_limit():
    q, k, v = packed_qkv(6, 70_000, 1, 5, 9, torch.float16, "cuda")  # batch > 65,535
    counts = torch.randint(-3, 14, (70_000,), generator=torch.Generator().manual_seed(0))
    out = ops.small_head_attention(q, k, v, counts.cuda())
    clamped = counts.clamp(1, 9)
    for b in (0, 1, 2, 69_999, *torch.nonzero(counts <= 0)[:2, 0].tolist()):
        expected = exact(q[b : b + 1], k[b : b + 1], v[b : b + 1], int(clamped[b]))
        assert (out[b : b + 1].double().cpu() - expected).abs().max().item() <= 3e-3


@pytest.mark.cuda
@requires_cuda
def test_cuda_graph_replays_with_a_new_count():
    q, k, v = packed_qkv(7, 3, 8, 128, 600, torch.float16, "cuda")
    n = torch.tensor(600, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ops.small_head_attention(q, k, v, n)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.small_head_attention(q, k, v, n)
    for count in (600, 129, 1):
        n.fill_(count)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, ops.small_head_attention(q, k, v, n))
        assert (captured.double().cpu() - exact(q, k, v, count)).abs().max().item() <= 3e-3


@on_cuda_cases(CUDA_ROPE_CASES)
def test_cuda_rotary_in_the_kernel_is_bitwise_rotating_first(case, dtype, spare):
    """The kernel's RoPE rounds each product and the sum in fp32, as ATen's composite does:
    the rotated operands, and so the outputs, are bit for bit those of rotating first."""
    batch, heads, queries, keys, n = case
    q, k, v = packed_qkv(13, batch, heads, queries, keys, dtype, "cuda", spare)
    tables = rope_tables(max(queries, keys), dtype, "cuda")
    count = _n_tensor(n, "cuda")
    got = ops.small_head_attention(q, k, v, count, rotary=tables)
    first = ops.small_head_attention(rotated(q, tables), rotated(k, tables), v, count)
    assert torch.equal(got, first)


@pytest.mark.cuda
@requires_cuda
def test_cuda_refuses_fp32():
    q, k, v = packed_qkv(8, 1, 1, 4, 4, torch.float32, "cuda")
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        ops.small_head_attention(q, k, v)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("task", ["clf", "reg"])
def test_cuda_model_on_the_kernel_matches_sdpa_in_fp16(task, monkeypatch):
    """The released architecture's column and row stages (8 heads of 16) on
    small_head_attention: the model's fp16 answers within the fp16 tolerance of the same model
    on SDPA, and both close to fp32."""
    calls = []
    kernel_op = ops.small_head_attention
    monkeypatch.setattr(
        ops, "small_head_attention", lambda *a, **kw: calls.append(1) or kernel_op(*a, **kw)
    )
    # Copies: our_model is cached, and the stage kernels must not leak into it.
    plain = copy.deepcopy(our_model(task, "full")).cuda()
    kernel = copy.deepcopy(plain)
    for stage in (kernel.col_embedder, kernel.row_interactor):
        use_stage_kernels(stage, StageKernels(attention="head16"))
    X, y = random_table(9, 4, 300, 40, 12, 3 if task == "clf" else 0)
    X, y = X.cuda(), y.cuda()
    with torch.no_grad():
        fp32 = plain(X, y)
        with torch.autocast("cuda", dtype=torch.float16):
            sdpa = plain(X, y)
            assert not calls
            ours = kernel(X, y)
    assert len(calls) >= 6, len(calls)  # every column and row block ran on the kernel
    bound = 2e-2 * max(1.0, fp32.abs().max().item())
    errors = [
        (got.float() - want.float()).abs().max().item()
        for got, want in ((ours, fp32), (ours, sdpa), (sdpa, fp32))
    ]
    assert max(errors[:2]) <= bound, (errors, bound)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("col_backend", ["head16-short", "head16-flash"])
def test_cuda_model_stages_on_the_kernel_match_sdpa_in_fp16(col_backend, monkeypatch):
    """The full v2 model with the row stage on the kernel (RoPE rotated in the kernel, the CLS
    block's keys too) and the column stage's short key runs on it (``head16-short``: the rows
    over the induced tokens, not the inducing points over 240 train rows, which
    ``head16-flash`` sends to ``tabserve.ops.flash_attention``), against the same model on
    SDPA, both under fp16 autocast: the fp16 recipes' tolerance (probabilities within 2e-2,
    argmax agreement >= 99%)."""
    from tabserve.models.tabicl.network import layers

    flash_calls, flash = [], layers._flash_attention_op()
    monkeypatch.setattr(
        layers,
        "_flash_attention_op",
        lambda: (
            lambda q, k, v, fp8: (
                flash_calls.append((q.shape[-2], k.shape[-2], fp8)) or flash(q, k, v, fp8)
            )
        ),
    )
    model = copy.deepcopy(our_model("clf", "full")).cuda()
    g = torch.Generator().manual_seed(3)
    X = torch.randn(2, 300, 10, generator=g).cuda()
    y = (torch.arange(240) % 4).float()[None].expand(2, -1).cuda()
    calls, attend = [], ops.small_head_attention

    def recording(q, k, v, n_keys=None, scale=None, rotary=None):
        calls.append((q.shape[-2], k.shape[-2], rotary is not None))
        return attend(q, k, v, n_keys, scale, rotary=rotary)

    monkeypatch.setattr(ops, "small_head_attention", recording)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        use_stage_kernels(model.row_interactor, StageKernels(attention="head16"))
        use_stage_kernels(model.col_embedder, StageKernels(attention=col_backend))
        kernel = model(X, y).float().softmax(-1)
        use_stage_kernels(model.row_interactor, StageKernels(attention="cudnn"))
        use_stage_kernels(model.col_embedder, StageKernels(attention="cudnn"))
        plain = model(X, y).float().softmax(-1)
    cls = model.row_interactor.num_cls
    assert (cls, 10 + cls, True) in calls  # the CLS block's keys rotated in the kernel
    inducing = model.col_embedder.tf_col.blocks[0].ind_vectors.shape[0]
    column = [c for c in calls if not c[2]]
    assert column and all(c == (300, inducing, False) for c in column)
    if col_backend == "head16-flash":  # the inducing points over the train rows, one call per block
        blocks = len(model.col_embedder.tf_col.blocks)
        assert flash_calls == [(inducing, 240, False)] * blocks
    else:
        assert not flash_calls
    assert (kernel - plain).abs().max() <= 2e-2
    assert (kernel.argmax(-1) == plain.argmax(-1)).double().mean() >= 0.99


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("scale", [0.7, -0.3, 0.0])
@pytest.mark.parametrize("keys, n", [(50, [50, 21]), (300, [300, 133])], ids=["chunk", "streamed"])
def test_cuda_scales_of_any_sign(scale, keys, n):
    """The kernel takes the max over raw scores and folds the scale into the exponent: a
    negative scale (queries' signs flipped) and a zero scale (uniform weights) still give
    float64 maths' softmax, with a partly filled last tile of keys."""
    q, k, v = packed_qkv(8, 2, 2, 40, keys, torch.float16, "cuda")
    out = ops.small_head_attention(q, k, v, _n_tensor(n, "cuda"), scale=scale)
    error = (out.double().cpu() - exact(q, k, v, n, scale=scale)).abs().max().item()
    assert error <= 3e-3, error
