"""The estimator suite's engines: the scikit-learn estimators it times, as data.

``tabicl`` 2.2.0 with its defaults (its own ``use_amp="auto"``), ``tabicl`` in fp32
(``use_amp=False, use_fa3=False``) and tabserve's estimators with each recipe
(``tabserve-<recipe>``), all with :data:`N_ESTIMATORS` members and the same checkpoint.
"""

from __future__ import annotations

#: Members per estimator, every engine.
N_ESTIMATORS = 8
#: The tabicl engines (their names are also the speed-up baselines).
TABICL = "tabicl"
TABICL_FP32 = "tabicl-fp32"
BASELINES = (TABICL, TABICL_FP32)
TABSERVE_PREFIX = "tabserve-"
DEFAULT_RECIPES = ("exact", "auto")


def engine_names(recipes) -> list:
    """The engines of a run: the two tabicl ones, then tabserve with each recipe."""
    return [TABICL, TABICL_FP32, *(f"{TABSERVE_PREFIX}{r}" for r in recipes)]


def estimator_spec(engine: str, task: str, checkpoint, device: str, kv_cache: bool = False) -> dict:
    """``{"family", "class", "params"}`` of ``engine``'s estimator (JSON-friendly).

    ``family`` is ``"tabicl"`` or ``"tabserve"`` (the package whose estimator ``class``,
    ``TabICLClassifier`` or ``TabICLRegressor`` by ``task`` ``"clf"`` / ``"reg"``, is built with
    ``params``). Raises ValueError for an engine that is neither a tabicl one nor
    ``tabserve-<recipe>``.
    """
    name = "TabICLRegressor" if task == "reg" else "TabICLClassifier"
    params = {
        "n_estimators": N_ESTIMATORS,
        "model_path": str(checkpoint),
        "device": device,
        "kv_cache": bool(kv_cache),
    }
    if engine in BASELINES:
        params["allow_auto_download"] = False
        if engine == TABICL_FP32:
            params.update(use_amp=False, use_fa3=False)
        return {"family": "tabicl", "class": name, "params": params}
    if not engine.startswith(TABSERVE_PREFIX):
        raise ValueError(f"unknown engine {engine!r}")
    params["recipe"] = engine[len(TABSERVE_PREFIX) :]
    return {"family": "tabserve", "class": name, "params": params}
