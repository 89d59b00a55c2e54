"""Models served by tabserve."""

from .tabicl import TabICLv2

__all__ = ["TabICLv2"]
