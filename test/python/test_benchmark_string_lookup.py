"""The string-lookup benchmark (benchmarks/string_lookup.py), the timing harness it measures with
(tabserve.bench.timing) and its PyTorch peer.

CPU only and fast: the benchmark runs one tiny case in-process; torch_peer is checked against a
Python dict on seeded random cases.
"""

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import harness  # noqa: E402
import string_lookup  # noqa: E402
import torch_peer  # noqa: E402
from tabserve import StringColumn  # noqa: E402
from tabserve.bench import timing  # noqa: E402

TINY_CASE = "random-L8-V100-Q1k"


def dict_codes(vocabulary, query):
    reference = {label: code for code, label in enumerate(vocabulary) if label is not None}
    return [-1 if label is None else reference.get(label, -1) for label in query]


# -- the benchmark CLI --------------------------------------------------------------------------


def test_quick_run_writes_checked_json(tmp_path, capsys):
    out = tmp_path / "results.json"
    argv = ["--quick", "--cases", TINY_CASE, "--device", "cpu", "--budget", "0.01"]
    status = string_lookup.main(argv + ["--out", str(out), "--quiet"])
    assert status == 0, capsys.readouterr().out
    result = json.loads(out.read_text())

    assert {"environment", "benchmark", "device", "cases", "targets", "failures"} <= set(result)
    assert {"torch", "cuda", "gpu", "pyarrow", "pandas"} <= set(result["environment"])
    assert result["failures"] == []
    (record,) = result["cases"]
    assert record["case"]["name"] == TINY_CASE
    ran = {name: r for name, r in record["methods"].items() if "skipped" not in r}
    assert {"tabserve cpu", "pyarrow index_in", "pandas get_indexer", "torch_peer cpu"} <= set(ran)
    for name, method in ran.items():
        assert method["check"] == {"ok": True, "mismatches": 0, "first": None}, name
        lookup = method["lookup"]
        assert 0 < lookup["p20_ms"] <= lookup["median_ms"] <= lookup["p80_ms"], name
        assert lookup["repeats"] >= 5 and lookup["peak_extra_bytes"] >= 0, name
    assert record["methods"]["tabserve cpu"]["build"]["median_ms"] > 0
    if not torch.cuda.is_available():
        assert record["methods"]["tabserve cuda"] == {"skipped": "no CUDA device"}
    assert "String lookup, median ms" in capsys.readouterr().out


@pytest.mark.parametrize("pattern", sorted(string_lookup.PATTERNS))
def test_generated_vocabularies_are_distinct_and_queries_mixed(pattern):
    case = string_lookup.Case("t", 64, 300, 500, pattern, unknown=0.2, null=0.1, columns=2)
    data = string_lookup.generate(case)
    for column in data.columns:
        vocabulary = column.vocabulary.to_pylist()
        assert len(set(vocabulary)) == len(vocabulary) == 300
        if pattern == "nonascii":
            assert all(label.decode("utf-8") for label in vocabulary)
        expected = column.expected
        assert (expected >= 0).mean() > 0.5 and (expected == -1).any()
        assert expected.tolist() == dict_codes(vocabulary, column.query.to_pylist())


def test_cases_table_matches_the_seed_sweep():
    assert len(string_lookup.CASES) == 63
    assert len({c.name for c in string_lookup.CASES}) == 63
    largest = max(string_lookup.CASES, key=lambda c: c.data_bytes)
    assert (largest.label_bytes, largest.vocabulary, largest.query) == (4096, 200_000, 100_000)
    assert all(any(c.name == t[1] for c in string_lookup.CASES) for t in string_lookup.TARGETS)


# -- the timing harness -----------------------------------------------------------------------


def test_percentile_interpolates():
    assert timing.percentile([1.0], 20) == 1.0
    assert timing.percentile([0.0, 10.0], 20) == pytest.approx(2.0)
    assert timing.percentile([3.0, 1.0, 2.0], 50) == 2.0


def test_benchmarks_write_under_the_untracked_results_folder_by_default():
    assert harness.default_json("rotary-cpu") == Path("tabserve-results") / "rotary-cpu.json"
    assert string_lookup.parse_args([]).out == str(Path("tabserve-results") / "string_lookup.json")


