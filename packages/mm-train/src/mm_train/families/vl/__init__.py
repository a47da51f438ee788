"""Vision-language families (Qwen2.5-VL, Qwen3-VL, Qwen2.5-Omni) and what they share: samples, tiny sets."""
