"""Data sets, video decoding, preprocessing and samplers for multimodal training (framework-free: numpy out).

Implemented so far: `mm_data.vl.Qwen2VLImageProcessor` (issue 7 tracks the rest).
"""

from mm_data.__about__ import __version__

__all__ = ["__version__"]
