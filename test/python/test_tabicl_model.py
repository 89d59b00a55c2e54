"""Model-level parity of tabserve's TabICLv2 with the reference ``tabicl`` 2.2.0 (fp32, CPU).

Every case loads the same reference-format checkpoint into both implementations and compares the
raw outputs (logits / quantiles) and the KV-cached paths. Tolerance: 1e-5 absolute.
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import zlib

import pytest
import torch
from tabicl_helpers import (
    fp32_inference_config,
    our_model,
    random_table,
    reference_checkpoint,
    reference_model,
    requires_cuda,
)
from tabserve.models.tabicl.network.layers import broadcast_batch

ATOL = 1e-5
#: On CUDA, cuBLAS picks kernels by shape; quantiles of magnitude ~5 then differ by ~1e-5 abs.
CUDA_RTOL = 1e-5

# (size, tables, train rows, test rows, features, classes); classes 0 = regression.
CLASSIFIER_CASES = [
    ("full", 2, 40, 9, 5, 2),
    ("full", 1, 1, 1, 1, 1),
    ("full", 3, 64, 16, 100, 10),
    ("full", 1, 2000, 500, 3, 3),
    ("full", 1, 33, 5, 8, 11),
    ("tiny", 1, 120, 20, 6, 25),
    ("tiny", 2, 30, 4, 2, 2),
    ("tiny", 4, 200, 50, 17, 7),
    ("tiny", 1, 300, 30, 40, 10),
    ("tiny", 2, 150, 12, 9, 11),
    ("tiny", 1, 400, 25, 4, 25),
    ("tiny", 3, 150, 20, 6, 25),  # members walk the hierarchy together, uneven rows per group
    ("tiny", 2, 404, 6, 3, 101),  # three levels: the 11-class group splits again
    ("tiny", 1, 1, 500, 3, 1),
]
REGRESSOR_CASES = [
    ("full", 2, 50, 10, 4, 0),
    ("full", 1, 1, 3, 1, 0),
    ("full", 1, 700, 100, 100, 0),
    ("tiny", 3, 100, 20, 12, 0),
    ("tiny", 1, 2000, 200, 2, 0),
]


def _case_id(case):
    size, b, n, m, h, k = case
    return f"{size}-B{b}-N{n}-M{m}-H{h}-K{k}"


def _seed(case):
    return zlib.crc32(_case_id(case).encode())


def _task(n_classes):
    return "reg" if n_classes == 0 else "clf"


def _reference(case, **kwargs):
    size, b, n, m, h, k = case
    X, y = random_table(_seed(case), b, n, m, h, k)
    with torch.no_grad():
        out = reference_model(_task(k), size)(
            X, y, inference_config=fp32_inference_config(), **kwargs
        )
    return X, y, out


@pytest.mark.parametrize("case", CLASSIFIER_CASES + REGRESSOR_CASES, ids=_case_id)
def test_forward_matches_reference(case):
    X, y, expected = _reference(case)
    got = our_model(_task(case[-1]), case[0])(X, y)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "case", [CLASSIFIER_CASES[0], CLASSIFIER_CASES[4], CLASSIFIER_CASES[9]], ids=_case_id
)
def test_probabilities_match_reference(case):
    X, y, expected = _reference(case, return_logits=False, softmax_temperature=0.7)
    got = our_model("clf", case[0])(X, y, return_logits=False, softmax_temperature=0.7)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("classes", [14, 37])
def test_hierarchy_of_a_batch_equals_each_table_alone(classes):
    """The tables of a batch walk the class hierarchy together (one ICL pass per node, each
    table's rows of the node packed to the front and counted as keys): each table's answer is
    the one it gets alone, at two and three levels."""
    X, y = random_table(21, 3, 90, 7, 5, classes)
    model = our_model("clf", "tiny")
    with torch.no_grad():
        together = model(X, y)
        alone = [model(X[b : b + 1], y[b : b + 1]) for b in range(3)]
    # Logits of a few units: 1e-6 of their scale (a few fp32 ulp; GEMMs of other row counts).
    atol = 1e-6 * max(1.0, together.abs().max().item())
    torch.testing.assert_close(together, torch.cat(alone), atol=atol, rtol=0)


@pytest.mark.parametrize("case", [REGRESSOR_CASES[0], REGRESSOR_CASES[3]], ids=_case_id)
def test_regression_statistics_match_reference(case):
    size, b, n, m, h, _ = case
    X, y = random_table(7, b, n, m, h)
    kinds = ["mean", "variance", "median", "quantiles", "raw_quantiles"]
    alphas = [0.0005, 0.01, 0.25, 0.5, 0.8, 0.9995]
    with torch.no_grad():
        expected = reference_model("reg", size).predict_stats(
            X, y, output_type=kinds, alphas=alphas, inference_config=fp32_inference_config()
        )
    got = our_model("reg", size).predict_stats(X, y, output_type=kinds, alphas=alphas)
    assert set(got) == set(kinds)
    for kind in kinds:
        torch.testing.assert_close(got[kind], expected[kind], atol=ATOL, rtol=0, msg=kind)
    default = our_model("reg", size).predict_stats(X, y, output_type="quantiles")
    assert default.shape == (b, m, 9)


CACHE_CASES = [
    CLASSIFIER_CASES[0],
    CLASSIFIER_CASES[2],
    CLASSIFIER_CASES[7],
    REGRESSOR_CASES[0],
    REGRESSOR_CASES[3],
]


def _reference_cached(size: str, k: int, X, y, mode: str):
    """The reference's prediction of X's test rows from its cache (``cache_mode``) of the train rows."""
    ref = reference_model(_task(k), size)
    config = fp32_inference_config()
    n = y.shape[1]
    with torch.no_grad():
        ref.forward_with_cache(
            X_train=X[:, :n], y_train=y, store_cache=True, cache_mode=mode, inference_config=config
        )
        cached = ref.forward_with_cache(
            X_test=X[:, n:], use_cache=True, store_cache=False, inference_config=config
        )
        ref.clear_cache()
    return cached


@pytest.mark.parametrize("case", CACHE_CASES, ids=_case_id)
def test_kv_cache_matches_uncached_and_reference_cache(case):
    size, b, n, m, h, k = case
    X, y = random_table(11, b, n, m, h, k)
    ref_cached = _reference_cached(size, k, X, y, "kv")
    ours = our_model(_task(k), size)
    cache = ours.build_cache(X[:, :n], y)
    cached = ours.forward_with_cache(X[:, n:], cache)
    torch.testing.assert_close(cached, ours(X, y), atol=ATOL, rtol=0)
    torch.testing.assert_close(cached, ref_cached, atol=ATOL, rtol=0)
    # Batches of the cache serve batches of tables.
    torch.testing.assert_close(
        ours.forward_with_cache(X[-1:, n:], cache.select(slice(b - 1, b))), cached[-1:]
    )
    if k == 0:
        stats = ours.predict_stats_with_cache(X[:, n:], cache, output_type=["mean", "median"])
        direct = ours.predict_stats(X, y, output_type=["mean", "median"])
        torch.testing.assert_close(stats["mean"], direct["mean"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", CACHE_CASES, ids=_case_id)
def test_repr_cache_matches_uncached_and_the_reference_repr_cache(case):
    """``mode="repr"``: the column stage's K/V and the train representations, against the
    reference's ``cache_mode="repr"`` and the uncached model."""
    size, b, n, m, h, k = case
    X, y = random_table(12, b, n, m, h, k)
    ref_cached = _reference_cached(size, k, X, y, "repr")
    ours = our_model(_task(k), size)
    cache = ours.build_cache(X[:, :n], y, mode="repr")
    assert cache.train_repr.shape[:2] == (b, n)
    cached = ours.forward_with_cache(X[:, n:], cache)
    torch.testing.assert_close(cached, ours(X, y), atol=ATOL, rtol=0)
    torch.testing.assert_close(cached, ref_cached, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="mode must be one of"):
        ours.build_cache(X[:, :n], y, mode="keys")


@pytest.mark.parametrize(
    "case",
    [c for c in CLASSIFIER_CASES + REGRESSOR_CASES if c[5] <= 10],  # (the hierarchy: its own)
    ids=_case_id,
)
def test_icl_one_pass_equals_the_cache_path_and_the_reference(case):
    """``icl_one_pass``: train and test rows through each ICL block together give the
    reference's outputs (and the cache path's) within fp32 rounding; padded calls (``n_train``)
    keep the cache path."""
    from tabserve.models.tabicl.network.stage_kernels import StageKernels, use_stage_kernels

    X, y, want = _reference(case)
    size, _, n, _, _, k = case
    ours = copy.deepcopy(our_model(_task(k), size))  # cached: change a copy
    use_stage_kernels(ours, StageKernels(icl_one_pass=True))
    assert ours.icl_predictor.one_pass
    calls = []
    original = ours.icl_predictor._forward_one_pass
    ours.icl_predictor._forward_one_pass = lambda *a: calls.append(1) or original(*a)
    with torch.no_grad():
        got = ours(X, y)
        cached = ours.forward_with_cache(X[:, n:], ours.build_cache(X[:, :n], y))
    assert calls  # the one-pass path ran
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(got, cached, atol=ATOL, rtol=0)
    R = torch.randn(2, n + 3, ours.icl_predictor.ln.normalized_shape[0])
    calls.clear()
    with torch.no_grad():
        padded = ours.icl_predictor(R, y[:1].expand(2, -1), torch.tensor(n))
    assert not calls and padded.shape[:2] == (2, 3)


def test_cache_shapes_and_concat():
    ours = our_model("clf", "tiny")
    X, y = random_table(3, 2, 20, 5, 6, 3)
    cache = ours.build_cache(X[:, :20], y)
    cfg = ours.config
    assert len(cache.col) == cfg.col_num_blocks and len(cache.icl) == cfg.icl_num_blocks
    assert cache.col[0][0].shape == (
        2,
        6,
        cfg.col_nhead,
        cfg.col_num_inds,
        cfg.embed_dim // cfg.col_nhead,
    )
    assert cache.icl[0][0].shape == (2, cfg.icl_nhead, 20, cfg.icl_dim // cfg.icl_nhead)
    joined = type(cache).concat([cache.select(slice(0, 1)), cache.select(slice(1, 2))])
    torch.testing.assert_close(
        ours.forward_with_cache(X[:, 20:], joined), ours.forward_with_cache(X[:, 20:], cache)
    )
    assert cache.nbytes() > 0


def test_test_rows_are_independent():
    ours = our_model("clf", "tiny")
    X, y = random_table(5, 1, 30, 6, 4, 3)
    base = ours(X, y)
    X2 = X.clone()
    X2[0, 30] += 10.0
    moved = ours(X2, y)
    torch.testing.assert_close(moved[:, 1:], base[:, 1:], atol=1e-6, rtol=0)
    assert not torch.allclose(moved[:, 0], base[:, 0])


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (
            lambda X, y: (X.masked_fill(torch.rand_like(X) < 0.1, float("nan")), y),
            ValueError,
            "NaN or infinite",
        ),
        (
            lambda X, y: (X.masked_fill(torch.rand_like(X) < 0.1, float("inf")), y),
            ValueError,
            "NaN or infinite",
        ),
        (lambda X, y: (X, y[:, :0]), ValueError, "zero train rows"),
        (lambda X, y: (X.long(), y), TypeError, "floating-point"),
        (lambda X, y: (X.numpy(), y), TypeError, "torch.Tensor"),
        (lambda X, y: (X[0], y), ValueError, "tables, rows, features"),
        (lambda X, y: (X, y[:1]), ValueError, "y_train must be"),
        (lambda X, y: (X, y + 0.5), ValueError, "non-negative integers"),
        (lambda X, y: (X, torch.where(y == 1, 5.0, y)), ValueError, "exactly 0..K-1"),
        # Integral but past int64: once wrapped to a negative label that passed the checks and
        # then failed inside one_hot (a device assert in a compiled or captured graph).
        (lambda X, y: (X, torch.where(y == 2, 1e19, y)), ValueError, "exactly 0..K-1"),
        (
            lambda X, y: (X, torch.cat([y[:1], torch.zeros_like(y[1:])])),
            ValueError,
            "same number of classes",
        ),
        (lambda X, y: (X, y.masked_fill(y == 0, float("nan"))), ValueError, "NaN"),
        (lambda X, y: (X[:, :5], y), ValueError, "train labels for only"),
    ],
    ids=[
        "nan",
        "inf",
        "no-train-rows",
        "int-dtype",
        "numpy",
        "2d",
        "batch",
        "fractional",
        "gap",
        "huge-label",
        "classes",
        "nan-y",
        "too-many-labels",
    ],
)
def test_bad_input_raises(mutate, error, match):
    X, y = random_table(1, 2, 12, 3, 4, 3)
    with pytest.raises(error, match=match):
        our_model("clf", "tiny")(*mutate(X, y))


