"""Where a fresh process's first answer spends its time, phase by phase, with a cProfile of the
first fit and the first predict.

    python scripts/device/first_answer.py --checkpoint clf.ckpt --out DIR [--kind small]

Phases, each timed from the previous one's end: importing torch, the CUDA context (one tensor on
the device), importing scikit-learn, then tabserve's estimators, building the table, the first fit,
the first predict, then a second fit + predict of the same shape. Writes
``DIR/phases_LABEL.json``, the 40 heaviest functions (cumulative time) of the first fit and of the
first predict to ``DIR/profile_LABEL.txt`` and their whole profiles to
``DIR/LABEL_first_fit.prof`` and ``DIR/LABEL_first_predict.prof`` (``python -m pstats``). Run it
twice over the same caches to see a restarted process.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse
import cProfile
import functools
import io
import json
import pstats
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kind", default="small")
    parser.add_argument("--label", default="cold")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    phases = {}
    mark = [STARTED]

    def lap(name):
        now = time.perf_counter()
        phases[name] = round((now - mark[0]) * 1e3, 1)
        mark[0] = now

    import torch

    lap("import_torch")

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    torch.zeros(1, device=args.device)
    sync()
    lap("device_context")
    import sklearn.base  # noqa: F401  (scikit-learn's own share of the estimators' import)

    lap("import_sklearn")
    from tabserve.models.tabicl import TabICLClassifier, TabICLRegressor

    lap("import_estimators")
    from tabserve.bench.estimator_kinds import kind_by_name, make_table

    kind = kind_by_name(args.kind)
    table = make_table(kind)
    lap("table")
    cls = TabICLRegressor if kind.task == "reg" else TabICLClassifier
    text = io.StringIO()

    def step(name: str, profiled: bool, call) -> None:
        profile = cProfile.Profile() if profiled else None
        if profile:
            profile.enable()
        call()
        sync()
        if profile:
            profile.disable()
            profile.dump_stats(args.out / f"{args.label}_{name}.prof")
            text.write(f"==== {name}\n")
            pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
        lap(name)

    for round_ in ("first", "second"):
        estimator = cls(model_path=args.checkpoint, device=args.device)
        first = round_ == "first"
        step(
            f"{round_}_fit",
            first,
            functools.partial(estimator.fit, table["X_train"], table["y_train"]),
        )
        step(f"{round_}_predict", first, functools.partial(estimator.predict, table["X_test"]))
    phases["total_to_first_answer"] = round(
        sum(v for k, v in phases.items() if not k.startswith("second")), 1
    )
    (args.out / f"phases_{args.label}.json").write_text(json.dumps(phases, indent=1))
    (args.out / f"profile_{args.label}.txt").write_text(text.getvalue())
    print(args.label, json.dumps(phases))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
