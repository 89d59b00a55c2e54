"""String-category lookup: StringColumn, StringIndex and the torch.ops.tabserve string operators,
checked against a Python dict on seeded random cases, on CPU and (when present) CUDA."""

import random

import numpy as np
import pyarrow as pa
import pytest
import tabserve
import torch
from cuda_helpers import requires_cuda
from tabserve import StringColumn, StringIndex, ops

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# -- the independent reference --------------------------------------------------------------


def as_bytes(value):
    return value.encode("utf-8") if isinstance(value, str) else value


def dict_codes(vocabulary, query):
    """Python-dict semantics: last duplicate wins, nulls never match, unknown -> -1."""
    table = {as_bytes(v): i for i, v in enumerate(vocabulary) if v is not None}
    return [-1 if q is None else table.get(as_bytes(q), -1) for q in query]


# -- seeded random labels -------------------------------------------------------------------

ALPHABETS = ["ab", "abcdefghij", "ÄÖü€😀ab", "\x00a"]


def random_label(rng, max_length):
    style = rng.randrange(6)
    if style == 0:  # short, from a tiny alphabet: many duplicates
        return "".join(rng.choice("ab") for _ in range(rng.randrange(4)))
    if style == 1:  # shared long prefix
        return "prefix-" * rng.randrange(1, 20) + str(rng.randrange(30))
    if style == 2:  # differ only in the middle
        middle = rng.choice("xyz")
        return "L" * (max_length // 2) + middle + "R" * (max_length // 2)
    if style == 3:  # raw bytes with NULs and high bytes
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
    alphabet = rng.choice(ALPHABETS)
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, max_length)))


def random_case(seed, vocabulary_size=None, query_size=None, max_length=80):
    rng = random.Random(seed)
    vocabulary_size = rng.randrange(0, 300) if vocabulary_size is None else vocabulary_size
    query_size = rng.randrange(0, 300) if query_size is None else query_size
    vocabulary = [
        None if rng.random() < 0.05 else random_label(rng, max_length)
        for _ in range(vocabulary_size)
    ]
    pool = [v for v in vocabulary if v is not None] or [""]
    query = []
    for _ in range(query_size):
        r = rng.random()
        query.append(None if r < 0.05 else rng.choice(pool) if r < 0.7 else random_label(rng, max_length))
    return vocabulary, query


# -- StringColumn -----------------------------------------------------------------------------


def test_from_pylist_round_trip_keeps_null_empty_and_bytes():
    values = ["a", "", None, "ÄÖü", b"\x00\xff", "x" * 1000]
    column = StringColumn.from_pylist(values)
    assert len(column) == 6
    assert column.valid.tolist() == [True, True, False, True, True, True]
    assert StringColumn.from_pylist(["a"]).valid.tolist() == [True]
    assert column.to_pylist(encoding=None) == [as_bytes(v) for v in values]
    assert StringColumn.from_pylist(["a", None]).to_pylist() == ["a", None]


def test_from_pylist_rejects_other_types_naming_the_index():
    with pytest.raises(TypeError, match=r"values\[1\]"):
        StringColumn.from_pylist(["a", 3])


@pytest.mark.parametrize("arrow_type", [pa.string(), pa.large_string(), pa.binary(), pa.large_binary()])
def test_from_arrow_honours_slices_and_validity(arrow_type):
    values = ["zero", None, "two", "", "four", None, "six"]
    array = pa.array([as_bytes(v) if arrow_type in (pa.binary(), pa.large_binary()) else v
                      for v in values], type=arrow_type)
    sliced = array.slice(1, 5)
    column = StringColumn.from_arrow(sliced)
    assert column.to_pylist() == values[1:6]
    assert int(column.offsets[0]) > 0  # offsets kept as they are: no rebasing copy
    if arrow_type in (pa.large_string(), pa.large_binary()):
        # zero-copy: the data tensor views the Arrow data buffer
        assert column.data.data_ptr() == sliced.buffers()[2].address


def test_from_arrow_chunked_and_empty():
    chunked = pa.chunked_array([["a", "b"], ["c"]])
    assert StringColumn.from_arrow(chunked).to_pylist() == ["a", "b", "c"]
    empty = StringColumn.from_arrow(pa.array([], type=pa.string()))
    assert len(empty) == 0 and empty.to_pylist() == []
    with pytest.raises(TypeError, match="array must hold strings"):
        StringColumn.from_arrow(pa.array([1, 2]))


