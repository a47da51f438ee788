"""Data sets, video decoding, preprocessing and samplers for multimodal training (framework-free: numpy out).

- `mm_data.video`: video-text annotations, clip decoding, buckets, `VideoTextDataset`
- `mm_data.vl`: LLaMA-Factory conversations, Qwen chat template and processors, `VLSFTDataset`, packing
- `mm_data.sampler` / `mm_data.loader`: bucketed resumable data-parallel batches, worker processes
- `mm_data.feature_cache`: encode once (VAE latents, text embeddings), train from safetensors
- `mm_data.errors`: bad samples skipped, counted and limited
"""

from mm_data.__about__ import __version__
from mm_data.errors import BadInputLog, BadSample, DataError
from mm_data.feature_cache import FeatureDataset, FeaturePairs, build_feature_cache
from mm_data.loader import Collator, DataLoader
from mm_data.sampler import BucketBatchSampler, held_out_split, length_groups

__all__ = ["BadInputLog", "BadSample", "BucketBatchSampler", "Collator", "DataError", "DataLoader", "FeatureDataset",
           "FeaturePairs", "__version__", "build_feature_cache", "held_out_split", "length_groups"]