def test_measure_cpu_reports_time_and_memory():
    m = timing.measure(lambda: np.ones(1 << 20), "cpu", min_repeats=3, budget_s=0.01)
    assert m.repeats >= 3 and m.p20_ms <= m.median_ms <= m.p80_ms
    assert m.memory_method in ("rss", "tracemalloc")
    assert m.memory_probes["tracemalloc"] >= 8 << 20  # numpy allocates through tracemalloc


# -- torch_peer against a Python dict ----------------------------------------------------------


def random_label(rng: random.Random, prefix: str):
    roll = rng.random()
    if roll < 0.1:
        return None
    if roll < 0.15:
        return ""
    length = rng.choice([1, 3, 7, 8, 9, 15, 16, 63, 64, 65, 200])
    body = "".join(rng.choice("ab\u00e9\x00\u4e2d") for _ in range(length))
    return prefix + body if rng.random() < 0.5 else body


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("hash_bits", [64, 8])
def test_peer_matches_dict(seed, hash_bits):
    """Duplicates, nulls, "", non-ASCII, NUL bytes, long shared prefixes, labels around the
    8-byte word and slot boundaries; 8 hash bits force collisions that bytes must resolve."""
    rng = random.Random(seed)
    prefix = "p" * rng.choice([0, 60, 500])
    for _ in range(4):
        distinct = 16 if hash_bits < 64 else 60  # some seed separates 16 labels in 8 bits
        pool = list({random_label(rng, prefix) for _ in range(distinct)})
        vocabulary = [rng.choice(pool) for _ in range(rng.randint(0, 40))]  # duplicates
        query = [rng.choice(pool) for _ in range(50)] + [random_label(rng, prefix)]
        index = torch_peer.fit(StringColumn.from_pylist(vocabulary), hash_bits=hash_bits)
        expected = dict_codes(vocabulary, query)
        for block_bytes in (-1, 8, None):  # default blocks, a block per slot, one block
            codes = torch_peer.lookup(index, StringColumn.from_pylist(query), block_bytes)
            assert codes.tolist() == expected, (vocabulary, query, block_bytes)


def test_peer_sliced_query_and_empty_inputs():
    vocabulary = StringColumn.from_pylist(["x", "yy", "", None, "x"])
    index = torch_peer.fit(vocabulary)
    full = StringColumn.from_pylist(["skip", "x", "", "yy", "zz"])
    sliced = StringColumn(full.data, full.offsets[1:], None)  # offsets not starting at 0
    assert torch_peer.lookup(index, sliced).tolist() == [4, 2, 1, -1]
    assert torch_peer.lookup(index, StringColumn.from_pylist([])).tolist() == []
    empty = torch_peer.fit(StringColumn.from_pylist([]))
    assert torch_peer.lookup(empty, StringColumn.from_pylist(["x", "", None])).tolist() == [-1] * 3


def test_peer_hash_does_not_depend_on_slot_width():
    column = StringColumn.from_pylist(["a" * n for n in range(0, 150, 7)])
    starts, lengths = column.offsets[:-1], column.offsets[1:] - column.offsets[:-1]
    hashes = [
        torch_peer.hash_rows(column.data, starts, lengths, 0, int(lengths.sum()), width)
        for width in (8, 16, 32, 64)
    ]
    assert all(torch.equal(hashes[0], h) for h in hashes[1:])
    assert hashes[0].unique().numel() == len(column)


def test_peer_compiled_fullgraph_matches_eager():
    vocabulary = StringColumn.from_pylist(["abc", "de", "x" * 100, None, "abc", ""])
    query = StringColumn.from_pylist(["abc", "zz", "x" * 100, None, "de", "", "x" * 99])
    index = torch_peer.fit(vocabulary)
    compiled = torch.compile(torch_peer.lookup, fullgraph=True, options=torch_peer.COMPILE_OPTIONS)
    assert compiled(index, query).tolist() == torch_peer.lookup(index, query).tolist()
    assert compiled(index, query).tolist() == [4, -1, 2, -1, 1, 5, -1]