def test_bad_cache_use_raises():
    ours = our_model("clf", "tiny")
    X, y = random_table(2, 1, 30, 4, 5, 12)
    with pytest.raises(ValueError, match="does not support 12 classes"):
        ours.build_cache(X[:, :30], y)
    X, y = random_table(2, 1, 30, 4, 5, 3)
    cache = ours.build_cache(X[:, :30], y)
    with pytest.raises(ValueError, match="does not match the cache"):
        ours.forward_with_cache(X[:, 30:, :4], cache)
    with pytest.raises(ValueError, match="regression checkpoint"):
        ours.predict_stats(X, y)
    with pytest.raises(ValueError, match="unknown output_type"):
        our_model("reg", "tiny").predict_stats(*random_table(2, 1, 10, 2, 3), output_type="mode")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cached_predict_reads_the_finiteness_of_x_test_after_the_model(bad, compiled, monkeypatch):
    """X_test with NaN / inf still raises, and its check is read only once the prediction's
    work is issued (no device wait between the check and the model); a clean X_test reads it
    too and predicts as before."""
    import copy

    model = copy.deepcopy(our_model("clf", "tiny"))  # our_model is cached
    X, y = random_table(2, 1, 30, 4, 5, 3)
    cache = model.build_cache(X[:, :30], y)
    expected = model.forward_with_cache(X[:, 30:], cache)
    order = []
    learner = model.icl_predictor.forward_cached
    monkeypatch.setattr(
        model.icl_predictor, "forward_cached", lambda *a: order.append("icl") or learner(*a)
    )
    check = model.raise_unless_all_finite
    monkeypatch.setattr(
        model, "raise_unless_all_finite", lambda *a: order.append("check") or check(*a)
    )
    predict = model.forward_with_cache
    if compiled:
        torch._dynamo.reset()
        predict = torch.compile(model.forward_with_cache, backend="aot_eager")
    X_test = X[:, 30:].clone()
    X_test[0, 2, 3] = bad
    with pytest.raises(ValueError, match="X_test contains NaN or infinite values"):
        predict(X_test, cache)
    assert torch.equal(predict(X[:, 30:], cache), expected)
    if not compiled:  # (under Dynamo the patched methods are traced, not called in order)
        assert order == ["icl", "check", "icl", "check"]


