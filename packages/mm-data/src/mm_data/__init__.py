"""Data sets, video decoding, preprocessing and samplers for multimodal training (framework-free: numpy out).

Skeleton only: the implementation arrives with issue 7; nothing here works yet.
"""

from mm_data.__about__ import __version__

__all__ = ["__version__"]
