"""The regression guard (benchmarks/guard.py): figures read from the committed records, verdicts
against a tolerance, and the exit status of a judged run. Nothing here runs a benchmark."""

import copy
import json
import shutil
import sys
from pathlib import Path

import pytest
from tabserve.bench import estimator_suite

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import guard  # noqa: E402
from record import DRIVER_SCHEMA, ROOT  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def headline(name):
    return next(h for h in guard.HEADLINES if h.name == name)


def load(name):
    return json.loads((RESULTS / name).read_text())


@pytest.mark.parametrize(
    "record, read, example",
    [
        ("string_lookup_h200.json", guard.lookup_figures, "random-L4096-V200k-Q100k / tabserve cuda"),
        ("align_categories_h200.json", guard.align_figures, "credit-g / tabserve eager"),
        ("h200.json", guard.driver_figures, "small / medium one-shot"),
        ("estimator_suite_h200.json", guard.suite_figures, "mixed / tabserve-auto warm"),
    ],
)
def test_figures_are_read_from_every_kind_of_record(record, read, example):
    figures = read(load(record))
    median, p20, p80 = figures[example]
    assert p20 <= median <= p80


def test_every_headline_figure_is_in_the_h200_records():
    for h in guard.HEADLINES:
        figures = h.figures(load(h.record.format(device="h200")))
        assert set(h.required) <= set(figures), h.name


def verdict_of(h, name, new, recorded):
    return next(v for v in guard.judge(h, {name: new}, {name: recorded}) if v.figure == name)


def test_judge_uses_the_floor_or_the_spreads_whichever_is_larger():
    h = headline("string_lookup")
    name = h.required[0]
    recorded = (1.0, 0.99, 1.01)
    # spreads 2% + 2%: the 10% floor decides
    assert verdict_of(h, name, (1.09, 1.08, 1.10), recorded).state == "ok"
    assert verdict_of(h, name, (1.11, 1.10, 1.12), recorded).state == "REGRESSED"
    assert verdict_of(h, name, (0.85, 0.84, 0.86), recorded).state == "faster"
    # a noisy new run (p20-p80 a quarter of its median) needs a larger change to fail
    noisy = verdict_of(h, name, (1.2, 1.0, 1.3), recorded)
    assert noisy.state == "ok" and noisy.tolerance == pytest.approx(0.02 + 0.25)


def test_judge_reports_missing_headline_figures_and_figures_without_a_record():
    h = headline("string_lookup")
    new = {name: (1.0, 1.0, 1.0) for name in h.required[1:]}
    new["new-case / tabserve cuda"] = (1.0, 1.0, 1.0)
    new["random-L8-V200k-Q100k / pyarrow index_in"] = (5.0, 5.0, 5.0)  # not judged
    recorded = {name: (1.0, 1.0, 1.0) for name in h.required}
    states = {v.figure: v.state for v in guard.judge(h, new, recorded)}
    assert states[h.required[0]] == "MISSING"
    assert states["new-case / tabserve cuda"] == "no record"
    assert "random-L8-V200k-Q100k / pyarrow index_in" not in states


def make_run(tmp_path, slower=None):
    """A guard output folder holding the committed H200 records as the new run, with the figures
    of `slower` (string-lookup case names) made 1.5x slower."""
    run = tmp_path / "run"
    run.mkdir()
    lookup = load("string_lookup_h200.json")
    for case in lookup["cases"]:
        if case["case"]["name"] in (slower or ()):
            for result in case["methods"].values():
                for key in ("median_ms", "p20_ms", "p80_ms"):
                    if "lookup" in result:
                        result["lookup"][key] *= 1.5
    (run / "string_lookup.json").write_text(json.dumps(lookup))
    shutil.copy(RESULTS / "align_categories_h200.json", run / "align_categories.json")
    for h in guard.HEADLINES:
        if h.output_schema == DRIVER_SCHEMA:
            (run / h.name).mkdir()
            shutil.copy(RESULTS / "h200.json", run / h.name / "tabiclv2_h200.json")
    publish_suite(load("estimator_suite_h200.json"), run / "estimator_suite")
    return run


def publish_suite(document, folder):
    """Writes a suite record where the suite's own ``--out`` writes it."""
    folder.mkdir(parents=True)
    estimator_suite._publish(document, folder, lambda *a: None)


def test_the_suite_headline_reads_what_the_suite_writes(tmp_path):
    h = headline("estimator_suite")
    document = load("estimator_suite_h200.json")
    publish_suite(document, tmp_path / "same" / h.name)
    verdicts, problems = guard.compare([h], tmp_path / "same", "h200", RESULTS)
    assert not problems and {v.figure for v in verdicts} >= set(h.required)
    assert {v.state for v in verdicts if v.figure in h.required} == {"ok"}
    for result in document["results"]:
        if result.get("warm"):
            for key in ("median_ms", "p20_ms", "p80_ms"):
                result["warm"][key] *= 1.5
    publish_suite(document, tmp_path / "slower" / h.name)
    verdicts, problems = guard.compare([h], tmp_path / "slower", "h200", RESULTS)
    assert not problems
    assert {v.state for v in verdicts if v.figure in h.required} == {"REGRESSED"}


def test_compare_of_an_unchanged_run_passes(tmp_path, capsys):
    assert guard.main(["--compare", str(make_run(tmp_path)), "--device", "h200", "--full"]) == 0
    assert "guard passed" in capsys.readouterr().out


def test_compare_of_a_slower_run_fails_loudly(tmp_path, capsys):
    run = make_run(tmp_path, slower={"random-L4096-V200k-Q100k"})
    assert guard.main(["--compare", str(run), "--device", "h200"]) == 1
    out = capsys.readouterr().out
    assert "!!! GUARD FAILED" in out
    assert "random-L4096-V200k-Q100k / tabserve cuda" in out and "!!! REGRESSED" in out


def test_failed_command_and_missing_record_fail_the_guard(tmp_path):
    run = make_run(tmp_path)
    h = headline("align_categories")
    runs = {h.name: {"returncode": 1, "seconds": 1.0, "log": "align.log"}}
    verdicts, problems = guard.compare([h], run, "h200", RESULTS, runs)
    assert problems == ["align_categories: exit 1 (log: align.log)"]
    verdicts, problems = guard.compare([h], run, "no-such-gpu", RESULTS)
    assert problems and "no record" in problems[0]


def test_missing_run_output_makes_every_headline_figure_missing(tmp_path):
    h = headline("estimator_suite")
    verdicts, _ = guard.compare([h], tmp_path, "h200", RESULTS)
    assert [v.state for v in verdicts] == ["MISSING"] * len(h.required)


def test_select_by_name_beginning_and_full():
    names = lambda hs: [h.name for h in hs]  # noqa: E731
    assert "presets_small_compiled" not in names(guard.select(None, full=False))
    assert "presets_small_compiled" in names(guard.select(None, full=True))
    assert names(guard.select(["presets"], full=False)) == ["presets_small", "presets_medium"]
    with pytest.raises(SystemExit):
        guard.select(["nothing"], full=False)


def test_list_prints_every_command(capsys):
    assert guard.main(["--list", "--full"]) == 0
    out = capsys.readouterr().out
    assert all(h.name in out for h in guard.HEADLINES)


def test_headline_commands_name_their_output():
    for h in guard.HEADLINES:
        assert h.command.count("{out}") == 1, h.name
        copy.deepcopy(h)  # plain data