def test_from_arrow_reads_immutable_buffers_without_a_copy():
    offsets = pa.py_buffer(np.array([0, 3, 3, 5], dtype=np.int64).tobytes())
    data = pa.py_buffer(b"abcde")  # immutable, as in a memory-mapped file or Ray's object store
    array = pa.LargeStringArray.from_buffers(3, offsets, data)
    column = StringColumn.from_arrow(array)
    assert column.to_pylist() == ["abc", "", "de"]
    assert column.data.data_ptr() == data.address


def test_to_gives_own_storage_at_offset_zero():
    values = ["abc", "de", None, "f"]
    column = StringColumn.from_arrow(pa.array(values, type=pa.large_string()).slice(1, 3))
    moved = column.to("cpu")
    assert moved.data.storage_offset() == 0 and int(moved.offsets[0]) == 0
    assert moved.data.untyped_storage().nbytes() == moved.data.numel()
    assert moved.to_pylist() == values[1:]


@pytest.mark.parametrize(
    "data, offsets, valid, error, match",
    [
        (torch.zeros(3, dtype=torch.int8), torch.tensor([0, 3]), None, TypeError, "data must be"),
        (torch.zeros(3, dtype=torch.uint8), torch.tensor([0, 3], dtype=torch.int32), None, TypeError, "offsets must be"),
        (torch.zeros(3, dtype=torch.uint8), torch.tensor([[0, 3]]), None, TypeError, "offsets must be"),
        (torch.zeros(3, dtype=torch.uint8), torch.tensor([0, 2, 1]), None, ValueError, "non-decreasing"),
        (torch.zeros(3, dtype=torch.uint8), torch.tensor([0, 4]), None, ValueError, "within"),
        (torch.zeros(3, dtype=torch.uint8), torch.tensor([-1, 3]), None, ValueError, "within"),
        (torch.zeros(3, dtype=torch.uint8), torch.tensor([0, 3]), torch.ones(2, dtype=torch.bool), ValueError, "valid must have"),
        (torch.zeros(3, dtype=torch.uint8), torch.tensor([0, 3]), torch.ones(1), TypeError, "valid must be"),
        (torch.zeros(3, dtype=torch.uint8), torch.tensor([], dtype=torch.int64), None, ValueError, "offsets must hold"),
    ],
)
def test_string_column_rejects_malformed_tensors(data, offsets, valid, error, match):
    with pytest.raises(error, match=match):
        StringColumn(data, offsets, valid)


# -- lookup against the dict reference ------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hash_bits", [64, 3, 0])
def test_lookup_matches_dict_on_random_cases(device, hash_bits):
    for seed in range(40 if hash_bits == 64 else 12):
        vocabulary, query = random_case(seed * 7 + hash_bits)
        index = StringIndex(StringColumn.from_pylist(vocabulary, device=device), _hash_bits=hash_bits)
        codes = index.lookup(StringColumn.from_pylist(query, device=device))
        assert codes.device.type == device and codes.dtype == torch.int64
        assert codes.tolist() == dict_codes(vocabulary, query), f"seed {seed}"


@pytest.mark.parametrize("device", DEVICES)
def test_lookup_long_labels_and_tiny_edits(device):
    base = bytes(np.random.default_rng(0).integers(0, 256, 70_001, dtype=np.uint8))
    variants = [base, base[:-1], base + b"\x00", base[:35_000] + b"!" + base[35_001:], b"", b"\x00"]
    vocabulary = variants + [base]  # base repeats: the last position wins
    query = variants + [base[:8], None]
    index = StringIndex(StringColumn.from_pylist(vocabulary, device=device))
    codes = index.lookup(StringColumn.from_pylist(query, device=device))
    assert codes.tolist() == dict_codes(vocabulary, query)
    assert codes[0].item() == len(vocabulary) - 1


