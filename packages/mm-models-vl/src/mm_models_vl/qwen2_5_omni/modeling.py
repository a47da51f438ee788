"""Qwen2_5OmniThinkerForConditionalGeneration: the MindSpore twin of transformers' class of the same name.

The thinker is Qwen2.5-Omni's understanding half (the talker and token2wav speak; they are not
trained here). Same config (``Qwen2_5OmniThinkerConfig``, or the whole model's
``Qwen2_5OmniConfig`` whose ``thinker_config`` is read), same parameter names
(``model.audio_tower.*``, ``model.visual.*``, ``model.language_model.*``, ``lm_head``), same forward
keywords (``input_ids``, ``attention_mask``, ``input_features``, ``feature_attention_mask``,
``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``,
``video_second_per_grid``, ``use_audio_in_video``, ``labels`` ...) and outputs (``loss``, ``logits``).

What is Qwen2.5-VL's is inherited: the language model (Qwen2 decoder with M-RoPE, which TMRoPE
positions feed), the vision tower's code (with q / k / v apart), the host-side sequence plan and
its cut over cp / sp, the loss, the key/value cache and greedy generation. What is the thinker's:
the audio encoder (mm_models_vl.qwen2_5_omni.audio), TMRoPE (mm_models_vl.qwen2_5_omni.positions)
and its checkpoint names.

As in transformers, the 3-D positions need ``attention_mask``: transformers silently falls back to
1-D positions without it; here images, videos or audio without it are an error that says so.
Under context parallelism a right-padded mask (the collator's) sets the positions and is then
dropped (Qwen2.5-VL's sequence plan): causal attention keeps every real token off the pads at the
end, whose labels are -100, so the real tokens' outputs equal the masked run's.

Checkpoints: a thinker folder as transformers writes it (``model.*``, ``visual.*``,
``audio_tower.*``, ``lm_head.*``), or the whole Qwen2.5-Omni folder as published, whose thinker
tensors carry a ``thinker.`` prefix beside the talker's and token2wav's: those are never read.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import numpy as np
from mindspore import Tensor

from mm_models_vl.qwen2_5_omni import positions as pos
from mm_models_vl.qwen2_5_omni.audio import Qwen2_5OmniAudioEncoder, output_lengths
from mm_models_vl.qwen2_5_omni.vision import Qwen2_5OmniVisionEncoder
from mm_models_vl.qwen2_5_vl import packed_rows
from mm_models_vl.qwen2_5_vl.checkpoint import disk_name
from mm_models_vl.qwen2_5_vl.modeling import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLModel,
    hf_config,
    place_rows,
    towered,
)
from mm_parallel.ops.device import host_array as host

WHOLE_MODEL_TYPE = "qwen2_5_omni"  # the published folder: config.json of the whole model, thinker_config inside


def thinker_config(config):
    """transformers' Qwen2_5OmniThinkerConfig from a config object, a dict, a thinker folder or a
    whole Qwen2.5-Omni folder / config (its thinker_config)."""
    if isinstance(config, (str, os.PathLike)):
        with open(os.path.join(str(config), "config.json")) as f:
            config = json.load(f)
    if isinstance(config, dict) and config.get("model_type") == WHOLE_MODEL_TYPE:
        config = config["thinker_config"]
    elif getattr(config, "model_type", None) == WHOLE_MODEL_TYPE:
        config = config.thinker_config
    if isinstance(config, dict):
        config = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    return hf_config(config, "Qwen2_5OmniThinkerConfig")


def audio_inputs(input_features, feature_attention_mask):
    """((num_mel_bins, total frames) features of every audio, (audios,) frame counts) from the
    processor's padded (audios, num_mel_bins, frames) features and their (audios, frames) mask."""
    features, mask = host(input_features, np.float32), host(feature_attention_mask)
    if mask is None:
        raise ValueError("input_features need feature_attention_mask (audios, frames): 1 on each audio's real "
                         "frames, as the processor returns it")
    if features.ndim != 3 or mask.shape != (features.shape[0], features.shape[2]):
        raise ValueError(f"input_features {features.shape} must be (audios, num_mel_bins, frames) with "
                         f"feature_attention_mask (audios, frames), got {mask.shape}")
    keep = mask.astype(bool)
    return np.ascontiguousarray(features.transpose(0, 2, 1)[keep].T), keep.sum(-1)


