"""String-category lookup benchmark: tabserve against Arrow, pandas and a pure-PyTorch peer.

Every case is a fitted vocabulary (or four) and a query column (or four), generated with
vectorised numpy. Per case, side by side in one run:

    tabserve        StringIndex.lookup / lookup_columns on CPU; on CUDA eager and inside
                    torch.compile(fullgraph=True)
    pyarrow         pyarrow.compute.index_in (CPU; builds its hash table on every call)
    pandas          pandas.Index.get_indexer on object arrays of bytes (CPU; the conversion of
                    Arrow data to Python objects is done once, outside the timing)
    torch_peer      the seed's pure-PyTorch approach (benchmarks/torch_peer.py), eager and
                    compiled, on CUDA and (for small cases) on CPU

plus the index build (tabserve CPU / CUDA, torch_peer fit). Every method's codes are checked
against a Python dict over the vocabulary; a mismatch is printed loudly and recorded in the JSON,
and the command exits with status 1.

Vocabularies are duplicate-free, so the first-wins rule of index_in and pandas' refusal of
duplicates do not matter here (tabserve and torch_peer keep the last duplicate; the tests cover
that). Codes: position in the vocabulary, -1 for unknown and null queries.

Usage:
    python benchmarks/string_lookup.py --quick                  # about a minute on CPU
    python benchmarks/string_lookup.py --out results.json       # the full sweep
    python benchmarks/string_lookup.py --cases 'random-*' --device cpu
    python benchmarks/string_lookup.py --list
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import torch_peer  # noqa: E402
from tabserve import StringColumn, StringIndex, ops  # noqa: E402
from tabserve.bench.timing import format_mib, format_ms, measure  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Label patterns: how bytes are filled and where the label's unique id is written


def _printable(rng: np.random.Generator, size: int) -> np.ndarray:
    return (np.frombuffer(rng.bytes(size), dtype=np.uint8) & 0x3F) + 0x30


def _fill_random(rng, lengths, offsets) -> np.ndarray:
    return _printable(rng, int(offsets[-1]))


def _fill_template(rng, lengths, offsets) -> np.ndarray:
    """Every label starts with the same bytes (one template), so labels share long prefixes."""
    template = _printable(rng, int(lengths.max(initial=0)))
    return template[_position_in_row(lengths, offsets)]


def _fill_two_byte(rng, lengths, offsets) -> np.ndarray:
    """Random 2-byte UTF-8 characters (U+0080 to U+07FF); lengths are even."""
    pairs = int(offsets[-1]) // 2
    random = np.frombuffer(rng.bytes(2 * pairs), dtype=np.uint8).reshape(pairs, 2)
    out = np.empty((pairs, 2), dtype=np.uint8)
    out[:, 0] = 0xC2 + random[:, 0] % 30
    out[:, 1] = 0x80 + (random[:, 1] & 0x3F)
    return out.reshape(-1)


def _position_in_row(lengths: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    if lengths.size and (lengths == lengths[0]).all():  # fixed length: a tiled range is cheaper
        return np.tile(np.arange(lengths[0], dtype=np.int64), lengths.size)
    return np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[:-1], lengths)


@dataclass(frozen=True)
class IdEncoding:
    """How a label's id is written: ``digits`` digits of ``base`` values, ``width`` bytes each."""

    base: int
    digits: int
    width: int
    encode: Callable[[np.ndarray], list]  # digit values -> list of ``width`` byte arrays

    @property
    def bytes(self) -> int:
        return self.digits * self.width


