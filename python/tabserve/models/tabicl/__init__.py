"""TabICLv2 in tabserve: the network by stage, checkpoints, KV cache and sklearn-style estimators.

Stages (mirroring the paper): :mod:`.embedding` (column-wise set transformer), :mod:`.interaction`
(row-wise transformer with RoPE and CLS tokens), :mod:`.learning` (in-context learning, heads,
class hierarchy), shared blocks in :mod:`.layers`.
"""

from .checkpoint import CheckpointError, load_checkpoint, save_safetensors
from .config import ConfigError, TabICLv2Config
from .model import TabICLv2, TabICLv2Cache
from .quantiles import quantile_stats

_ESTIMATORS = ("TabICLClassifier", "TabICLRegressor")


def __getattr__(name):
    # The estimators need scikit-learn; the network itself does not.
    if name in _ESTIMATORS:
        from . import estimators

        return getattr(estimators, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "ConfigError",
    "TabICLClassifier",
    "TabICLRegressor",
    "TabICLv2",
    "TabICLv2Cache",
    "TabICLv2Config",
    "load_checkpoint",
    "quantile_stats",
    "save_safetensors",
]