class Qwen2_5OmniThinkerModel(Qwen2_5_VLModel):
    """Audio and vision towers + language model (no head); holds the parts this pipeline stage owns."""

    vision_class = Qwen2_5OmniVisionEncoder

    def __init__(self, config, topology, first: int = 0, last: Optional[int] = None, pre: bool = True,
                 post: bool = True):
        super().__init__(config, topology, first, last, pre, post)
        self.audio_tower = Qwen2_5OmniAudioEncoder(config.audio_config) if pre else None

    def inputs_embeds(self, input_ids: np.ndarray, pixel_values=None, image_grid_thw=None,
                      pixel_values_videos=None, video_grid_thw=None, input_features=None,
                      feature_attention_mask=None, media_copies: int = 1):
        """Token embeddings with each image / video / audio placeholder replaced by its feature, in
        order (``media_copies``: Qwen2_5_VLModel.vision_features; the audio masks list every
        placeholder run, the features the first 1 / copies)."""
        embeds = self.language_model.embed(Tensor(input_ids.astype(np.int32)))
        parts = self.vision_features(input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
                                     media_copies)
        slots = np.nonzero(input_ids.reshape(-1) == self.config.audio_token_id)[0]
        if input_features is None:
            if len(slots):
                raise ValueError(f"input_ids hold {len(slots)} audio placeholder tokens but no input_features "
                                 "were given")
        else:
            mask = None if feature_attention_mask is None else towered(host(feature_attention_mask), media_copies,
                                                                        "audio")
            features, lengths = audio_inputs(input_features, mask)
            expected = int(output_lengths(lengths).sum())
            if expected * media_copies != len(slots):
                raise ValueError(f"audio features and audio tokens do not match: the audios give {expected} "
                                 f"tokens{f' x {media_copies} copies' if media_copies > 1 else ''}, input_ids hold "
                                 f"{len(slots)} audio placeholder tokens")
            parts.append((slots, self.run_tower(self.audio_tower, "audio", Tensor(features), lengths)))
        return place_rows(embeds.shape, parts, embeds)


