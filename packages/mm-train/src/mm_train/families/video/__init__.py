"""Video-generation families (Wan, CogVideoX) and what they share: data, encoders, samples, tiny sets."""
