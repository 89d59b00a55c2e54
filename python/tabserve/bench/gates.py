"""Accuracy gates and promotion.

Every cell's outputs on a workload's fixed seeded input are compared with the fp32 cell's (the
reference ``ref-fp32`` when it ran, else tabserve's ``exact``): classification by the largest
probability difference and the share of rows whose argmax agrees, regression by the largest
difference of the predicted mean relative to the RMS of the reference means. Limits depend on the
cell's precision (:data:`LIMITS`); padded outputs of bucketed cells must match their unpadded
outputs to fp32 round-off in fp32 eager, and to the options' own rounding under the cell's
options (``padded_recipe``). A cell that fails, or that could not be checked, is never promoted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from tabserve.models.tabicl.serving.options import WITHOUT_FP8

from .cells import FP32_CELLS, Cell


@dataclass(frozen=True)
class Limits:
    max_prob_diff: float
    min_argmax_agreement: float
    max_mean_rel_error: float


LIMITS = {
    # fp32 against fp32: kernel order only (argmax may flip on exact near-ties).
    "fp32": Limits(max_prob_diff=1e-4, min_argmax_agreement=0.999, max_mean_rel_error=1e-4),
    # TF32 / bf16 / fp16 / fp8 against fp32: the reduced-precision gate.
    "reduced": Limits(max_prob_diff=2e-2, min_argmax_agreement=0.995, max_mean_rel_error=2e-2),
    # Padded against unpadded, fp32 eager: padding must change nothing.
    "padded": Limits(max_prob_diff=1e-6, min_argmax_agreement=1.0, max_mean_rel_error=1e-6),
    # Padded against unpadded under the cell's own options (its kernels, compiled and captured
    # graphs against the same kernels eager): in fp32 only compiled kernels' summation order
    # differs; in reduced precision the GEMMs of other row counts round differently, so the
    # limit is a quarter of the reduced-precision gate's, which a wrongly masked key or row
    # (a probability off by far more) cannot pass.
    "padded_recipe_fp32": Limits(
        max_prob_diff=1e-5, min_argmax_agreement=0.999, max_mean_rel_error=1e-5
    ),
    "padded_recipe_reduced": Limits(
        max_prob_diff=5e-3, min_argmax_agreement=0.995, max_mean_rel_error=5e-3
    ),
}


def compare(task: str, output: torch.Tensor, reference: torch.Tensor) -> dict:
    """Accuracy figures of ``output`` against ``reference`` (same shape)."""
    if output.shape != reference.shape:
        return {"shape_mismatch": [list(output.shape), list(reference.shape)]}
    output, reference = output.double(), reference.double()
    if task == "reg":
        rms = reference.pow(2).mean().sqrt().clamp_min(1e-12)
        return {"mean_rel_error": float((output - reference).abs().max() / rms)}
    agree = (output.argmax(-1) == reference.argmax(-1)).double().mean()
    return {
        "max_prob_diff": float((output - reference).abs().max()),
        "argmax_agreement": float(agree),
    }


def check(figures: dict, limits: Limits) -> list:
    """Names of the limits ``figures`` break (empty: passed)."""
    if "shape_mismatch" in figures:
        return ["shape"]
    failures = []
    if figures.get("max_prob_diff", 0.0) > limits.max_prob_diff:
        failures.append(f"max_prob_diff > {limits.max_prob_diff:g}")
    if figures.get("argmax_agreement", 1.0) < limits.min_argmax_agreement:
        failures.append(f"argmax_agreement < {limits.min_argmax_agreement:g}")
    if figures.get("mean_rel_error", 0.0) > limits.max_mean_rel_error:
        failures.append(f"mean_rel_error > {limits.max_mean_rel_error:g}")
    return failures


def gate(
    cell: Cell, task: str, outputs: dict, reference_name: str | None, reference: dict | None
) -> dict:
    """Gate of one cell on one workload.

    ``outputs`` / ``reference`` map a route (``one_shot``, ``kv``, and ``padded`` /
    ``unpadded`` for bucketed cells) to gate tensors. Returns ``{"passed": True | False | None,
    "reference": name, "limits": ..., <route>: {figures..., "failures": [...]}}``; ``passed`` is
    None when there was nothing to compare against.
    """
    if reference is None or not outputs:
        return {"passed": None, "reference": reference_name, "note": "no fp32 outputs to compare"}
    if cell.name == reference_name:
        return {"passed": True, "reference": reference_name, "note": "is the fp32 reference"}
    limits = LIMITS["reduced" if cell.reduced_precision else "fp32"]
    verdict: dict = {"reference": reference_name, "limits": asdict(limits)}
    # Cached predictions are checked against the reference's one-shot predictions.
    for route in ("one_shot", "kv"):
        if route in outputs and "one_shot" in reference:
            figures = compare(task, outputs[route], reference["one_shot"])
            verdict[route] = {**figures, "failures": check(figures, limits)}
    if "padded" in outputs and "unpadded" in outputs:
        figures = compare(task, outputs["padded"], outputs["unpadded"])
        verdict["padded"] = {**figures, "failures": check(figures, LIMITS["padded"])}
    if "padded_recipe" in outputs and "unpadded_recipe" in outputs:
        figures = compare(task, outputs["padded_recipe"], outputs["unpadded_recipe"])
        padded_limits = LIMITS[
            "padded_recipe_reduced" if cell.reduced_precision else "padded_recipe_fp32"
        ]
        verdict["padded_recipe"] = {**figures, "failures": check(figures, padded_limits)}
    routes = [v for k, v in verdict.items() if isinstance(v, dict) and "failures" in v]
    verdict["passed"] = all(not r["failures"] for r in routes) if routes else None
    return verdict


def apply_gates(results: list, cells: dict, workloads: dict, load_outputs) -> None:
    """Adds ``gate`` to every result that ran, per workload, in place.

    ``load_outputs(result)`` returns the result's saved gate tensors (a dict) or None.
    """
    for name, workload in workloads.items():
        ran = {r["cell"]: r for r in results if r["workload"] == name and r.get("outputs")}
        reference_name = next(
            (c for c in FP32_CELLS if c in ran and ran[c]["status"] == "ok"), None
        )
        reference = load_outputs(ran[reference_name]) if reference_name else None
        for cell_name, result in ran.items():
            outputs = load_outputs(result) or {}
            result["gate"] = gate(
                cells[cell_name], workload.task, outputs, reference_name, reference
            )
            failed = result.get("padding_gates", {}).get("error")
            if failed is not None:  # a padding gate that could not run is a failed gate
                message = result["padding_gates"].get("message", "")[:200]
                result["gate"]["padding_gates"] = {"failures": [f"{failed}: {message}"]}
                result["gate"]["passed"] = False


# ---------------------------------------------------------------------------------------------
# Promotion

#: Routes a preset can be promoted for: (result phase, figure).
ROUTES = {
    "one_shot": ("one_shot", "median_ms"),
    "kv_predict": ("kv", "median_ms"),
    "stream": ("stream", "median_ms"),
}


def latency(result: dict, route: str) -> float | None:
    phase, figure = ROUTES[route]
    value = result.get(phase, {})
    return value.get(figure) if isinstance(value, dict) else None


def promotable(result: dict, cell: Cell) -> bool:
    """Ran (measured, not gate-only), passed its gate and serves a preset exactly
    (:attr:`Cell.promotable_preset`: research variants and restarts are never promoted, nor
    baselines)."""
    return (
        result.get("status") == "ok"
        and cell.promotable_preset is not None
        and not result.get("gate_only")
        and result.get("gate", {}).get("passed") is True
    )


def promote(results: list, cells: dict) -> dict:
    """Per workload and route, the fastest promotable cell's preset:
    ``{workload: {route: {"preset", "median_ms"}}}``; where that preset computes in fp8, also
    the fastest without, under ``route + WITHOUT_FP8`` (if any passed)."""
    promoted: dict = {}
    for result in results:
        cell = cells[result["cell"]]
        if not promotable(result, cell):
            continue
        for route in ROUTES:
            ms = latency(result, route)
            if ms is None:
                continue
            keys = (route,) if cell.uses_fp8 else (route, route + WITHOUT_FP8)
            for key in keys:
                best = promoted.setdefault(result["workload"], {}).get(key)
                if best is None or ms < best["median_ms"]:
                    promoted[result["workload"]][key] = {
                        "preset": cell.promotable_preset,
                        "median_ms": ms,
                    }
    for routes in promoted.values():
        for route in ROUTES:
            fastest, plain = routes.get(route), routes.get(route + WITHOUT_FP8)
            if fastest is not None and plain is not None and plain["preset"] == fastest["preset"]:
                del routes[route + WITHOUT_FP8]  # the same cell: said once
    return promoted
