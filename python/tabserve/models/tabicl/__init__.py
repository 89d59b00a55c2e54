"""TabICLv2 in tabserve, in three layers that import only downward (see
docs/reference/architecture.md):

* :mod:`.sklearn`: ``TabICLClassifier`` / ``TabICLRegressor``, their preprocessing and tabicl's
  reference arguments;
* :mod:`.serving`: serving options and presets, the served model, background compiles,
  ahead-of-time packages, the process-wide model cache;
* :mod:`.network`: the network by stage (:mod:`.network.embedding`,
  :mod:`.network.interaction`, :mod:`.network.learning`, shared blocks in
  :mod:`.network.layers`), its config, checkpoints and quantile head.

The names below stay importable from here; the estimators load on first use (they need
scikit-learn, the network does not).
"""

from .network.checkpoint import CheckpointError, load_checkpoint, save_safetensors
from .network.config import ConfigError, TabICLv2Config
from .network.model import TabICLv2, TabICLv2Cache
from .network.quantiles import quantile_stats

_ESTIMATORS = ("TabICLClassifier", "TabICLRegressor")


def __getattr__(name):
    # The estimators need scikit-learn; the network itself does not.
    if name in _ESTIMATORS:
        from .sklearn import estimators

        return getattr(estimators, name)
    if name == "InferenceConfig":  # tabicl's, for code that imports it beside the estimators
        from .sklearn.reference_args import InferenceConfig

        return InferenceConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "ConfigError",
    "InferenceConfig",
    "TabICLClassifier",
    "TabICLRegressor",
    "TabICLv2",
    "TabICLv2Cache",
    "TabICLv2Config",
    "load_checkpoint",
    "quantile_stats",
    "save_safetensors",
]
