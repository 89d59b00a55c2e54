"""tabserve: fast TabICLv2 serving and native string-category preprocessing for PyTorch.

Importing the package loads the compiled operator library (`tabserve._C`), which registers the
`torch.ops.tabserve.*` operators, then their fake kernels (`tabserve.ops`).
"""

import torch  # noqa: F401  (loads libtorch before the extension)

__version__ = "0.1.0"


def _check_torch_version() -> None:
    """The compiled operators link to the C++ ABI of the torch they were built against
    (``_build_info``, written by setup.py): another torch release fails to load them, or worse."""
    try:
        from ._build_info import TORCH_VERSION
    except ImportError:  # a source tree that was never built: _C's import says so
        return
    built, running = TORCH_VERSION.split("+")[0], torch.__version__.split("+")[0]
    if built != running:
        raise ImportError(
            f"tabserve's extension was built against torch {TORCH_VERSION}, but this process has "
            f"torch {torch.__version__}; rebuild it (pip install --no-build-isolation .) or "
            f"install torch {built}"
        )


_check_torch_version()

from . import (
    _C,  # noqa: F401,E402  (registers torch.ops.tabserve.*)
    ops,
)
from .align import AlignCategories, CategoryTypeError
from .buckets import Bucket, BucketGrid
from .encoding import TabICLEncoder, encode_categoricals
from .strings import StringColumn, StringIndex
from .tables import CategoricalColumn, Table, mark_dynamic

# Heavier parts load on first use, so `import tabserve` stays cheap for preprocessing-only users.
_LAZY = {
    "TabICLv2": "tabserve.models.tabicl",
    "TabICLClassifier": "tabserve.models.tabicl",
    "TabICLRegressor": "tabserve.models.tabicl",
    "InferenceConfig": "tabserve.models.tabicl",
    "ServingOptions": "tabserve.models.tabicl.serving.options",
    "serving_presets": "tabserve.models.tabicl.serving.options",
    "wait_for_compiles": "tabserve.models.tabicl.serving.background",
    "clear_model_cache": "tabserve.models.tabicl.serving.model_cache",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tabserve' has no attribute {name!r}")


__all__ = [
    "StringColumn",
    "StringIndex",
    "CategoricalColumn",
    "Table",
    "mark_dynamic",
    "AlignCategories",
    "CategoryTypeError",
    "TabICLEncoder",
    "encode_categoricals",
    "Bucket",
    "BucketGrid",
    "ops",
    *_LAZY,
]