@pytest.mark.parametrize("device", DEVICES)
def test_empty_vocabulary_and_empty_query(device):
    empty = StringColumn.from_pylist([], device=device)
    index = StringIndex(empty)
    assert index.lookup(StringColumn.from_pylist(["a", None, ""], device=device)).tolist() == [-1, -1, -1]
    assert index.lookup(empty).shape == (0,)
    only_nulls = StringIndex(StringColumn.from_pylist([None, None], device=device))
    assert only_nulls.lookup(StringColumn.from_pylist(["", None], device=device)).tolist() == [-1, -1]


@pytest.mark.parametrize("device", DEVICES)
def test_query_offsets_need_not_start_at_zero(device):
    vocabulary = ["red", "green", "blue"]
    array = pa.array(["pad", "blue", None, "red", "mauve"], type=pa.large_string()).slice(1, 4)
    query = StringColumn.from_arrow(array)
    assert int(query.offsets[0]) == 3
    if device != "cpu":  # a raw device column whose offsets start inside its data
        query = StringColumn(query.data.to(device), query.offsets.to(device), query.valid.to(device))
    index = StringIndex(StringColumn.from_pylist(vocabulary, device=device))
    assert index.lookup(query).tolist() == [2, -1, 0, -1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hash_bits", [64, 2])
def test_multi_column_lookup_matches_per_column_dicts(device, hash_bits):
    rng = random.Random(hash_bits)
    cases = [random_case(100 + c) for c in range(5)]
    cases[2] = ([], cases[2][1])  # an empty vocabulary among the columns
    # the same labels in different columns must map to each column's own positions
    cases[3] = (["x", "y", "x"], ["x", "y", "z", None])
    cases[4] = (["y", "x"], ["x", "y", "z", None])
    rng.shuffle(cases)
    index = StringIndex.from_columns(
        [StringColumn.from_pylist(v, device=device) for v, _ in cases], _hash_bits=hash_bits
    )
    codes = index.lookup_columns([StringColumn.from_pylist(q, device=device) for _, q in cases])
    expected = [code for v, q in cases for code in dict_codes(v, q)]
    assert codes.tolist() == expected
    for c, (v, q) in enumerate(cases):  # the single-column op addresses one packed column
        assert index.lookup(StringColumn.from_pylist(q, device=device), column=c).tolist() == dict_codes(v, q)


def test_multi_column_lookup_beyond_one_launch():
    # more columns than one CUDA launch carries (32), and the same path on CPU
    for device in DEVICES:
        cases = [random_case(500 + c, vocabulary_size=20, query_size=15) for c in range(70)]
        index = StringIndex.from_columns([StringColumn.from_pylist(v, device=device) for v, _ in cases])
        codes = index.lookup_columns([StringColumn.from_pylist(q, device=device) for _, q in cases])
        assert codes.tolist() == [code for v, q in cases for code in dict_codes(v, q)]


# -- dictionary_lookup: dictionary-encoded columns in one call --------------------------------


def dictionary_case(seed, columns, rows, device, extra_code_columns=0):
    """Vocabularies, per-column batch categories and a row-codes matrix (nulls, out-of-range codes
    included), with the dict reference of dictionary_lookup's output."""
    rng = np.random.default_rng(seed)
    cases = [random_case(seed * 1000 + c, vocabulary_size=int(rng.integers(0, 40)),
                         query_size=int(rng.integers(0, 25))) for c in range(columns)]
    width = columns + extra_code_columns
    code_columns = [int(c) for c in rng.permutation(width)[:columns]]
    codes = np.empty((rows, width), dtype=np.int64)
    expected = np.empty((rows, columns), dtype=np.int64)
    for c, (vocabulary, query) in enumerate(cases):
        k = code_columns[c]
        # valid codes, -1 nulls, and codes past either end (treated as null)
        codes[:, k] = rng.integers(-3, len(query) + 3, size=rows)
        found = dict_codes(vocabulary, query)
        expected[:, c] = [found[i] if 0 <= i < len(query) else -1 for i in codes[:, k]]
    index = StringIndex.from_columns([StringColumn.from_pylist(v, device=device) for v, _ in cases])
    queries = [StringColumn.from_pylist(q, device=device) for _, q in cases]
    return index, queries, torch.from_numpy(codes).to(device), code_columns, expected


def dictionary_lookup(index, queries, codes, code_columns=None, **kwargs):
    return ops.dictionary_lookup(
        index.vocabulary.data, index.vocabulary.offsets, index.segments, index.slot_hash,
        index.slot_row, [q.data for q in queries], [q.offsets for q in queries],
        [q.valid for q in queries], codes, code_columns, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed, columns, rows, extra", [(1, 1, 50, 0), (2, 7, 300, 3), (3, 13, 1, 0),
                                                        (4, 5, 0, 2), (5, 140, 40, 5)])
