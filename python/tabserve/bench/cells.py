"""Benchmark cells as data: what runs (the reference ``tabicl`` or tabserve) and how.

The default table (:data:`CELLS`) holds the reference baselines and one cell per serving preset,
named after it: what the driver measures is exactly what ``recipe=<preset>`` serves. Research
variants (a preset plus changed options) live in a cells file
(``benchmarks/cells/research.json``, loaded with ``--cells-file``; :func:`load_cells_file`),
outside the default table. :mod:`.engines` turns a cell into callables; nothing else branches on
cell names.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from tabserve.models.tabicl.serving.options import PRESETS, ServingOptions, describe

from .workloads import BENCH_EXTRA

#: Precisions of the reference package's runs (``use_amp``: its own fp16 autocast).
REFERENCE_PRECISIONS = ("fp32", "fp16")
_BOTH = ("cpu", "cuda")


@dataclass(frozen=True)
class Cell:
    """One measured configuration.

    Fields:
        name: stable across runs (results and promotion files refer to it); a preset's cell is
            named after the preset.
        description: one line for the table legend.
        engine: ``"reference"`` (tabicl 2.2.0) or ``"tabserve"``.
        options: tabserve's :class:`ServingOptions` (tabserve cells).
        reference_precision: the reference's precision (reference cells): ``fp32`` or ``fp16``
            (its ``use_amp``).
        preset: the preset this cell serves (default cells) or varies (research cells).
        warm_cache: a server restart: a priming process compiles the workload's bucket and saves
            the compile-cache artifacts (:mod:`tabserve.compile_cache`); the measured process
            starts with empty caches and loads them; its cold call is the restart's ready time.
        aot: with ``warm_cache``: the priming process exports the workload's bucket packages
            (AOTInductor, :mod:`tabserve.models.tabicl.serving.aot`) and the restart loads them.
        devices: device types the cell can run on.
        baseline: a reference cell (speed-ups are quoted against these; never promoted).
    """

    name: str
    description: str
    engine: str = "tabserve"
    options: ServingOptions | None = None
    reference_precision: str | None = None
    preset: str | None = None
    warm_cache: bool = False
    aot: bool = False
    devices: tuple = ("cuda",)
    baseline: bool = False

    def __post_init__(self):
        if self.engine == "reference":
            if self.reference_precision not in REFERENCE_PRECISIONS or self.options is not None:
                raise ValueError(
                    f"{self.name}: a reference cell has a reference_precision in "
                    f"{REFERENCE_PRECISIONS} and no options"
                )
        elif self.engine == "tabserve":
            if not isinstance(self.options, ServingOptions):
                raise ValueError(f"{self.name}: a tabserve cell needs ServingOptions")
        else:
            raise ValueError(f"{self.name}: unknown engine {self.engine!r}")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"{self.name}: unknown preset {self.preset!r}")
        if self.aot and not (self.warm_cache and self.options and self.options.buckets):
            raise ValueError(f"{self.name}: aot packages are a restart (warm_cache) of buckets")
        if self.warm_cache and not (self.options and self.options.compiled or self.aot):
            raise ValueError(f"{self.name}: a restart (warm_cache) restores compiled graphs")

    @property
    def precision(self) -> str:
        return self.reference_precision if self.engine == "reference" else self.options.precision

    @property
    def reduced_precision(self) -> bool:
        return self.precision != "fp32"

    @property
    def buckets(self) -> bool:
        return bool(self.options and self.options.buckets)

    @property
    def uses_fp8(self) -> bool:
        return bool(self.options and self.options.uses_fp8)

    @property
    def promotable_preset(self) -> str | None:
        """The preset ``recipe="auto"`` may serve for this cell: a preset's own cell (named after
        it, its options the preset's, no restart); never a research variant."""
        if self.preset is None or self.name != self.preset or self.warm_cache or self.baseline:
            return None
        return self.preset if PRESETS[self.preset].options == self.options else None

    def to_dict(self) -> dict:
        """The cell as JSON-ready data (:meth:`from_dict` reads it back)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["options"] = self.options.to_dict() if self.options else None
        fields["devices"] = list(self.devices)
        return fields

    @classmethod
    def from_dict(cls, fields: dict) -> Cell:
        options = fields.get("options")
        return cls(
            **{
                **fields,
                "options": ServingOptions.from_dict(options) if options is not None else None,
                "devices": tuple(fields.get("devices", ("cuda",))),
            }
        )


def _preset_cell(name: str, devices: tuple = ("cuda",)) -> Cell:
    preset = PRESETS[name]
    return Cell(name, preset.description, options=preset.options, preset=name, devices=devices)


#: The reference baselines, then one cell per preset.
CELLS: tuple[Cell, ...] = (
    Cell(
        "ref-fp32",
        "tabicl 2.2.0, fp32 (TF32 off)",
        engine="reference",
        reference_precision="fp32",
        devices=_BOTH,
        baseline=True,
    ),
    Cell(
        "ref-fp16",
        "tabicl 2.2.0 with its own fp16 autocast (use_amp)",
        engine="reference",
        reference_precision="fp16",
        baseline=True,
    ),
    _preset_cell("exact", devices=_BOTH),
    *(_preset_cell(name) for name in PRESETS if name != "exact"),
)

#: The fp32 cells a run's gates compare against, best first.
FP32_CELLS = ("ref-fp32", "exact")
#: The research cells shipped with the repository.
RESEARCH_CELLS_FILE = Path("benchmarks") / "cells" / "research.json"


def cell_from_entry(entry: dict) -> Cell:
    """A research cell from a cells-file entry: ``{"name", "preset", "changes": {field: value},
    "description", "warm_cache", "aot", "devices"}`` (only ``name`` and ``preset`` required).
    Raises ValueError naming the entry for unknown keys, presets or option fields."""
    known = {"name", "preset", "changes", "description", "warm_cache", "aot", "devices"}
    if not isinstance(entry, dict) or not {"name", "preset"} <= set(entry):
        raise ValueError(f"cells file: an entry needs 'name' and 'preset', got {entry!r}")
    name = entry["name"]
    if set(entry) - known:
        raise ValueError(f"cells file: {name}: unknown keys {sorted(set(entry) - known)}")
    if entry["preset"] not in PRESETS:
        raise ValueError(f"cells file: {name}: unknown preset {entry['preset']!r}")
    try:
        options = PRESETS[entry["preset"]].options.replace(**entry.get("changes", {}))
    except (TypeError, ValueError) as e:
        raise ValueError(f"cells file: {name}: {e}") from None
    if options == PRESETS[entry["preset"]].options and not entry.get("warm_cache"):
        raise ValueError(
            f"cells file: {name}: no changes to {entry['preset']!r}: the preset's own cell "
            f"measures that"
        )
    return Cell(
        name,
        entry.get("description") or f"{entry['preset']} with {describe(options)}",
        options=options,
        preset=entry["preset"],
        warm_cache=bool(entry.get("warm_cache", False)),
        aot=bool(entry.get("aot", False)),
        devices=tuple(entry.get("devices", ("cuda",))),
    )


def load_cells_file(path: Path | str) -> list[Cell]:
    """The cells of a cells file (``{"cells": [entry, ...]}``, :func:`cell_from_entry`)."""
    document = json.loads(Path(path).read_text())
    entries = document.get("cells") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: a cells file is {{\"cells\": [...]}}")
    cells = [cell_from_entry(entry) for entry in entries]
    names = [c.name for c in cells]
    clashes = sorted({n for n in names if names.count(n) > 1 or n in {c.name for c in CELLS}})
    if clashes:
        raise ValueError(f"{path}: cell names used twice or by a default cell: {clashes}")
    return cells


def cell_table(extra: list | tuple = ()) -> list[Cell]:
    """The default cells followed by ``extra`` (a cells file's)."""
    return [*CELLS, *extra]


def cell_by_name(name: str, table: list | tuple = CELLS) -> Cell:
    """The cell called ``name`` in ``table``. Raises KeyError listing the known names."""
    for cell in table:
        if cell.name == name:
            return cell
    raise KeyError(f"unknown cell {name!r}; known: {', '.join(c.name for c in table)}")


def select_cells(patterns: list | None, table: list | tuple = CELLS) -> list:
    """Cells of ``table`` whose name matches any shell-style pattern (all of them when
    ``patterns`` is empty), in the order of the patterns, each once: a run cut by its deadline
    reaches the cells named first."""
    from fnmatch import fnmatch

    if not patterns:
        return list(table)
    chosen, unknown = [], []
    for pattern in patterns:
        matches = [c for c in table if fnmatch(c.name, pattern) or c.name == pattern]
        if not matches:
            unknown.append(pattern)
        chosen += [c for c in matches if c not in chosen]
    if unknown:
        raise KeyError(f"no cell matches {unknown}; known: {', '.join(c.name for c in table)}")
    return chosen


def skip_reason(cell: Cell, device_type: str) -> str | None:
    """Why ``cell`` cannot run on ``device_type`` here, or None when it can."""
    if device_type not in cell.devices:
        return (
            "skipped: no CUDA device"
            if device_type == "cpu"
            else f"skipped: {device_type} not supported"
        )
    if cell.engine == "reference" and importlib.util.find_spec("tabicl") is None:
        return f"skipped: tabicl is not installed ({BENCH_EXTRA})"
    return None
