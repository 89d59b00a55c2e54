"""TabICLv2 architecture configuration: the ``config`` dict of a reference checkpoint, validated.

A reference ``.ckpt`` stores the keyword arguments of ``tabicl.TabICL``. We read every key and
refuse anything that is not the v2 architecture instead of silently falling back to a constructor
default (the 2.2.0 default of ``row_rope_interleaved`` is the v1 flavour).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A checkpoint config that is missing keys, contradictory, or not TabICLv2."""


#: Keys whose value is fixed for TabICLv2: accepted spellings of the v2 value.
V2_FIXED = {
    "col_affine": (False,),
    "col_feature_group": ("same", True),
    "col_target_aware": (True,),
    "col_ssmax": ("qassmax-mlp-elementwise", True),
    "icl_ssmax": ("qassmax-mlp-elementwise", True),
    "row_rope_interleaved": (False,),
    "activation": ("gelu",),
    "norm_first": (True,),
}
#: Keys that only matter for training; accepted with any value and ignored.
TRAINING_ONLY = {"dropout": 0.0, "zero_init": False, "recompute": False}


@dataclass(frozen=True)
class TabICLv2Config:
    """Size parameters of a TabICLv2 model (names as in the reference constructor).

    ``max_classes == 0`` means a regressor with ``num_quantiles`` outputs.
    """

    max_classes: int = 10
    num_quantiles: int = 999
    embed_dim: int = 128
    col_num_blocks: int = 3
    col_nhead: int = 8
    col_num_inds: int = 128
    col_feature_group_size: int = 3
    row_num_blocks: int = 3
    row_nhead: int = 8
    row_num_cls: int = 4
    row_rope_base: float = 100000.0
    icl_num_blocks: int = 12
    icl_nhead: int = 8
    ff_factor: int = 2
    bias_free_ln: bool = False

    @property
    def is_regression(self) -> bool:
        return self.max_classes == 0

    @property
    def icl_dim(self) -> int:
        return self.embed_dim * self.row_num_cls

    @property
    def out_dim(self) -> int:
        return self.num_quantiles if self.is_regression else self.max_classes

    def to_reference_dict(self) -> dict[str, Any]:
        """The full keyword set of ``tabicl.TabICL`` for this model (as a v2 checkpoint stores it)."""
        out = dataclasses.asdict(self)
        out.update({key: values[0] for key, values in V2_FIXED.items()})
        out.update(TRAINING_ONLY)
        return out

    @classmethod
    def from_reference_dict(cls, config: Mapping[str, Any]) -> TabICLv2Config:
        """Validate a checkpoint ``config`` dict.

        Raises:
            ConfigError: not a mapping, unknown or missing keys, wrong types, a TabICLv1 / v1.1
                config (interleaved RoPE, affine column head, no feature grouping ...), or
                inconsistent sizes.
        """
        if not isinstance(config, Mapping):
            raise ConfigError(f"checkpoint config must be a dict, got {type(config).__name__}")
        size_keys = {f.name: f.type for f in dataclasses.fields(cls)}
        known = set(size_keys) | set(V2_FIXED) | set(TRAINING_ONLY)
        unknown = sorted(set(config) - known)
        if unknown:
            raise ConfigError(
                f"unknown checkpoint config keys {unknown}; this is not a TabICL 2.x config"
            )
        missing = sorted((set(size_keys) | set(V2_FIXED)) - set(config))
        if missing:
            raise ConfigError(
                f"checkpoint config lacks {missing}; refusing to guess (the reference constructor defaults "
                "differ between TabICLv1 and v2, e.g. row_rope_interleaved)"
            )
        not_v2 = {
            k: config[k] for k, ok in V2_FIXED.items() if not any(_same(config[k], v) for v in ok)
        }
        if not_v2:
            raise ConfigError(
                f"not a TabICLv2 checkpoint: {not_v2} (v2 has { ({k: V2_FIXED[k][0] for k in not_v2}) }); "
                "TabICLv1 / v1.1 checkpoints are not supported by tabserve"
            )
        values = {}
        for key, kind in size_keys.items():
            values[key] = _typed(key, config[key], kind)
        result = cls(**values)
        result._check_sizes()
        return result

    def _check_sizes(self) -> None:
        positive = [
            f.name
            for f in dataclasses.fields(self)
            if f.name not in ("max_classes", "bias_free_ln")
        ]
        bad = [k for k in positive if not getattr(self, k) > 0]
        if bad or self.max_classes < 0:
            raise ConfigError(f"config values must be positive: {bad or ['max_classes']}")
        for dim, heads in (
            (self.embed_dim, self.col_nhead),
            (self.embed_dim, self.row_nhead),
            (self.icl_dim, self.icl_nhead),
        ):
            if dim % heads:
                raise ConfigError(f"dimension {dim} is not divisible by {heads} heads")
        if (self.embed_dim // self.row_nhead) % 2:
            raise ConfigError("row head dimension must be even for RoPE")
        if self.col_feature_group_size != 3:
            raise ConfigError(
                f"col_feature_group_size must be 3 for TabICLv2, got {self.col_feature_group_size}"
            )


def _same(value: Any, expected: Any) -> bool:
    return type(value) is type(expected) and value == expected


def _typed(key: str, value: Any, kind: Any) -> Any:
    kind = {"int": int, "float": float, "bool": bool}.get(kind, kind)
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key {key!r} must be a bool, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config key {key!r} must be a number, got {value!r}")
    if kind is int and value != int(value):
        raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")
    return kind(value)
