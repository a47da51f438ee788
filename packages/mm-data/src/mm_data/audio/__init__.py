"""Audio for the Qwen2.5-Omni thinker: decoding to 16 kHz mono and Whisper log-mel features."""

from mm_data.audio.decode import load_audio
from mm_data.audio.features import WhisperFeatureExtractor

__all__ = ["WhisperFeatureExtractor", "load_audio"]