class Qwen2_5OmniThinkerForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """The Qwen2.5-Omni thinker with its language-model head; see the module docstring. Under
    pipeline parallelism the object holds one virtual stage; the towers live on the first."""

    hf_config_name = "Qwen2_5OmniThinkerConfig"
    base_model_class = Qwen2_5OmniThinkerModel
    plan_keys = ("input_ids", "attention_mask", "position_ids", "labels", "image_grid_thw", "video_grid_thw",
                 "feature_attention_mask", "video_second_per_grid", "use_audio_in_video", "num_items_in_batch",
                 "loss_per_sample")
    embed_keys = ("input_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                  "input_features", "feature_attention_mask", "media_copies")

    @classmethod
    def load_config(cls, config, overrides=None):
        """The thinker's config (of a whole Qwen2.5-Omni folder too); an override goes to
        text_config when only text_config has the key."""
        return super().load_config(thinker_config(config), overrides)

    def disk_names(self, name: str):
        """transformers' thinker layout (``model.*``, ``visual.*``, ``audio_tower.*``), then the same
        under the whole model's ``thinker.`` prefix, then transformers 5's module names."""
        disk = disk_name(name.replace("model.audio_tower.", "audio_tower.", 1))
        return tuple(dict.fromkeys((disk, "thinker." + disk, name)))

    def flops(self, batch: dict) -> float:
        """Forward FLOPs per sample of a micro-batch (mm_models_vl.qwen2_5_omni.flops)."""
        from mm_models_vl.qwen2_5_omni.flops import batch_flops

        return batch_flops(self.config, batch)

    # -- host side ---------------------------------------------------------------------------

    def sequence_plan(self, input_ids, attention_mask=None, position_ids=None, labels=None, image_grid_thw=None,
                      video_grid_thw=None, feature_attention_mask=None, video_second_per_grid=None,
                      use_audio_in_video: bool = False, past_length: int = 0, rope_deltas=None, split: bool = True,
                      num_items_in_batch=None, loss_per_sample: bool = False):
        """Qwen2.5-VL's plan (rotary tables, padding mask or packed segments, targets, cut to this
        rank) on TMRoPE positions, a packed row's computed for each of its samples alone."""
        if position_ids is None and past_length == 0:
            ids = host(input_ids, np.int64)
            segments = packed_rows.row_segments(host(attention_mask))

            def positions_of(masks):
                return self.tmrope_positions(np.broadcast_to(ids, masks.shape), masks, image_grid_thw, video_grid_thw,
                                             feature_attention_mask, video_second_per_grid, use_audio_in_video)[0]

            if segments is not None:
                position_ids = packed_rows.per_sample_positions(positions_of, segments)
            else:
                position_ids, rope_deltas = self.tmrope_positions(ids, attention_mask, image_grid_thw, video_grid_thw,
                                                                  feature_attention_mask, video_second_per_grid,
                                                                  use_audio_in_video)
        return super().sequence_plan(input_ids, attention_mask, position_ids, labels, past_length=past_length,
                                     rope_deltas=rope_deltas, split=split, num_items_in_batch=num_items_in_batch,
                                     loss_per_sample=loss_per_sample)

    def tmrope_positions(self, ids: np.ndarray, attention_mask=None, image_grid_thw=None, video_grid_thw=None,
                         feature_attention_mask=None, video_second_per_grid=None, use_audio_in_video=False):
        """((3, batch, seq) positions, (batch, 1) deltas) of a whole prompt (positions module)."""
        mask = host(attention_mask)
        media = image_grid_thw is not None or video_grid_thw is not None or feature_attention_mask is not None
        if mask is None:
            if media:
                raise ValueError("images, videos or audio need attention_mask (all ones for an unpadded batch): "
                                 "TMRoPE positions are computed from it, as in transformers, which without it "
                                 "silently falls back to 1-D positions")
            return np.ascontiguousarray(np.broadcast_to(np.arange(ids.shape[1]), (3,) + ids.shape)), None
        lengths = None if feature_attention_mask is None else host(feature_attention_mask).sum(-1)
        return pos.rope_index(ids, mask, host(image_grid_thw), host(video_grid_thw), lengths,
                              host(video_second_per_grid), bool(use_audio_in_video), config=self.config)

    def prompt_positions(self, ids: np.ndarray, inputs: dict) -> np.ndarray:
        return self.tmrope_positions(ids, inputs.get("attention_mask"), inputs.get("image_grid_thw"),
                                     inputs.get("video_grid_thw"), inputs.get("feature_attention_mask"),
                                     inputs.get("video_second_per_grid"), inputs.get("use_audio_in_video", False))[0]

    def embed(self, input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
              video_grid_thw=None, input_features=None, feature_attention_mask=None, media_copies=None):
        """Embeddings with the vision and audio features in place, cut to this rank's part of the sequence."""
        embeds = self.model.inputs_embeds(host(input_ids, np.int64), pixel_values, image_grid_thw,
                                          pixel_values_videos, video_grid_thw, input_features, feature_attention_mask,
                                          media_copies or 1)
        return self.enter_sequence(embeds, 1)

    # -- forward -----------------------------------------------------------------------------

    def construct(self, input_ids=None, input_features=None, pixel_values=None, pixel_values_videos=None,
                  image_grid_thw=None, video_grid_thw=None, attention_mask=None, feature_attention_mask=None,
                  position_ids=None, past_key_values=None, labels=None, use_cache: bool = False,
                  use_audio_in_video: bool = False, video_second_per_grid=None, rope_deltas=None,
                  mm_token_type_ids=None, num_items_in_batch=None, loss_per_sample: bool = False, preference=None,
                  media_copies=None, **unused: Any):
        del mm_token_type_ids  # what some processors return: TMRoPE finds the media by their token ids
        ids, cache = self.forward_inputs(input_ids, past_key_values, use_cache, unused)
        plan = self.sequence_plan(ids, attention_mask, position_ids, labels, image_grid_thw, video_grid_thw,
                                  feature_attention_mask, video_second_per_grid, use_audio_in_video,
                                  cache.length() if cache else 0, rope_deltas, num_items_in_batch=num_items_in_batch,
                                  loss_per_sample=loss_per_sample)
        embeds = self.embed(ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, input_features,
                            feature_attention_mask, media_copies)
        hidden = self.model.language_model(embeds, plan.cos, plan.sin, plan.key_padding_mask, cache, plan.segment_ids)
        logits = self.lm_head(hidden)
        loss = None if plan.targets is None else self.loss(logits, plan, preference)
        return self.forward_output(loss, logits, cache, plan)
