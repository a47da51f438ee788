"""Vision-language SFT data: LLaMA-Factory conversations (and its dataset_info.json), the Qwen chat
template, drop-in twins of transformers' Qwen2-VL image and video processors and Qwen3-VL's video
processor, Qwen2.5-Omni's samples with audio, packing, preference pairs, prompts for reinforcement
learning (numpy out)."""

from mm_data.vl.conversation import Conversation, parse_entry, read_conversations, read_datasets
from mm_data.vl.dataset import MEDIA_FIELDS, VLSFTDataset, load_image
from mm_data.vl.dataset_info import DatasetFormat, load_dataset_info
from mm_data.vl.groups import collate_groups
from mm_data.vl.image_processor import Qwen2VLImageProcessor, smart_resize
from mm_data.vl.omni import OMNI_SYSTEM, OmniSFTDataset, video_audio_runs
from mm_data.vl.packing import PackedDataset, PackedRows, pack, plan_packs, plan_rows
from mm_data.vl.pairs import PairCollate, PairedRows
from mm_data.vl.prompts import PROMPT_INDEX, left_padded
from mm_data.vl.qwen3_video_processor import Qwen3VLVideoProcessor, smart_resize_video
from mm_data.vl.template import IGNORE_INDEX, OMNI_MEDIA, QWEN_MEDIA, QwenChatTemplate
from mm_data.vl.video_processor import Qwen2VLVideoProcessor

__all__ = [
    "Conversation", "DatasetFormat", "IGNORE_INDEX", "MEDIA_FIELDS", "OMNI_MEDIA", "OMNI_SYSTEM", "OmniSFTDataset",
    "PROMPT_INDEX", "PackedDataset", "PackedRows", "PairCollate", "PairedRows", "QWEN_MEDIA",
    "Qwen2VLImageProcessor", "Qwen2VLVideoProcessor", "Qwen3VLVideoProcessor", "QwenChatTemplate", "VLSFTDataset",
    "collate_groups", "left_padded", "load_dataset_info", "load_image", "pack", "parse_entry", "plan_packs",
    "plan_rows", "read_conversations", "read_datasets", "smart_resize", "smart_resize_video", "video_audio_runs"
]
