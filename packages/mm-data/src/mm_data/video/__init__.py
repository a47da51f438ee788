"""Video-text data for diffusion training: annotations, clip decoding, buckets, data set (numpy out)."""

from mm_data.video.annotations import (
                                       VideoRecord,
                                       load_records,
                                       read_data_json,
                                       read_data_txt,
                                       read_jsonl,
                                       read_video_folder,
)
from mm_data.video.dataset import VideoTextDataset
from mm_data.video.decode import VideoInfo, probe, read_frames
from mm_data.video.pairs import ClipPair, read_clip_pairs
from mm_data.video.spatial import AspectBuckets
from mm_data.video.temporal import FrameBuckets, clip_indices, frame_step, frames_available

__all__ = ["AspectBuckets", "ClipPair", "FrameBuckets", "VideoInfo", "VideoRecord", "VideoTextDataset", "clip_indices",
           "frame_step", "frames_available", "load_records", "probe", "read_data_json", "read_data_txt",
           "read_clip_pairs", "read_frames", "read_jsonl", "read_video_folder"]
