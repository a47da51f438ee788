"""Recipes, CLI, trainer, checkpoints and launcher for multimodal training on MindSpore.

Skeleton only: the implementation arrives with issue 9; nothing here works yet.
"""

from mm_train.__about__ import __version__

__all__ = ["__version__"]
