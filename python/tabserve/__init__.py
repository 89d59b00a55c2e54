"""tabserve: fast TabICLv2 serving and native string-category preprocessing for PyTorch.

Importing the package loads the compiled operator library (`tabserve._C`), which registers the
`torch.ops.tabserve.*` operators, then their fake kernels (`tabserve.ops`).
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401,E402  (registers torch.ops.tabserve.*)
from . import ops
from .strings import StringColumn, StringIndex
from .tables import CategoricalColumn, Table, mark_dynamic
from .align import AlignCategories, CategoryTypeError
from .encoding import TabICLEncoder, encode_categoricals
from .buckets import Bucket, BucketGrid

__version__ = "0.1.0"

# Heavier parts load on first use, so `import tabserve` stays cheap for preprocessing-only users.
_LAZY = {
    "TabICLv2": "tabserve.models.tabicl",
    "TabICLClassifier": "tabserve.models.tabicl",
    "TabICLRegressor": "tabserve.models.tabicl",
    "ServingOptions": "tabserve.models.tabicl.options",
    "serving_presets": "tabserve.models.tabicl.options",
    "wait_for_compiles": "tabserve.models.tabicl.background",
    "clear_model_cache": "tabserve.models.tabicl.model_cache",
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