def expected_label_error(y):
    """The label contract, from Python sets: None when y_train is valid, else the message's start."""
    rows = y.tolist()
    values = [v for row in rows for v in row]
    if not all(math.isfinite(v) for v in values):
        return "y_train contains NaN or infinite values"
    if any(v < 0 or v != int(v) for v in values):
        return "classification labels must be non-negative integers"
    counts = [len(set(row)) for row in rows]
    if any(c != counts[0] for c in counts):
        return "all tables must have the same number of classes"
    if any(set(row) != set(range(counts[0])) for row in rows):
        return "labels of every table must be exactly 0..K-1"
    return None


def test_label_checks_equal_the_contract_on_random_labels():
    """The one-transfer label checks (distinct labels from sorted rows) against Python sets, on
    valid labels and every way to break them."""
    model = our_model("clf", "tiny")
    gen = torch.Generator().manual_seed(11)
    breaks = [None, "gap", "negative", "fraction", "nan", "inf", "uneven", "duplicate-only", "huge"]
    seen = set()
    for trial in range(160):
        # Every break meets 1, 2 and 3 tables (the table count cycles once per pass of breaks).
        kind = breaks[trial % len(breaks)]
        tables, classes = 1 + (trial // len(breaks)) % 3, 1 + trial % 4
        rows = classes + trial % 6
        y = torch.randint(0, classes, (tables, rows), generator=gen).float()
        y[:, :classes] = torch.arange(classes).float()  # every class present
        if kind == "gap":
            y[y == classes - 1] = classes
        elif kind == "negative":
            y[0, -1] = -1
        elif kind == "fraction":
            y[-1, 0] = 0.5
        elif kind == "nan":
            y[0, 0] = float("nan")
        elif kind == "inf":
            y[-1, -1] = float("inf")
        elif kind == "uneven" and tables > 1:
            y[0] = 0
        elif kind == "duplicate-only":
            y[:] = 0
        elif kind == "huge":  # integral, past int64: must not wrap to a small label
            y[0, -1] = 1e19
        X = torch.randn(tables, rows + 1, 3, generator=gen)
        expected = expected_label_error(y)
        seen.add(expected)
        if expected is None:
            _, num_classes = model.check_inputs(X, y)
            assert num_classes == len(set(y[0].tolist()))
        else:
            with pytest.raises(ValueError, match=expected.replace("..", r"\.\.")):
                model.check_inputs(X, y)
    assert len(seen) == 5  # valid, and each of the four label errors


def test_input_checks_read_the_device_once(monkeypatch):
    """All value checks of X and y_train reach the host in one transfer (one GPU sync)."""
    reads = []
    for method in ("item", "tolist", "__bool__", "__int__", "__index__"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(
            torch.Tensor,
            method,
            lambda self, *a, _m=method, _f=original: reads.append(_m) or _f(self, *a),
        )
    for task, classes in (("clf", 3), ("reg", 0)):
        model = our_model(task, "tiny")
        X, y = random_table(3, 2, 30, 6, 4, classes)
        reads.clear()
        assert model.check_inputs(X, y)[1] == classes
        assert reads == ["tolist"], (task, reads)


@pytest.mark.cuda
@requires_cuda
def test_cuda_input_checks_synchronise_once():
    import copy
    import warnings

    model = copy.deepcopy(our_model("clf", "tiny")).cuda()  # our_model is cached
    X, y = (t.cuda() for t in random_table(3, 2, 30, 6, 4, 3))
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            assert model.check_inputs(X, y)[1] == 3
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # (torch also warns once that the debug mode is a prototype: not a synchronisation)
    syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize(
    "case",
    [CLASSIFIER_CASES[2], CLASSIFIER_CASES[3], CLASSIFIER_CASES[5], REGRESSOR_CASES[2]],
    ids=_case_id,
)
def test_cuda_matches_reference(case):
    size, b, n, m, h, k = case
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    X, y = random_table(_seed(case), b, n, m, h, k)
    ref = reference_model(_task(k), size).cuda()
    try:
        with torch.no_grad():
            expected = ref(X.cuda(), y.cuda(), inference_config=fp32_inference_config("cuda"))
    finally:
        ref.cpu()
    ours = our_model(_task(k), size).cuda()
    try:
        got = ours(X.cuda(), y.cuda())
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=CUDA_RTOL)
        if 0 < k <= 10 or k == 0:
            cache = ours.build_cache(X[:, :n].cuda(), y.cuda())
            cached = ours.forward_with_cache(X[:, n:].cuda(), cache)
            torch.testing.assert_close(cached, got, atol=ATOL, rtol=CUDA_RTOL)
        torch.testing.assert_close(got.cpu(), ours.cpu()(X, y), atol=1e-4, rtol=0)
    finally:
        ours.cpu()


@pytest.mark.cuda
@requires_cuda
def test_cuda_attention_beyond_the_grid_batch_limit_with_flash():
    """The row stage's batch (members x rows) passes 65,535 on large tables; flash must still
    run (chunked) and equal the math kernel."""
    from tabserve.models.tabicl.network.layers import batched_sdpa
    from torch.nn.attention import SDPBackend, sdpa_kernel

    generator = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (
        torch.randn(70_000, 2, 5, 16, device="cuda", dtype=torch.float16, generator=generator)
        for _ in range(3)
    )
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        got = batched_sdpa(q, k, v)
    with sdpa_kernel(SDPBackend.MATH):
        expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    torch.testing.assert_close(got.float(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("uneven", [False, True], ids=["one-per-pass", "uneven"])
@pytest.mark.parametrize("stage", ["row", "column"])
def test_stages_run_large_inputs_in_chunks_with_the_same_results(stage, uneven):
    """Rows never interact in the row stage, feature groups never interact in the column stage:
    chunking them (one per pass, or uneven chunks) changes no prediction, one-shot (also with
    more classes than the model's maximum), KV-cached or padded."""
    import copy

    from tabserve.buckets import BucketGrid
    from tabserve.models.tabicl.serving.options import ServingOptions
    from tabserve.models.tabicl.serving.served import ServedTabICL

    X, y = random_table(11, 2, 20, 7, 5, 3)
    whole = our_model("clf", "tiny")
    chunked = copy.deepcopy(whole)
    module, method, axis, total = (
        (chunked.row_interactor, "_rows", 1, 27)  # 20 train + 7 test rows
        if stage == "row"
        else (chunked.col_embedder.tf_col, "forward", 1, 5)  # 5 feature groups
    )
    # Row stage: 2 tables x (5 groups + 4 CLS) tokens per row, so 100 tokens = 5 rows per pass;
    # column stage: 2 tables x 27 rows cells per group, so 108 cells = 2 groups per pass.
    if stage == "row":
        chunked.row_interactor.max_tokens = 100 if uneven else 1
    else:
        chunked.col_embedder.max_cells = 108 if uneven else 1
    passes = []
    original = getattr(module, method)

    def counting(tensor, *args):
        passes.append(tensor.shape[axis])
        return original(tensor, *args)

    setattr(module, method, counting)
    torch.testing.assert_close(chunked(X, y), whole(X, y), atol=1e-6, rtol=0)
    assert len(passes) > 1 and sum(passes) == total
    cache = chunked.build_cache(X[:, :20], y)
    expected = whole.forward_with_cache(X[:, 20:], whole.build_cache(X[:, :20], y))
    got = chunked.forward_with_cache(X[:, 20:], cache)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    grid = BucketGrid(train_rows=(24,), test_rows=(8,), features=(6,))
    served = ServedTabICL(chunked, ServingOptions(buckets=True), grid)
    torch.testing.assert_close(served(X, y), whole(X, y), atol=1e-6, rtol=0)
    many_X, many_y = random_table(12, 2, 40, 5, 4, 13)  # > max_classes: mixed-radix digits
    torch.testing.assert_close(chunked(many_X, many_y), whole(many_X, many_y), atol=1e-6, rtol=0)


def test_stages_run_in_host_sized_chunks_on_the_cpu(monkeypatch):
    """On the CPU both stages chunk at :data:`layers.HOST_CHUNK_TOKENS` whatever their own
    budget (which stays as it is elsewhere), with the predictions of one pass."""
    from tabserve.models.tabicl.network import layers

    assert layers.chunk_budget(1 << 24, torch.device("cpu")) == layers.HOST_CHUNK_TOKENS
    assert layers.chunk_budget(100, torch.device("cpu")) == 100
    assert layers.chunk_budget(1 << 24, torch.device("meta")) == 1 << 24
    assert layers.chunk_budget(1 << 24, torch.device("cuda")) == 1 << 24
    X, y = random_table(21, 2, 20, 7, 5, 3)
    model = our_model("clf", "tiny")
    monkeypatch.setattr(layers, "HOST_CHUNK_TOKENS", 1 << 30)
    whole = model(X, y)
    # 2 tables x 27 rows = 54 cells per feature group, 2 x (5 + 4) = 18 tokens per row.
    monkeypatch.setattr(layers, "HOST_CHUNK_TOKENS", 108)
    passes = {"column": [], "row": []}
    for stage, module, method in (
        ("column", model.col_embedder.tf_col, "forward"),
        ("row", model.row_interactor, "_rows"),
    ):
        original = getattr(module, method)

        def counting(tensor, *args, stage=stage, original=original):
            passes[stage].append(tensor.shape[1])
            return original(tensor, *args)

        monkeypatch.setattr(module, method, counting)
    torch.testing.assert_close(model(X, y), whole, atol=1e-6, rtol=0)
    assert passes == {"column": [2, 2, 1], "row": [6, 6, 6, 6, 3]}


@pytest.mark.parametrize("max_cells", [None, 108], ids=["whole", "chunked"])
def test_column_stage_hands_the_row_stage_its_tokens_on_every_path(max_cells):
    """``row_prefix`` / ``tokens_from_column_stage`` (``fused_row_tokens``): the column stage's
    output with the CLS tokens in front is the row stage's own concatenation, bit for bit, on
    every path of the column stage (one pass, chunks of feature groups, mixed-radix digits, the
    KV cache's train and test passes), and the model's predictions do not change (fp32: the
    modules' route, whose last feed-forward rearranges with ATen)."""
    import copy

    from tabserve.buckets import BucketGrid
    from tabserve.models.tabicl.network.stage_kernels import StageKernels
    from tabserve.models.tabicl.serving.options import ServingOptions
    from tabserve.models.tabicl.serving.served import ServedTabICL

    plain = our_model("clf", "tiny")
    moved = copy.deepcopy(plain)
    moved.row_interactor.kernels = StageKernels(fused_row_tokens=True)
    for model in (plain, moved):
        model.col_embedder.max_cells = max_cells or model.col_embedder.max_cells
    cls = plain.row_interactor.cls_tokens
    X, y = random_table(11, 2, 20, 7, 5, 3)
    many_X, many_y = random_table(12, 2, 40, 5, 4, 13)  # > max_classes: mixed-radix digits
    with torch.no_grad():
        for table, labels in ((X, y), (many_X, many_y)):
            cells = plain.col_embedder(table, labels)
            rows = moved.col_embedder(table, labels, row_prefix=cls)
            lead = cls.expand(*cells.shape[:2], *cls.shape)
            assert torch.equal(rows, torch.cat([lead, cells], dim=2))
            assert torch.equal(moved(table, labels), plain(table, labels))
        cache = moved.build_cache(X[:, :20], y)
        want = plain.forward_with_cache(X[:, 20:], plain.build_cache(X[:, :20], y))
        assert torch.equal(moved.forward_with_cache(X[:, 20:], cache), want)
        grid = BucketGrid(train_rows=(24,), test_rows=(8,), features=(6,))
        served = ServedTabICL(moved, ServingOptions(buckets=True), grid)
        assert moved.row_interactor.tokens_from_column_stage is False  # the options' choice
        moved.row_interactor.kernels = StageKernels(fused_row_tokens=True)
        assert torch.equal(served(X, y), ServedTabICL(plain, ServingOptions(buckets=True), grid)(X, y))


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.uint8, torch.float16, torch.bool]
)
def test_labels_of_any_real_dtype_equal_float_labels(dtype):
    """Integer, bool (binary) and half labels are the same labels: same predictions, plain and
    padded (bool labels must not reach round(), which has no bool kernel)."""
    from tabserve.buckets import BucketGrid
    from tabserve.models.tabicl.serving.options import ServingOptions
    from tabserve.models.tabicl.serving.served import ServedTabICL

    model = our_model("clf", "tiny")
    X, y = random_table(5, 2, 14, 4, 3, 2)
    want = model(X, y)
    assert torch.equal(model(X, y.to(dtype)), want)
    grid = BucketGrid(train_rows=(16,), test_rows=(8,), features=(4,))
    padded = ServedTabICL(copy.deepcopy(model), ServingOptions(buckets=True), grid)
    assert (padded(X, y.to(dtype)) - want).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "a, b",
    [((), ()), ((3,), ()), ((), (2, 1)), ((2, 1), (1, 4)), ((1,), (5,)), ((2, 3, 1), (3, 4)),
     ((0,), (1,)), ((1, 0), (3, 1))],
)  # fmt: skip
def test_broadcast_batch_is_torchs_broadcast(a, b):
    assert broadcast_batch(torch.Size(a), torch.Size(b)) == tuple(torch.broadcast_shapes(a, b))


