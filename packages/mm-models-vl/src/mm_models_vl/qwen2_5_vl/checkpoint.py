"""Qwen2.5-VL checkpoint names: transformers folders in, transformers folders out.

Parameter paths are transformers 5's module names (``model.language_model.*``, ``model.visual.*``).
On disk transformers 5.24 still writes the layout of the released Qwen2.5-VL weights
(``model.layers.*``, ``model.embed_tokens.*``, ``visual.*``) and reads both; so do we
(`Qwen2_5_VLForConditionalGeneration.disk_names`). Reading each rank's shard, numbering a
pipeline stage's layers as the whole model's and writing the folder are mm_parallel.model_base's.
"""

from __future__ import annotations


def disk_name(name: str) -> str:
    """The on-disk (released checkpoint) form of a module name: ``model.X`` / ``visual.X``."""
    if name.startswith("model.language_model."):
        return name.replace("model.language_model.", "model.", 1)
    return name.replace("model.visual.", "visual.", 1)
