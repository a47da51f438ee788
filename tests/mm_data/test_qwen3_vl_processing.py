"""Qwen3-VL data: images through transformers' PIL processor with Qwen3-VL's settings, the video
frame sampling, resize rule and timestamps of transformers' Qwen3-VL video processor and
processor, and a LLaMA-Factory sample with a real video written as transformers' processor
writes it (``<t seconds><|vision_start|>pads<|vision_end|>`` per temporal patch).

transformers' Qwen3-VL video processor module needs torchvision to import, which cannot be
installed beside the CPU torch here; its two pure functions (``smart_resize`` and
``sample_frames``) are taken from that module's own source file and run as the reference."""

import ast
import json
import math
import types

import numpy as np
import pytest
from helpers.media import qwen_tokenizer, write_image, write_video

from mm_data.vl import Qwen2VLImageProcessor, Qwen3VLVideoProcessor, VLSFTDataset, smart_resize_video

QWEN3 = dict(patch_size=16, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))


def _reference_functions():
    """smart_resize and Qwen3VLVideoProcessor.sample_frames from transformers' source file."""
    import importlib.util

    spec = importlib.util.find_spec("transformers.models.qwen3_vl")
    path = spec.submodule_search_locations[0] + "/video_processing_qwen3_vl.py"
    tree = ast.parse(open(path).read())
    found = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Qwen3VLVideoProcessor")
    found.update({node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)})
    namespace = {"math": math, "np": np, "logger": types.SimpleNamespace(warning_once=lambda *a: None),
                 "VideoMetadata": object}
    for name in ("smart_resize", "sample_frames"):
        module = ast.Module(body=[found[name]], type_ignores=[])
        exec(compile(ast.fix_missing_locations(module), path, "exec"), namespace)
    return namespace["smart_resize"], namespace["sample_frames"]


def test_images_equal_transformers_pil_processor_with_qwen3_settings(tmp_path):
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    ours, ref = Qwen2VLImageProcessor(**QWEN3), Qwen2VLImageProcessorPil(**QWEN3)
    images = [Image.open(write_image(str(tmp_path / f"{i}.png"), h, w, seed=i))
              for i, (h, w) in enumerate([(48, 64), (300, 97), (33, 33)])]
    got, want = ours(images), ref(images, return_tensors="np")
    np.testing.assert_array_equal(got["image_grid_thw"], want["image_grid_thw"])
    np.testing.assert_array_equal(got["pixel_values"], want["pixel_values"])


def test_video_sampling_resize_and_timestamps_match_transformers():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    smart_resize, sample_frames = _reference_functions()
    rng = np.random.default_rng(0)
    for _ in range(200):
        frames, height, width = int(rng.integers(2, 400)), int(rng.integers(8, 900)), int(rng.integers(8, 900))
        low, high = int(rng.integers(1, 64)) * 1024, int(rng.integers(64, 2000)) * 1024
        assert smart_resize_video(frames, height, width, 2, 32, low, high) == \
            smart_resize(frames, height, width, 2, 32, low, high)
    processor = Qwen3VLVideoProcessor()
    for total, video_fps, fps in [(300, 30.0, 2), (10, 24.0, 2), (7, 25.0, 0.5), (2000, 60.0, 4), (50, 24.0, None)]:
        reference_self = types.SimpleNamespace(fps=2, min_frames=processor.min_frames,
                                               max_frames=processor.max_frames)
        metadata = types.SimpleNamespace(total_num_frames=total, fps=video_fps)
        expected = sample_frames(reference_self, metadata, fps=fps)
        indices = processor.sample_frames(total, video_fps, fps=fps or 2)
        np.testing.assert_array_equal(indices, expected)
        assert processor.timestamps(indices, video_fps) == \
            Qwen3VLProcessor._calculate_timestamps(None, list(indices), video_fps, 2)


def test_video_sample_is_written_as_transformers_processor_writes_it(tmp_path):
    """Per temporal patch its timestamp text and placeholder group; ids equal tokenising the
    expanded text whole; mm_token_type_ids mark the pads; no second_per_grid_ts."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    video = write_video(str(tmp_path / "clip.mp4"), frames=30, height=64, width=96, fps=10)
    tokenizer = qwen_tokenizer(str(tmp_path / "tok"), ["Describe the video.", "A bar moves.", "seconds 0.1 2.5"])
    entry = {"messages": [{"role": "user", "content": "Describe <video>"},
                          {"role": "assistant", "content": "A bar moves."}], "videos": [video]}
    (tmp_path / "data.json").write_text(json.dumps([entry]))
    processor = Qwen3VLVideoProcessor(min_pixels=32 * 32, max_pixels=8 * 64 * 96, fps=2.0)
    data = VLSFTDataset.from_file(str(tmp_path / "data.json"), tokenizer, video_processor=processor,
                                  image_processor=Qwen2VLImageProcessor(**QWEN3), default_system=None)
    sample = data[0]
    grid = sample["video_grid_thw"][0]
    assert "second_per_grid_ts" not in sample and grid[0] == 3  # 6 frames at 2 fps of 3 s: 3 temporal patches
    indices = processor.sample_frames(30, 10.0, fps=2.0)
    reference = types.SimpleNamespace(
        video_processor=types.SimpleNamespace(merge_size=2, temporal_patch_size=2),
        vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>", video_token="<|video_pad|>",
        _calculate_timestamps=lambda idx, fps, merge: Qwen3VLProcessor._calculate_timestamps(None, idx, fps, merge))
    video_text = Qwen3VLProcessor.replace_video_token(
        reference, {"video_grid_thw": sample["video_grid_thw"],
                    "video_metadata": [types.SimpleNamespace(fps=10.0, frames_indices=list(indices))]}, 0)
    text = f"<|im_start|>user\nDescribe {video_text}<|im_end|>\n<|im_start|>assistant\nA bar moves.<|im_end|>\n"
    assert sample["input_ids"].tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    pads = sample["input_ids"] == tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert pads.sum() == np.prod(grid) // 4 and (sample["mm_token_type_ids"][pads] == 2).all()
    assert (sample["mm_token_type_ids"][~pads] == 0).all()
    assert data.length(0) == len(sample["input_ids"])
    assert sample["pixel_values_videos"].shape == (np.prod(grid), 3 * 2 * 16 * 16)


def test_a_one_frame_clip_is_refused_as_transformers_refuses_it():
    with pytest.raises(ValueError, match="temporal_factor"):
        smart_resize_video(1, 64, 64)