def test_broadcast_batch_refuses_what_torch_refuses():
    with pytest.raises(RuntimeError):
        torch.broadcast_shapes((2, 3), (4, 3))
    with pytest.raises(RuntimeError, match=r"batch shapes \(2, 3\) and \(4, 3\) do not broadcast"):
        broadcast_batch(torch.Size((2, 3)), torch.Size((4, 3)))


@pytest.mark.parametrize("frame", [False, True], ids=["numpy", "dataframe-with-strings"])
def test_a_fresh_process_predicts_without_building_symbolic_shapes(frame):
    """An eager fit + predict, on numpy or on a DataFrame with string and NaN columns, never
    loads Dynamo or torch's symbolic-shape machinery (building them was most of a fresh
    process's first predict)."""
    code = f"""
import sys, numpy as np, pandas as pd, torch
from tabserve import TabICLClassifier
g = torch.Generator().manual_seed(0)
X, y = torch.randn(40, 4, generator=g).numpy(), (torch.arange(40) % 3).numpy()
if {frame}:
    X = pd.DataFrame(X, columns=list("abcd"))
    X["a"] = X["a"].where(X["b"] > -1.0)
    X["colour"] = np.array(["red", "green", "blue", None] * 10, dtype=object)
clf = TabICLClassifier(n_estimators=2, model_path={str(reference_checkpoint("clf", "tiny"))!r},
                       device="cpu").fit(X[:30], y[:30])
print("probabilities:", clf.predict_proba(X[30:]).shape)
print("dynamo loaded:", "torch._dynamo" in sys.modules)
print("symbolic shapes loaded:", "torch.fx.experimental.symbolic_shapes" in sys.modules)
"""
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert "probabilities: (10, 3)" in child.stdout
    assert "dynamo loaded: False" in child.stdout
    assert "symbolic shapes loaded: False" in child.stdout


