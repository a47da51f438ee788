"""MindSpore twins of the diffusers video generators (CogVideoX, Wan2.1), their VAEs and encoders.

Skeleton only: the implementation arrives with issue 6; nothing here works yet.
"""

from mm_models_video.__about__ import __version__

__all__ = ["__version__"]
