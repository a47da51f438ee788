"""The VL families' data: the typed data section, where a recipe's annotations and tokenizer are,
the built-in sets, and the files a saved model folder needs beside its weights."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Union

from mm_train.families.vl import tiny, tiny_omni
from mm_train.recipe import DataSection
from mm_train.task import load_tokenizer

# Deferred imports: mm-data (optional: a missing one is named when a run needs it).


@dataclass
class VLDataSection(DataSection):
    """data.kind tiny_vl (the built-in set, generated at data.path or a cache folder; tiny_vl_pairs:
    as preference pairs; tiny_vl_colours: the colour question, for SFT or GRPO) or llamafactory: a
    LLaMA-Factory JSON / JSONL file at data.path, or the data sets named by data.dataset (one name,
    a list read in order, or {name: ratio} mixed in those shares) of LLaMA-Factory's
    dataset_info.json at data.dataset_info (the file or its folder), with the columns and tags it
    declares; or with data.format parquet | webdataset | arrow, shards of such rows at data.path
    (media inside them or paths from their folder)."""

    kind: str = "tiny_vl"
    dataset_info: Optional[str] = None
    dataset: Optional[Union[str, List[str], Dict[str, float]]] = None
    media_dir: Optional[str] = None  # where image / video paths start (default: the file's folder)
    tokenizer: Optional[str] = None  # a folder or tokenizer.json (default: model.path)
    samples: int = 256  # the built-in sets only
    max_length: int = 2048
    system: Optional[str] = "You are a helpful assistant."  # the default system turn; "" or null: none
    min_pixels: Optional[int] = None  # image / video frame pixel bounds (default: the processors')
    max_pixels: Optional[int] = None
    video_fps: float = 2.0
    # padding-free training (the default): the samples of a rank's share packed into rows of at most
    # max_tokens tokens (default: max_length), one row per micro-batch, attention and positions per
    # sample; false: micro_batch_size samples padded to the longest
    packing: bool = True
    max_tokens: Optional[int] = None

    def __post_init__(self):
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"data.max_tokens={self.max_tokens} is the packed rows' token budget: set it >= 1")
        if (self.dataset_info is None) != (self.dataset is None):
            raise ValueError("data.dataset_info and data.dataset go together: the dataset_info.json and the name(s) "
                             "of the data set(s) in it to read")
        if self.dataset_info is not None and (self.kind != "llamafactory" or self.path):
            raise ValueError("data.dataset_info is read with data.kind llamafactory and without data.path (the "
                             "files are the ones it names)")
        if self.kind == "llamafactory" and self.dataset_info is None:
            self.require_path("a LLaMA-Factory JSON / JSONL file, or set data.dataset_info and data.dataset")
        if self.format != "json" and (self.kind != "llamafactory" or self.dataset_info is not None):
            raise ValueError(f"data.format {self.format} reads shards of LLaMA-Factory rows at data.path: set "
                             "data.kind llamafactory and data.path (not data.dataset_info), or data.format json")


def row_budget(data) -> int:
    """The tokens a packed row holds (data.max_tokens, else data.max_length)."""
    return data.max_tokens or data.max_length


def sequence_multiple(parallel) -> int:
    """What a row's length is padded to a multiple of: sequences are cut into equal parts, 2 per
    cp rank (the load-balanced ring) and tp under sequence parallelism."""
    return (2 * parallel.cp if parallel.cp > 1 else 1) * (parallel.tp if parallel.sequence_parallel else 1)


def pixel_bounds(data) -> Dict[str, int]:
    return {k: v for k, v in (("min_pixels", data.min_pixels), ("max_pixels", data.max_pixels)) if v}


# data.kind of a built-in set -> the module that generates it (generate, default_folder)
BUILTIN_SETS = {"tiny_vl": tiny, "tiny_vl_pairs": tiny.Pairs, "tiny_vl_colours": tiny.Colours,
                "tiny_omni": tiny_omni}


def data_sources(recipe):
    """(the built-in set's folder or None, the annotations: a file or the data sets of a
    dataset_info.json (`mm_data.vl.DatasetFormat`s), the tokenizer's folder or file)."""
    data = recipe.data
    if data.kind in BUILTIN_SETS:
        folder = data.path or BUILTIN_SETS[data.kind].default_folder()
        return folder, os.path.join(folder, "data.json"), os.path.join(folder, "tokenizer.json")
    if data.dataset_info:
        from mm_data.vl import load_dataset_info

        return None, load_dataset_info(data.dataset_info, data.dataset), data.tokenizer or recipe.model.path
    return None, data.path, data.tokenizer or recipe.model.path


def annotation_files(annotations) -> List[str]:
    """The files behind `data_sources`' annotations (what the data fingerprint hashes)."""
    return [annotations] if isinstance(annotations, str) else [fmt.path for fmt in annotations]


def data_files(dataset, annotations):
    """(annotation files, media files) of a VL data set for the data fingerprint: of shards, their
    manifest and the shard files (by size; their rows are not read for it)."""
    shards = dataset.shards
    if shards is not None:
        return [shards.manifest] if shards.manifest else [], [shard.path for shard in shards.shards]
    media = [p for c in dataset.conversations for p in c.images + c.videos + c.audios
             if isinstance(p, str) and "://" not in p]
    return annotation_files(annotations), media


def vl_tokenizer(path: str):
    return load_tokenizer(path, pad_token="<|endoftext|>", eos_token="<|im_end|>")


def write_processing_files(recipe, out: str) -> list:
    """What a model folder needs beside its weights to be used as trained — the tokenizer with
    the run's chat template (its default system turn), preprocessor_config.json and
    video_preprocessor_config.json with the run's processor settings — written into ``out``
    (`mm-train convert checkpoint`). Returns the files written."""
    from mm_data.vl import QwenChatTemplate

    _, _, tokenizer_path = data_sources(recipe)
    if not tokenizer_path or not os.path.exists(tokenizer_path):
        raise FileNotFoundError(f"the tokenizer this run trained with is not at {tokenizer_path}; set data.tokenizer "
                                "(or model.path) to it")
    before = set(os.listdir(out))
    task = recipe.family.task
    tokenizer = vl_tokenizer(tokenizer_path)
    tokenizer.chat_template = QwenChatTemplate(tokenizer, recipe.data.system, media=task.chat_media()).jinja()
    tokenizer.save_pretrained(out)
    image, video = task.processors(recipe.data)
    kinds = {"preprocessor_config.json": (image, "image_processor_type", "Qwen2VLImageProcessor"),
             "video_preprocessor_config.json": (video, "video_processor_type", type(video).__name__)}
    for name, (processor, key, kind) in kinds.items():
        extra = task.audio_settings() if name == "preprocessor_config.json" else {}  # Omni: one file, both
        with open(os.path.join(out, name), "w") as f:
            json.dump({**processor.to_dict(), key: kind, **extra, "processor_class": task.processor_class}, f,
                      indent=2)
    return sorted(set(os.listdir(out)) - before)
