"""tabserve::all_equal: whether every value of each set equals a value (the column stage's
sentinel check). Reference: ``(x == value).flatten(-dims).all(-1)`` in ATen."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import requires_cuda
from tabserve import ops

SKIP = -100.0


def reference(x: torch.Tensor, value: float, dims: int) -> torch.Tensor:
    return (x == value).flatten(-dims).all(-1) if dims > 1 else (x == value).all(-1)


def cells(shape, sentinel_sets, dtype=torch.float32, seed=0, dims=2) -> torch.Tensor:
    """Random cells with the sets in ``sentinel_sets`` (indices into the flattened leading
    dims) all sentinels, and a few sets that are sentinels except for one late value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    flat = x.view(-1, *shape[-dims:])
    for s in sentinel_sets:
        flat[s] = SKIP
    late = [s for s in range(flat.shape[0]) if s not in sentinel_sets][:2]
    for s in late:  # all sentinels but the very last value: read to the end, not all equal
        flat[s] = SKIP
        flat[s].view(-1)[-1] = 0.5
    return x


CASES = [
    ((2, 5, 40, 16), [0, 3, 9], torch.float32, 2),
    ((3, 4, 33, 7), [1, 11], torch.float16, 2),
    ((6, 129), [0, 5], torch.bfloat16, 1),
    ((2, 3, 4, 5), [0], torch.float64, 3),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[2]}-{c[3]}")
def test_cpu_equals_aten(case):
    shape, sentinel_sets, dtype, dims = case
    x = cells(shape, sentinel_sets, dtype, dims=dims)
    got = ops.all_equal(x, SKIP, dims)
    assert got.dtype == torch.bool and got.shape == shape[:-dims]
    assert torch.equal(got, reference(x, SKIP, dims))
    assert int(got.sum()) == len(sentinel_sets)


def test_strided_nan_empty_and_value_rounding():
    x = cells((4, 6, 10, 8), [2, 7])
    strided = x.transpose(0, 1)  # sets stay [10, 8] blocks; leading dims strided
    assert torch.equal(ops.all_equal(strided, SKIP, 2), reference(strided, SKIP, 2))
    nan = torch.full((3, 5), float("nan"))
    assert not ops.all_equal(nan, float("nan"), 1).any()  # NaN equals nothing
    empty = torch.empty(3, 0)
    assert ops.all_equal(empty, SKIP, 1).all()  # an empty set is all equal (as ATen's all)
    assert ops.all_equal(torch.empty(0, 4), SKIP, 1).shape == (0,)
    # The value rounds to x's dtype first: 0.1 in fp16 equals fp16(0.1).
    tenth = torch.full((2, 4), 0.1).half()
    assert ops.all_equal(tenth, 0.1, 1).all() and ops.all_equal(tenth, 0.1, 1).equal(
        reference(tenth, 0.1, 1)
    )


@pytest.mark.parametrize(
    "x,dims,message",
    [
        (torch.zeros(3, 4), 0, "dims must be >= 1"),
        (torch.zeros(3, 4), 3, "x must have at least dims = 3 dimensions"),
        (torch.zeros(3, 4, dtype=torch.int64), 1, "x must be a floating-point tensor"),
    ],
    ids=["dims 0", "dims past x", "integer x"],
)
def test_bad_input_is_refused_naming_the_argument(x, dims, message):
    with pytest.raises(RuntimeError, match=message):
        ops.all_equal(x, SKIP, dims)
    with pytest.raises(RuntimeError):
        ops.all_equal(x.to("meta"), SKIP, dims)  # the fake kernel refuses it too
    if torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=message):
            ops.all_equal(x.cuda(), SKIP, dims)


def test_opcheck_and_one_compiled_graph():
    x = cells((2, 3, 5, 4), [1])
    torch.library.opcheck(torch.ops.tabserve.all_equal.default, (x, SKIP, 2))
    torch._dynamo.reset()
    fn = torch.compile(lambda t: ops.all_equal(t, SKIP, 2), fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(x), reference(x, SKIP, 2))


@requires_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[2]}-{c[3]}")
def test_cuda_equals_cpu(case):
    shape, sentinel_sets, dtype, dims = case
    x = cells(shape, sentinel_sets, dtype, dims=dims)
    assert torch.equal(ops.all_equal(x.cuda(), SKIP, dims).cpu(), reference(x, SKIP, dims))


@requires_cuda
def test_cuda_long_sets_and_many_sets():
    # The large workload's sets (10,240 rows x 128): one all-sentinel set read whole, one
    # differing only in its last value, the rest random.
    x = cells((2, 4, 10240, 128), [0, 5])
    assert torch.equal(ops.all_equal(x.cuda(), SKIP, 2).cpu(), reference(x, SKIP, 2))
    # More sets than the grid's 2^20 blocks: the blocks walk the sets.
    many = torch.randn((1 << 20) + 77, 3)
    many[::1000] = SKIP
    assert torch.equal(ops.all_equal(many.cuda(), SKIP, 1).cpu(), reference(many, SKIP, 1))