def test_dictionary_lookup_matches_the_dict_reference(device, seed, columns, rows, extra):
    # 140 columns: more than one CUDA launch of either kernel (32 lookup, 128 gather columns)
    index, queries, codes, code_columns, expected = dictionary_case(seed, columns, rows, device, extra)
    out = dictionary_lookup(index, queries, codes, code_columns)
    assert out.dtype == torch.int64 and out.device == codes.device and out.is_contiguous()
    np.testing.assert_array_equal(out.cpu().numpy(), expected)
    # a strided (column-major) codes matrix reads the same codes
    strided = codes.t().contiguous().t()
    np.testing.assert_array_equal(dictionary_lookup(index, queries, strided, code_columns).cpu().numpy(), expected)
    if extra == 0:  # code_columns None: column c reads codes[:, c]
        ordered = codes[:, code_columns]
        np.testing.assert_array_equal(dictionary_lookup(index, queries, ordered).cpu().numpy(), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_dictionary_lookup_equals_multi_lookup_then_gather(device):
    index, queries, codes, code_columns, _ = dictionary_case(8, 6, 120, device)
    looked_up = index.lookup_columns(queries).cpu().tolist()
    start, want = 0, []
    for c, q in enumerate(queries):
        want.append([looked_up[start + k] if 0 <= k < len(q) else -1 for k in codes[:, code_columns[c]].tolist()])
        start += len(q)
    assert dictionary_lookup(index, queries, codes, code_columns).t().tolist() == want


BAD_DICTIONARY = [
    (lambda codes: {"codes": codes.to(torch.int32)}, "codes must be an int64"),
    (lambda codes: {"codes": codes[:, 0]}, "codes must be 2-D"),
    (lambda codes: {"codes": codes[:, :1]}, "one column per query column"),
    (lambda codes: {"codes": codes, "code_columns": [0]}, "code_columns must hold one entry"),
    (lambda codes: {"codes": codes, "code_columns": [0, 2]}, r"code_columns\[1\] must be in \[0, 2\)"),
    (lambda codes: {"codes": codes, "code_columns": [-1, 0]}, r"code_columns\[0\] must be in"),
]


@pytest.mark.parametrize("corrupt, match", BAD_DICTIONARY)
def test_dictionary_lookup_rejects_bad_codes_by_name(corrupt, match):
    index, queries, codes, code_columns, expected = dictionary_case(9, 2, 10, "cpu")
    with pytest.raises(RuntimeError, match=match):
        dictionary_lookup(index, queries, **corrupt(codes))
    with pytest.raises(RuntimeError, match="one entry per vocabulary column"):
        dictionary_lookup(index, queries[:1], codes[:, :1])
    # the fitted index is unharmed
    np.testing.assert_array_equal(dictionary_lookup(index, queries, codes, code_columns).numpy(), expected)


@requires_cuda
def test_dictionary_lookup_rejects_codes_on_another_device():
    index, queries, codes, code_columns, _ = dictionary_case(10, 3, 10, "cuda")
    with pytest.raises(RuntimeError, match="codes is on cpu"):
        dictionary_lookup(index, queries, codes.cpu(), code_columns)


@requires_cuda
def test_dictionary_lookup_cuda_equals_cpu_and_replays_in_a_cuda_graph():
    index, queries, codes, code_columns, expected = dictionary_case(11, 40, 2000, "cuda")
    out = dictionary_lookup(index, queries, codes, code_columns, check_offsets=False)
    np.testing.assert_array_equal(out.cpu().numpy(), expected)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up on a side stream, as capture requires
        dictionary_lookup(index, queries, codes, code_columns, check_offsets=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dictionary_lookup(index, queries, codes, code_columns, check_offsets=False)
    codes.copy_(torch.flip(codes, dims=[0]))  # new row codes in place: the replay reads them
    graph.replay()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(captured.cpu().numpy(), expected[::-1])


def test_table_capacity_matches_the_operator():
    for rows in [0, 1, 7, 8, 9, 100, 1000]:
        column = StringColumn.from_pylist([str(i) for i in range(rows)])
        assert StringIndex(column).slot_row.shape[0] == ops.table_capacity(rows)


@requires_cuda
def test_index_moves_between_devices():
    vocabulary, query = random_case(3)
    index = StringIndex(StringColumn.from_pylist(vocabulary))
    on_gpu = index.to("cuda")
    codes = on_gpu.lookup(StringColumn.from_pylist(query, device="cuda"))
    assert codes.device.type == "cuda" and codes.tolist() == dict_codes(vocabulary, query)
    back = on_gpu.to("cpu")
    assert back.lookup(StringColumn.from_pylist(query)).tolist() == dict_codes(vocabulary, query)
    with pytest.raises(ValueError, match="query is on cpu"):
        on_gpu.lookup(StringColumn.from_pylist(query))


# -- operator plumbing: opcheck, compile, TorchScript, CUDA graphs --------------------------------


def op_args(device, hash_bits=64):
    vocabulary, query = random_case(11, vocabulary_size=50, query_size=40)
    index = StringIndex(StringColumn.from_pylist(vocabulary, device=device), _hash_bits=hash_bits)
    q = StringColumn.from_pylist(query, device=device)
    v = index.vocabulary
    return index, v, q


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_every_operator(device):
    index, v, q = op_args(device)
    torch.library.opcheck(
        torch.ops.tabserve.string_index_build.default,
        (v.data, v.offsets, v.valid, index.segments, 64),
    )
    torch.library.opcheck(
        torch.ops.tabserve.string_lookup.default,
        (v.data, v.offsets, index.segments, index.slot_hash, index.slot_row, q.data, q.offsets, q.valid, 0, 64, True),
    )
    multi = StringIndex.from_columns([v, v])
    torch.library.opcheck(
        torch.ops.tabserve.string_lookup_multi.default,
        (multi.vocabulary.data, multi.vocabulary.offsets, multi.segments, multi.slot_hash,
         multi.slot_row, [q.data, q.data], [q.offsets, q.offsets], [q.valid, None], 64, True),
    )
    codes = torch.randint(-1, len(q) + 1, (30, 3), generator=torch.Generator().manual_seed(0)).to(device)
    for code_columns in (None, [2, 0]):
        torch.library.opcheck(
            torch.ops.tabserve.dictionary_lookup.default,
            (multi.vocabulary.data, multi.vocabulary.offsets, multi.segments, multi.slot_hash,
             multi.slot_row, [q.data, q.data], [q.offsets, q.offsets], [q.valid, None],
             codes[:, :2] if code_columns is None else codes, code_columns, 64, True),
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size_oblivious", [False, True])
def test_compiled_lookup_has_no_graph_breaks_and_no_recompiles(device, size_oblivious):
    """One graph for every query size >= 2; with backed_size_oblivious (docs/reference/ops.md)
    also for 1-row and empty queries, which Dynamo otherwise specialises."""
    from torch._dynamo.testing import CompileCounter
    from torch.fx.experimental import _config as fx_config

    torch._dynamo.reset()
    counter = CompileCounter()
    vocabulary = [f"label-{i}" for i in range(200)]
    index = StringIndex(StringColumn.from_pylist(vocabulary, device=device))

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def encode(query: StringColumn):
        return index.lookup(query) + 1

    rng = random.Random(0)
    sizes = [3, 17, 64, 5, 250, 2] + ([1, 0] if size_oblivious else [])
    with fx_config.patch(backed_size_oblivious=size_oblivious):
        for size in sizes:
            query = [rng.choice(vocabulary + ["nope", None]) for _ in range(size)]
            codes = encode(StringColumn.from_pylist(query, device=device))
            assert (codes - 1).tolist() == dict_codes(vocabulary, query)
    assert counter.frame_count == 1, "recompiled as the query size changed"


@pytest.mark.parametrize("device", DEVICES)
def test_inductor_compiled_multi_lookup(device):
    torch._dynamo.reset()
    cases = [random_case(900 + c) for c in range(3)]
    index = StringIndex.from_columns([StringColumn.from_pylist(v, device=device) for v, _ in cases])
    compiled = torch.compile(lambda qs: index.lookup_columns(qs) * 2, fullgraph=True)
    codes = compiled([StringColumn.from_pylist(q, device=device) for _, q in cases])
    assert (codes // 2).tolist() == [c for v, q in cases for c in dict_codes(v, q)]


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_dictionary_lookup_one_graph_over_changing_sizes(device):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    index, _, _, _, _ = dictionary_case(12, 4, 1, device)
    compiled = torch.compile(lambda qs, codes: dictionary_lookup(index, qs, codes, [3, 1, 0, 2]) + 1,
                             backend=counter, fullgraph=True, dynamic=True)
    from torch.fx.experimental import _config as fx_config

    rng = random.Random(12)
    for rows in [5, 40, 17, 300]:
        # same structure every batch (a validity mask, >= 2 labels and bytes), sizes differ
        labels = [[rng.choice(["a", "b", "x", "yy"]) for _ in range(rng.randrange(2, 9))] + [None, "ab"]
                  for _ in range(4)]
        queries = [StringColumn.from_pylist(q, device=device) for q in labels]
        codes = torch.randint(-1, 9, (rows, 4), generator=torch.Generator().manual_seed(rows)).to(device)
        want = dictionary_lookup(index, queries, codes, [3, 1, 0, 2])
        with fx_config.patch(use_duck_shape=False):  # sizes equal by chance stay independent
            assert torch.equal(compiled(queries, codes) - 1, want)
    assert counter.frame_count == 1


def test_torchscript_calls_the_operator():
    @torch.jit.script
    def lookup(vd, vo, seg, sh, sr, qd, qo, qv: torch.Tensor):
        return torch.ops.tabserve.string_lookup(vd, vo, seg, sh, sr, qd, qo, qv, 0, 64, True)

    index, v, q = op_args("cpu")
    valid = q.valid if q.valid is not None else torch.ones(len(q), dtype=torch.bool)
    codes = lookup(v.data, v.offsets, index.segments, index.slot_hash, index.slot_row, q.data, q.offsets, valid)
    assert codes.tolist() == index.lookup(q).tolist()


@requires_cuda
def test_lookup_inside_cuda_graph_capture():
    vocabulary, query = random_case(21, vocabulary_size=100, query_size=80)
    index = StringIndex(StringColumn.from_pylist(vocabulary, device="cuda"))
    q = StringColumn.from_pylist(query, device="cuda")
    # raw op with check_offsets=True: its host-synchronising check must be skipped in capture
    run = lambda: ops.string_lookup(index.vocabulary.data, index.vocabulary.offsets, index.segments,
                                    index.slot_hash, index.slot_row, q.data, q.offsets, q.valid)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run()  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        codes = run()
    codes.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    assert codes.tolist() == dict_codes(vocabulary, query)


@requires_cuda
def test_cuda_and_cpu_agree_on_large_random_case():
    vocabulary, query = random_case(77, vocabulary_size=20_000, query_size=30_000, max_length=300)
    cpu = StringIndex(StringColumn.from_pylist(vocabulary)).lookup(StringColumn.from_pylist(query))
    gpu = StringIndex(StringColumn.from_pylist(vocabulary, device="cuda")).lookup(
        StringColumn.from_pylist(query, device="cuda"))
    assert torch.equal(cpu, gpu.cpu())
    assert cpu.tolist() == dict_codes(vocabulary, query)


def labels_of_mean_length(rng, count, mean, distinct=None):
    """``count`` byte labels of random lengths around ``mean`` (odd lengths included, so that
    labels start at every alignment), drawn from ``distinct`` different labels."""
    pool = [
        bytes(rng.integers(0, 256, int(rng.integers(max(0, mean // 2), mean * 3 // 2 + 2)),
                           dtype=np.uint8))
        for _ in range(distinct or count)
    ]
    return [pool[int(i)] for i in rng.integers(0, len(pool), count)]


# Mean label lengths that select each CUDA tile shape (lanes per label, words held in registers),
# and labels longer than the largest shape holds.
TILE_MEANS = [5, 40, 700, 3000, 6000]


@requires_cuda
@pytest.mark.parametrize("mean", TILE_MEANS)
@pytest.mark.parametrize("hash_bits", [64, 4])
def test_cuda_lookup_matches_dict_for_every_tile_shape(mean, hash_bits):
    rng = np.random.default_rng(mean + hash_bits)
    vocabulary = labels_of_mean_length(rng, 300, mean)
    vocabulary[5] = None
    vocabulary[7] = vocabulary[3]  # a duplicate: the last position wins
    # one-byte edits at the first, middle and last byte of fitted labels: unknown queries that
    # share all but one word with a fitted label
    edits = []
    for label in vocabulary[:30]:
        if label:
            for at in (0, len(label) // 2, len(label) - 1):
                edits.append(label[:at] + bytes([label[at] ^ 1]) + label[at + 1:])
    query = [vocabulary[int(i)] for i in rng.integers(0, len(vocabulary), 400)] + edits + [None, b""]
    index = StringIndex(StringColumn.from_pylist(vocabulary, device="cuda"), _hash_bits=hash_bits)
    codes = index.lookup(StringColumn.from_pylist(query, device="cuda"))
    assert codes.tolist() == dict_codes(vocabulary, query)


@requires_cuda
@pytest.mark.parametrize("start", range(8))
@pytest.mark.parametrize("mean", [6, 100, 2000])
def test_cuda_lookup_of_labels_at_the_edges_of_misaligned_tensors(start, mean):
    # Query tensors that are views starting at every byte of an 8-byte word and ending inside
    # one: the first and last labels sit where whole-word loads would leave the tensor.
    rng = np.random.default_rng(start * 10 + mean)
    vocabulary = labels_of_mean_length(rng, 50, mean)
    query = vocabulary[::-1] + labels_of_mean_length(rng, 10, mean)
    dense = StringColumn.from_pylist(query)
    padded = torch.cat([torch.zeros(start, dtype=torch.uint8), dense.data,
                        torch.zeros(3, dtype=torch.uint8)]).cuda()
    data = padded[start:start + dense.data.numel()]
    column = StringColumn(data, dense.offsets.cuda(), dense.valid.cuda())
    index = StringIndex(StringColumn.from_pylist(vocabulary, device="cuda"))
    assert index.lookup(column).tolist() == dict_codes(vocabulary, query)


@requires_cuda
def test_cuda_and_cpu_agree_on_labels_with_fixed_width_numeric_fields():
    # Two 8-digit fields: labels whose words differ by small multiples of each other, where a
    # hash linear in the words gives many labels one value.
    vocabulary = [f"{a:08d}{b:08d}" for a in range(60) for b in range(60)]
    query = vocabulary[::7] + [f"{a:08d}{b:08d}" for a in range(60, 70) for b in range(5)]
    cpu = StringIndex(StringColumn.from_pylist(vocabulary))
    gpu = StringIndex(StringColumn.from_pylist(vocabulary, device="cuda"))
    # the same hash of every label on both devices (the tables may place them differently)
    held = lambda index: sorted(index.slot_hash[index.slot_row >= 0].tolist())  # noqa: E731
    assert held(cpu) == held(gpu.to("cpu"))
    expected = dict_codes(vocabulary, query)
    assert cpu.lookup(StringColumn.from_pylist(query)).tolist() == expected
    assert gpu.lookup(StringColumn.from_pylist(query, device="cuda")).tolist() == expected


# -- bad input to the raw operators ---------------------------------------------------------------


def raw_lookup_args(device="cpu"):
    index, v, q = op_args(device)
    return dict(
        vocabulary_data=v.data, vocabulary_offsets=v.offsets, vocabulary_segments=index.segments,
        slot_hash=index.slot_hash, slot_row=index.slot_row, query_data=q.data,
        query_offsets=q.offsets, query_valid=q.valid,
    )


BAD_LOOKUPS = [
    ("query_data", lambda a: a["query_data"].to(torch.int32), "query_data must be a uint8"),
    ("query_data", lambda a: a["query_data"].reshape(1, -1), "query_data must be 1-D"),
    ("query_offsets", lambda a: a["query_offsets"].to(torch.int32), "query_offsets must be an int64"),
    ("query_offsets", lambda a: a["query_offsets"].reshape(1, -1), "query_offsets must be 1-D"),
    ("query_offsets", lambda a: a["query_offsets"].flip(0), r"query_offsets\[1\].*non-decreasing"),
    ("query_offsets", lambda a: a["query_offsets"] + 10**6, "query_offsets.*within"),
    ("query_valid", lambda a: torch.ones(3, dtype=torch.bool), "query_valid must have shape"),
    ("query_valid", lambda a: torch.ones(len(a["query_offsets"]) - 1), "query_valid must be a bool"),
    ("slot_row", lambda a: a["slot_row"][:-1], "same length"),
    ("slot_hash", lambda a: a["slot_hash"][:8], "same length"),
    ("slot_row", lambda a: a["slot_row"].to(torch.int32), "must be int64"),
    ("vocabulary_segments", lambda a: torch.tensor([0, 1]), "vocabulary_segments must start at 0 and end"),
    ("vocabulary_segments", lambda a: torch.tensor([0.0, 1.0]), "vocabulary_segments must be an int64"),
    ("vocabulary_data", lambda a: a["vocabulary_data"].float(), "vocabulary_data must be a uint8"),
]


@pytest.mark.parametrize("name, corrupt, match", BAD_LOOKUPS)
def test_lookup_rejects_bad_arguments_by_name(name, corrupt, match):
    args = raw_lookup_args()
    args[name] = corrupt(args)
    with pytest.raises(RuntimeError, match=match):
        ops.string_lookup(**args)


def test_lookup_rejects_bad_column_hash_bits_and_column_counts():
    args = raw_lookup_args()
    with pytest.raises(RuntimeError, match="column must be in"):
        ops.string_lookup(**args, column=1)
    with pytest.raises(RuntimeError, match="hash_bits must be in"):
        ops.string_lookup(**args, hash_bits=65)
    with pytest.raises(RuntimeError, match="power-of-two"):
        ops.string_lookup(**{**args, "slot_row": args["slot_row"][:-1], "slot_hash": args["slot_hash"][:-1]})
    with pytest.raises(RuntimeError, match="one entry per vocabulary column"):
        ops.string_lookup_multi(
            args["vocabulary_data"], args["vocabulary_offsets"], args["vocabulary_segments"],
            args["slot_hash"], args["slot_row"], [args["query_data"]] * 2,
            [args["query_offsets"]] * 2, [None, None])


def test_index_build_rejects_bad_vocabularies():
    data = torch.tensor(list(b"abcdef"), dtype=torch.uint8)
    good = dict(vocabulary_data=data, vocabulary_offsets=torch.tensor([0, 2, 6]),
                vocabulary_valid=None, vocabulary_segments=torch.tensor([0, 2]))
    for key, value, match in [
        ("vocabulary_offsets", torch.tensor([0, 4, 2]), "non-decreasing"),
        ("vocabulary_offsets", torch.tensor([0, 2, 7]), "within"),
        ("vocabulary_segments", torch.tensor([0, 3]), "end at the number of vocabulary rows"),
        ("vocabulary_segments", torch.tensor([0, 2, 1, 2]), "non-decreasing"),
        ("vocabulary_valid", torch.ones(3, dtype=torch.bool), "vocabulary_valid must have shape"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            ops.string_index_build(**{**good, key: value})
    with pytest.raises(TypeError, match="vocabulary must be a StringColumn"):
        StringIndex(["a", "b"])
    with pytest.raises(ValueError, match="at least one"):
        StringIndex.from_columns([])


@requires_cuda
def test_cuda_ops_reject_mixed_devices_and_bad_offsets():
    args = raw_lookup_args("cuda")
    with pytest.raises(RuntimeError, match="query_data is on cpu"):
        ops.string_lookup(**{**args, "query_data": args["query_data"].cpu()})
    with pytest.raises(RuntimeError, match="query_offsets is invalid"):
        ops.string_lookup(**{**args, "query_offsets": args["query_offsets"].flip(0)})
    # with the check off, malformed offsets stay memory-safe (no fault, codes still written)
    codes = ops.string_lookup(**{**args, "query_offsets": args["query_offsets"] * 1000}, check_offsets=False)
    torch.cuda.synchronize()
    assert codes.shape[0] == args["query_offsets"].shape[0] - 1


def test_package_exports():
    assert tabserve.StringColumn is StringColumn and tabserve.StringIndex is StringIndex