ASCII_ID = IdEncoding(base=64, digits=4, width=1, encode=lambda d: [0x30 + d])
TWO_BYTE_ID = IdEncoding(
    base=30 * 64, digits=2, width=2, encode=lambda d: [0xC2 + d // 64, 0x80 + d % 64]
)


@dataclass(frozen=True)
class Pattern:
    fill: Callable
    id_encoding: IdEncoding
    id_offset: Callable[[np.ndarray, int], np.ndarray]  # (lengths, id bytes) -> byte offset
    mixed_lengths: bool = False


PATTERNS = {
    "random": Pattern(_fill_random, ASCII_ID, lambda lengths, size: 0 * lengths),
    "prefix": Pattern(_fill_template, ASCII_ID, lambda lengths, size: lengths - size),
    "middle": Pattern(_fill_template, ASCII_ID, lambda lengths, size: (lengths - size) // 2),
    "nonascii": Pattern(
        _fill_two_byte, TWO_BYTE_ID, lambda lengths, size: ((lengths - size) // 4) * 2
    ),
    "mixed": Pattern(_fill_random, ASCII_ID, lambda lengths, size: 0 * lengths, True),
}


# ---------------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Case:
    """One workload. ``label_bytes`` is every label's length (the maximum for mixed lengths)."""

    name: str
    label_bytes: int
    vocabulary: int
    query: int
    pattern: str = "random"
    unknown: float = 0.05
    null: float = 0.01
    columns: int = 1
    quick: bool = False

    @property
    def data_bytes(self) -> int:
        return self.columns * self.label_bytes * (self.vocabulary + self.query)


def _count(n: int) -> str:
    return f"{n // 1000}k" if n >= 1000 else str(n)


def _case(pattern: str, label_bytes: int, vocabulary: int, query: int, **kw) -> Case:
    prefix = kw.pop("prefix", pattern)
    name = f"{prefix}-L{label_bytes}-V{_count(vocabulary)}-Q{_count(query)}"
    return Case(name, label_bytes, vocabulary, query, pattern, **kw)


LABEL_BYTES = (8, 64, 512, 4096)
QUERY_ROWS = (1_000, 100_000)
CASES: list[Case] = [
    # 24: the plain grid of label length x vocabulary size x query rows
    *(
        _case("random", length, vocabulary, query)
        for length in LABEL_BYTES
        for vocabulary in (100, 10_000, 200_000)
        for query in QUERY_ROWS
    ),
    # 24: labels sharing all but their last bytes, or differing only in the middle
    *(
        _case(pattern, length, vocabulary, query)
        for pattern in ("prefix", "middle")
        for length in (64, 512, 4096)
        for vocabulary in (10_000, 200_000)
        for query in QUERY_ROWS
    ),
    # 4: non-ASCII (2-byte UTF-8) labels
    *(_case("nonascii", length, 10_000, query) for length in (64, 4096) for query in QUERY_ROWS),
    # 4: half the queries unknown (they differ from a fitted label only in their id bytes)
    *(
        _case("random", length, 200_000, 100_000, unknown=0.5, prefix="unknown50")
        for length in (8, 64, 512, 4096)
    ),
    # 3: label lengths uniform in [4, label_bytes]
    *(_case("mixed", length, 10_000, 100_000) for length in (16, 256, 4096)),
    # 4: four columns looked up in one call
    *(
        _case("random", length, vocabulary, 100_000, columns=4, prefix="cols4")
        for length, vocabulary in ((16, 100), (16, 10_000), (64, 200_000), (512, 10_000))
    ),
]
#: --quick: small cases covering one column and four, short and long labels, nulls and unknowns.
QUICK = {
    "random-L8-V100-Q1k",
    "random-L64-V10k-Q100k",
    "middle-L512-V10k-Q1k",
    "nonascii-L64-V10k-Q1k",
    "cols4-L16-V100-Q100k",
}
CASES = [replace(c, quick=c.name in QUICK) for c in CASES]


# ---------------------------------------------------------------------------------------------
# Data generation (vectorised numpy) and the dict reference


@dataclass
class ColumnData:
    vocabulary: pa.Array  # large_binary
    query: pa.Array
    expected: np.ndarray  # int64 codes from a Python dict
    vocabulary_objects: list
    query_objects: np.ndarray  # object array of bytes / None


@dataclass
class CaseData:
    case: Case
    columns: list[ColumnData]
    _on_device: dict = field(default_factory=dict)

    @property
    def expected(self) -> np.ndarray:
        return np.concatenate([c.expected for c in self.columns])

    def on(self, device: torch.device) -> tuple[list[StringColumn], list[StringColumn]]:
        """(vocabularies, queries) as StringColumns on ``device`` (moved once, then cached)."""
        if device not in self._on_device:
            host = [
                (StringColumn.from_arrow(c.vocabulary), StringColumn.from_arrow(c.query))
                for c in self.columns
            ]
            self._on_device[device] = (
                [v.to(device) for v, _ in host],
                [q.to(device) for _, q in host],
            )
        return self._on_device[device]


def _arrow(data: np.ndarray, offsets: np.ndarray, valid: Optional[np.ndarray]) -> pa.Array:
    bitmap = None if valid is None else pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(
        pa.large_binary(),
        len(offsets) - 1,
        [bitmap, pa.py_buffer(offsets.astype(np.int64)), pa.py_buffer(data)],
    )


def _write_ids(data, row_starts, id_offsets, ids, encoding: IdEncoding) -> None:
    positions = row_starts + id_offsets
    for digit in range(encoding.digits):
        values = (ids // encoding.base**digit) % encoding.base
        for byte, column in enumerate(encoding.encode(values)):
            data[positions + digit * encoding.width + byte] = column


def _rows(data: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, rows: np.ndarray):
    """(data, offsets) of the given rows, gathered."""
    out_lengths = lengths[rows]
    out_offsets = np.concatenate([[0], np.cumsum(out_lengths)])
    if lengths.size and (lengths == lengths[0]).all():
        return data.reshape(-1, lengths[0])[rows].reshape(-1), out_offsets
    index = np.repeat(offsets[:-1][rows] - out_offsets[:-1], out_lengths)
    return data[index + np.arange(int(out_offsets[-1]))], out_offsets


def generate_column(case: Case, rng: np.random.Generator) -> ColumnData:
    """One vocabulary of distinct labels and a query column drawn from it (plus unknowns and
    nulls), with the dict reference codes."""
    pattern = PATTERNS[case.pattern]
    encoding = pattern.id_encoding
    if case.label_bytes < encoding.bytes or case.vocabulary + case.query > encoding.base**encoding.digits:
        raise ValueError(f"{case.name}: labels too short or too many for unique ids")
    if pattern.mixed_lengths:
        lengths = rng.integers(encoding.bytes, case.label_bytes + 1, case.vocabulary)
        lengths += lengths % encoding.width
    else:
        lengths = np.full(case.vocabulary, case.label_bytes, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    data = pattern.fill(rng, lengths, offsets)
    id_offsets = pattern.id_offset(lengths, encoding.bytes)
    _write_ids(data, offsets[:-1], id_offsets, np.arange(case.vocabulary), encoding)

    source = rng.integers(0, case.vocabulary, case.query)
    query_data, query_offsets = _rows(data, offsets, lengths, source)
    # Unknown rows get an id no fitted label has, at the same place: they differ in a few bytes.
    unknown = rng.random(case.query) < case.unknown
    ids = np.where(unknown, case.vocabulary + np.arange(case.query), source)
    _write_ids(query_data, query_offsets[:-1], id_offsets[source], ids, encoding)
    valid = rng.random(case.query) >= case.null

    vocabulary = _arrow(data, offsets, None)
    query = _arrow(query_data, query_offsets, None if valid.all() else valid)
    vocabulary_objects = vocabulary.to_pylist()
    query_objects = np.empty(case.query, dtype=object)
    query_objects[:] = query.to_pylist()
    reference = {label: code for code, label in enumerate(vocabulary_objects)}
    expected = np.fromiter(
        (reference.get(label, -1) for label in query_objects), dtype=np.int64, count=case.query
    )
    return ColumnData(vocabulary, query, expected, vocabulary_objects, query_objects)


def generate(case: Case, seed: int = 0) -> CaseData:
    rng = np.random.default_rng([seed, case.label_bytes, case.vocabulary, case.query])
    return CaseData(case, [generate_column(case, rng) for _ in range(case.columns)])


# ---------------------------------------------------------------------------------------------
# Methods: each prepares, for a case, a lookup callable (and optionally a build callable)


@dataclass
class Prepared:
    lookup: Callable[[], object]
    build: Optional[Callable[[], object]] = None


@dataclass(frozen=True)
class Method:
    name: str
    device: str  # "cpu" or "cuda"
    prepare: Callable[[CaseData, torch.device], Prepared]
    max_data_bytes: Optional[int] = None  # larger cases are skipped (too slow to be a peer)
    by_default: bool = True  # False: runs only when --methods names it
    timed_build: bool = False


def _tabserve_lookup(vocabulary, segments, slot_hash, slot_row, hash_bits, queries):
    """The raw operator call of StringIndex.lookup / lookup_columns, with every tensor an input,
    so one compiled graph serves every case."""
    tables = (vocabulary.data, vocabulary.offsets, segments, slot_hash, slot_row)
    if len(queries) == 1:
        query = queries[0]
        return ops.string_lookup(
            *tables, query.data, query.offsets, query.valid, 0, hash_bits, check_offsets=False
        )
    return ops.string_lookup_multi(
        *tables,
        [q.data for q in queries],
        [q.offsets for q in queries],
        [q.valid for q in queries],
        hash_bits,
        check_offsets=False,
    )


def _peer_lookup(indexes, queries):
    if len(queries) == 1:
        return torch_peer.lookup(indexes[0], queries[0])
    return torch_peer.lookup_columns(indexes, queries)


_COMPILED: dict = {}


def _compiled(fn, options=None):
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, fullgraph=True, options=options)
    return _COMPILED[fn]


def _tabserve(compiled: bool):
    def prepare(data: CaseData, device: torch.device) -> Prepared:
        vocabularies, queries = data.on(device)

        def build():
            if len(vocabularies) == 1:
                return StringIndex(vocabularies[0])
            return StringIndex.from_columns(vocabularies)

        index = build()
        if compiled:
            fn = _compiled(_tabserve_lookup)
            args = (index.vocabulary, index.segments, index.slot_hash, index.slot_row)
            return Prepared(lambda: fn(*args, index.hash_bits, queries))
        if len(queries) == 1:
            return Prepared(lambda: index.lookup(queries[0]), build)
        return Prepared(lambda: index.lookup_columns(queries), build)

    return prepare


def _peer(compiled: bool):
    def prepare(data: CaseData, device: torch.device) -> Prepared:
        vocabularies, queries = data.on(device)
        build = lambda: torch_peer.fit_columns(vocabularies)  # noqa: E731
        indexes = build()
        fn = _compiled(_peer_lookup, torch_peer.COMPILE_OPTIONS) if compiled else _peer_lookup
        return Prepared(lambda: fn(indexes, queries), None if compiled else build)

    return prepare


def _pyarrow(data: CaseData, device: torch.device) -> Prepared:
    pairs = [(c.query, c.vocabulary) for c in data.columns]

    def lookup():
        return [pc.index_in(q, value_set=v).fill_null(-1) for q, v in pairs]

    return Prepared(lookup)


def _pandas(data: CaseData, device: torch.device) -> Prepared:
    pairs = [
        (pd.Index(c.vocabulary_objects, dtype=object), c.query_objects) for c in data.columns
    ]
    return Prepared(lambda: [index.get_indexer(query) for index, query in pairs])


PEER_CPU_MAX_BYTES = 64 << 20
METHODS = [
    Method("tabserve cpu", "cpu", _tabserve(compiled=False), timed_build=True),
    Method("tabserve cuda", "cuda", _tabserve(compiled=False), timed_build=True),
    Method("tabserve cuda compiled", "cuda", _tabserve(compiled=True)),
    Method("pyarrow index_in", "cpu", _pyarrow),
    Method("pandas get_indexer", "cpu", _pandas),
    Method("torch_peer cuda", "cuda", _peer(compiled=False), timed_build=True),
    Method("torch_peer cuda compiled", "cuda", _peer(compiled=True)),
    Method("torch_peer cpu", "cpu", _peer(compiled=False), max_data_bytes=PEER_CPU_MAX_BYTES),
    # Inductor's C++ compile costs 15-30 s per shape class on a CPU, which tripled the sweep's
    # time on the H200 host: it runs only when --methods names it.
    Method(
        "torch_peer cpu compiled",
        "cpu",
        _peer(compiled=True),
        max_data_bytes=PEER_CPU_MAX_BYTES,
        by_default=False,
    ),
]


# ---------------------------------------------------------------------------------------------
# Running


def _codes(result) -> np.ndarray:
    parts = result if isinstance(result, list) else [result]
    arrays = [p.cpu().numpy() if isinstance(p, torch.Tensor) else np.asarray(p) for p in parts]
    return np.concatenate(arrays).astype(np.int64)


def check(result, expected: np.ndarray) -> dict:
    """Compares codes with the dict reference: {"ok", "mismatches", "first"}."""
    codes = _codes(result)
    if codes.shape != expected.shape:
        return {"ok": False, "mismatches": -1, "first": f"shape {codes.shape} != {expected.shape}"}
    wrong = np.flatnonzero(codes != expected)
    first = None
    if wrong.size:
        i = int(wrong[0])
        first = f"row {i}: got {int(codes[i])}, expected {int(expected[i])}"
    return {"ok": wrong.size == 0, "mismatches": int(wrong.size), "first": first}


def skip_reason(method: Method, case: Case, args) -> Optional[str]:
    if method.device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    if method.device == "cuda" and args.device == "cpu":
        return "--device cpu"
    if not method.by_default and not args.methods:
        return "runs only when --methods names it"
    if method.max_data_bytes is not None and case.data_bytes > method.max_data_bytes:
        return f"case above {method.max_data_bytes >> 20} MiB of labels"
    return None


def run_case(case: Case, methods: list[Method], args) -> dict:
    start = time.perf_counter()
    data = generate(case, args.seed)
    expected = data.expected
    record = {
        "case": case.__dict__,
        "generate_s": round(time.perf_counter() - start, 3),
        "methods": {},
    }
    for method in methods:
        reason = skip_reason(method, case, args)
        if reason is not None:
            record["methods"][method.name] = {"skipped": reason}
            continue
        device = torch.device(method.device)
        try:
            prepared = method.prepare(data, device)
            result = {"check": check(prepared.lookup(), expected)}
            result["lookup"] = measure(prepared.lookup, device, **args.timing).as_dict()
            if method.timed_build and prepared.build is not None:
                result["build"] = measure(
                    prepared.build, device, memory=False, **args.build_timing
                ).as_dict()
        except Exception as error:  # a failing method is reported, the sweep goes on
            result = {"error": f"{type(error).__name__}: {error}"}
        record["methods"][method.name] = result
        if device.type == "cuda":
            torch.cuda.empty_cache()
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


def print_case(record: dict) -> None:
    rows = []
    for name, result in record["methods"].items():
        if "skipped" in result:
            continue
        if "error" in result:
            rows.append([name, "ERROR", "", "", "", "", result["error"][:60]])
            continue
        lookup, build = result["lookup"], result.get("build")
        verdict = "ok" if result["check"]["ok"] else f"MISMATCH x{result['check']['mismatches']}"
        rows.append(
            [
                name,
                format_ms(lookup["median_ms"]),
                format_ms(lookup["p20_ms"]),
                format_ms(lookup["p80_ms"]),
                f"{format_mib(lookup['peak_extra_bytes'])} ({lookup['memory_method']})",
                format_ms(build["median_ms"]) if build else "-",
                verdict,
            ]
        )
    harness.print_table(
        f"{record['case']['name']}  ({record['seconds']} s)",
        ["method", ">median ms", ">p20", ">p80", ">peak extra MiB", ">build ms", "codes"],
        rows,
    )
    for name, result in record["methods"].items():
        if "check" in result and not result["check"]["ok"]:
            print(f"!!! MISMATCH: {name} on {record['case']['name']}: {result['check']}")
        if "error" in result:
            print(f"!!! ERROR: {name} on {record['case']['name']}: {result['error']}")


SUMMARY_COLUMNS = [  # (header, method, what)
    ("ts cpu", "tabserve cpu", "lookup"),
    ("ts cuda", "tabserve cuda", "lookup"),
    ("ts cmp", "tabserve cuda compiled", "lookup"),
    ("arrow", "pyarrow index_in", "lookup"),
    ("pandas", "pandas get_indexer", "lookup"),
    ("peer cuda", "torch_peer cuda", "lookup"),
    ("peer cmp", "torch_peer cuda compiled", "lookup"),
    ("peer cpu", "torch_peer cpu", "lookup"),
    ("peer cpu cmp", "torch_peer cpu compiled", "lookup"),
    ("build cpu", "tabserve cpu", "build"),
    ("build cuda", "tabserve cuda", "build"),
]


def _cell(record: dict, method: str, what: str) -> str:
    result = record["methods"].get(method, {})
    if "error" in result:
        return "ERR"
    if "check" in result and not result["check"]["ok"]:
        return "WRONG"
    return format_ms(result.get(what, {}).get("median_ms"))


def _peak_cell(record: dict, methods: tuple[str, ...]) -> str:
    for method in methods:
        lookup = record["methods"].get(method, {}).get("lookup")
        if lookup:
            return format_mib(lookup["peak_extra_bytes"])
    return "-"


def print_summary(records: list[dict]) -> None:
    present = [
        (header, method, what)
        for header, method, what in SUMMARY_COLUMNS
        if any(what in r["methods"].get(method, {}) for r in records)
    ]
    rows = [
        [r["case"]["name"]]
        + [_cell(r, method, what) for _, method, what in present]
        + [_peak_cell(r, ("tabserve cuda", "tabserve cpu"))]
        for r in records
    ]
    harness.print_table(
        "String lookup, median ms (build: index build; ts MiB: tabserve peak extra memory)",
        ["case"] + [">" + header for header, _, _ in present] + [">ts MiB"],
        rows,
    )


TARGETS = [  # (claim, case, method, metric, limit) checked against the run's medians
    ("lookup <= 0.3 ms", "random-L4096-V200k-Q100k", "tabserve cuda", "median_ms", 0.3),
    ("lookup <= 16 MB extra", "random-L4096-V200k-Q100k", "tabserve cuda", "peak_extra_bytes", 16e6),
    ("build <= 20 ms", "random-L4096-V200k-Q100k", "tabserve cuda", "build_ms", 20.0),
]
FASTER_THAN = [  # (method, must beat) in every case where both ran
    ("tabserve cuda", "torch_peer cuda"),
    ("tabserve cuda compiled", "torch_peer cuda compiled"),
    ("tabserve cpu", "pyarrow index_in"),
]


def _metric(result: dict, metric: str):
    if metric == "build_ms":
        return result.get("build", {}).get("median_ms")
    return result.get("lookup", {}).get(metric)


def evaluate_targets(records: list[dict]) -> list[dict]:
    """Target verdicts: 'met', 'MISSED' or 'not run'."""
    by_name = {r["case"]["name"]: r for r in records}
    verdicts = []
    for claim, case, method, metric, limit in TARGETS:
        value = _metric(by_name.get(case, {}).get("methods", {}).get(method, {}), metric)
        state = "not run" if value is None else "met" if value <= limit else "MISSED"
        verdicts.append({"target": f"{claim} ({method}, {case})", "value": value, "state": state})
    for fast, slow in FASTER_THAN:
        pairs = [
            (r["case"]["name"], _metric(r["methods"].get(fast, {}), "median_ms"),
             _metric(r["methods"].get(slow, {}), "median_ms"))
            for r in records
        ]
        pairs = [(n, a, b) for n, a, b in pairs if a is not None and b is not None]
        losses = [n for n, a, b in pairs if a >= b]
        state = "not run" if not pairs else "met" if not losses else "MISSED"
        ratios = [b / a for _, a, b in pairs if a > 0]
        verdicts.append(
            {
                "target": f"{fast} faster than {slow} in every case ({len(pairs)} ran)",
                "value": f"min speed-up {min(ratios):.2f}x" if ratios else None,
                "state": state,
                "losses": losses,
            }
        )
    return verdicts


def print_targets(verdicts: list[dict]) -> None:
    rows = []
    for v in verdicts:
        value = v["value"]
        if isinstance(value, float):
            value = f"{value / 1e6:.1f} MB" if value > 1000 else f"{value:.3f} ms"
        losses = v.get("losses") or []
        note = f" lost: {', '.join(losses[:3])}{' ...' if len(losses) > 3 else ''}" if losses else ""
        rows.append([v["state"], v["target"], f"{value if value is not None else '-'}{note}"])
    harness.print_table("Targets", ["state", "target", "value"], rows)


def select_cases(args) -> list[Case]:
    cases = [c for c in CASES if c.quick] if args.quick else list(CASES)
    if args.cases:
        cases = [c for c in CASES if any(fnmatch.fnmatch(c.name, p) for p in args.cases)]
        if not cases:
            raise SystemExit(f"no case matches {args.cases}; see --list")
    return cases


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few small cases (about a minute)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cuda: every method; cpu: CPU methods only; auto: cuda if present")
    parser.add_argument("--cases", nargs="+", metavar="NAME", help="case names or glob patterns")
    parser.add_argument("--methods", nargs="+", metavar="NAME",
                        help="method names or glob patterns (default: all)")
    parser.add_argument(
        "--out", default=str(harness.default_json("string_lookup")), help="JSON path"
    )
    parser.add_argument("--seed", type=int, default=0, help="data generation seed")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds of timed repeats per cell (default 0.1)")
    parser.add_argument("--quiet", action="store_true", help="no per-case tables")
    parser.add_argument("--list", action="store_true", help="list cases and methods, then exit")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    budget = args.budget if args.budget is not None else 0.1
    # Calls slower than 0.2 s (CPU baselines on the largest cases) get 3 timed repeats.
    args.timing = {"budget_s": budget, "min_repeats": 5, "max_repeats": 200, "slow_s": 0.2}
    args.build_timing = {
        "budget_s": budget / 2, "min_repeats": 3, "max_repeats": 20, "slow_s": 0.2
    }
    return args


def _payload(records: list[dict], args, start: float, complete: bool) -> dict:
    return {
        "benchmark": "string_lookup",
        "command": " ".join(sys.argv),
        "device": args.device,
        "total_s": round(time.perf_counter() - start, 1),
        "complete": complete,
        "cases": records,
        "targets": evaluate_targets(records),
        "failures": [
            f"{name} on {r['case']['name']}"
            for r in records
            for name, result in r["methods"].items()
            if "error" in result or ("check" in result and not result["check"]["ok"])
        ],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for c in CASES:
            print(f"{c.name:28s} {c.data_bytes / 1e6:10.1f} MB{'  (quick)' if c.quick else ''}")
        print("methods:", ", ".join(m.name for m in METHODS))
        return 0
    # Every case after the first runs on one dynamic-shape graph per method and column count;
    # the limit only stops Dynamo from silently falling back to eager after 8 graphs.
    torch._dynamo.config.recompile_limit = 64
    cases = select_cases(args)
    methods = [
        m for m in METHODS
        if not args.methods or any(fnmatch.fnmatch(m.name, p) for p in args.methods)
    ]
    print(f"string lookup benchmark: {len(cases)} cases, device {args.device}", flush=True)
    start = time.perf_counter()
    records = []
    payload = _payload(records, args, start, complete=False)
    for case in cases:
        record = run_case(case, methods, args)
        records.append(record)
        if not args.quiet:
            print_case(record)
        else:
            print(f"{case.name}: {record['seconds']} s", flush=True)
        # Written after every case, so that a run stopped by a time limit keeps what it measured.
        payload = _payload(records, args, start, complete=len(records) == len(cases))
        harness.write_json(args.out, payload)
    verdicts, failures = payload["targets"], payload["failures"]
    print()
    print_summary(records)
    print_targets(verdicts)
    print(f"{len(cases)} cases in {payload['total_s']} s; JSON: {args.out}")
    if failures:
        print(f"!!! {len(failures)} FAILURES (wrong codes or errors): {', '.join(failures[:10])}")
        return 1
    print("codes: every method matched the dict reference in every case it ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
