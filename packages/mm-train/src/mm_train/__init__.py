"""Recipes, CLI and trainer for multimodal training on MindSpore.

    mm-train run                                  # the built-in tiny default
    mm-train run recipe.yaml --set parallel.tp=2 --nproc 2

Python: ``mm_train.recipe.load_recipe(path_or_name, overrides)`` and ``mm_train.loop.train(recipe)``;
model families register in ``mm_train.registry`` (the built-in ones live in ``mm_train.families``).
"""

from mm_train.__about__ import __version__

__all__ = ["__version__"]