@pytest.mark.parametrize("task, classes", [("clf", 3), ("clf", 13), ("reg", 0)])
def test_offloaded_call_equals_the_call_on_the_device(task, classes, tmp_path):
    """The column stage's output on the host or in a file, written by chunks of feature groups
    and read back by chunks of rows (small budgets: several of each), gives the same numbers."""
    from tabserve.models.tabicl.network.offload import DiskStore, host_store

    model = our_model(task, "tiny")
    model.col_embedder.max_cells, model.row_interactor.max_tokens = 500, 300
    X, y = random_table(0, 2, 40, 10, 9, n_classes=classes)
    expected = model(X, y)
    torch.testing.assert_close(model.forward_offloaded(X, y, host_store), expected, rtol=0, atol=0)
    with DiskStore(tmp_path) as store:
        torch.testing.assert_close(model.forward_offloaded(X, y, store), expected, rtol=0, atol=0)
        assert store.path.is_file()
    assert list(tmp_path.glob("*")) == []
    # The store holds one block per chunk of rows, (features, tables, rows, E), one after another.
    blocks = model.col_embedder.offloaded(
        X, y.to(X.dtype), classes, host_store, [slice(0, 15), slice(15, 50)]
    )
    assert [tuple(b.shape[:3]) for b in blocks] == [(9, 2, 15), (9, 2, 35)]
    assert all(b.is_contiguous() for b in blocks)
    assert blocks[1].data_ptr() == blocks[0].data_ptr() + blocks[0].nbytes


@pytest.mark.parametrize(
    "values, dtype",
    [([[0, 2, 1], [1, 0, 2]], torch.int64), ([30, 30, 12], torch.float64), (7, torch.int64)],
)
def test_device_values_hold_what_torch_tensor_makes(values, dtype):
    from tabserve.models.tabicl.network.transfer import device_values

    got = device_values(values, dtype, "cpu")
    assert got.dtype == dtype and torch.equal(got, torch.tensor(values, dtype=dtype))


@requires_cuda
def test_device_values_queue_behind_the_stream_where_torch_tensor_waits_for_it():
    """The host goes on while the GPU works: the copy is queued behind a busy stream; a
    ``torch.tensor(..., device="cuda")`` returns only once the stream has finished."""
    from tabserve.models.tabicl.network.transfer import device_values

    stream = torch.cuda.current_stream()
    torch.cuda._sleep(2_000_000_000)  # about a second of the GPU
    got = device_values([[0, 2, 1], [1, 0, 2]], torch.int64, "cuda")
    assert not stream.query()
    assert torch.equal(got.cpu(), torch.tensor([[0, 2, 1], [1, 0, 2]]))
    torch.cuda._sleep(2_000_000_000)
    torch.tensor([[0, 2, 1]], device="cuda")
    assert stream.query()  # what device_values spares the callers
