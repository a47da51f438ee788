"""Qwen3VLForConditionalGeneration and Qwen3VLMoeForConditionalGeneration: the MindSpore twins of
transformers' classes of the same names.

Same configs (``Qwen3VLConfig`` / ``Qwen3VLMoeConfig``), parameter names (``model.visual.*``,
``model.language_model.*``, ``lm_head``), forward keywords (``input_ids``, ``attention_mask``,
``mm_token_type_ids``, ``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``,
``video_grid_thw``, ``labels``, ``output_router_logits``) and outputs (``loss``, ``logits``,
``aux_loss``). As transformers does, images or videos without ``mm_token_type_ids`` are an error
(M-RoPE cannot be placed without them).

What is Qwen2.5-VL's is inherited: the host-side sequence plan (positions, padding mask, targets,
the cut over cp / sp), the loss, the key/value cache and greedy generation. What is Qwen3-VL's:
the vision tower with DeepStack, interleaved M-RoPE with the config's head_dim, q / k norms, and
the DeepStack features added after the first decoder layers. Each DeepStack level is scattered to
the visual positions of the sequence (zeros elsewhere) before the sequence is cut, so it is cut
with the hidden states; under pipeline parallelism the levels later stages need travel in the
stage dict (``deepstack_<level>``), with the MoE statistics of the layers run so far
(``moe_stats``), so the load-balancing loss pools every layer as transformers' does.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np
from mindspore import Tensor, ops

from mm_models_vl.qwen2_5_vl.modeling import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLModel,
    last_positions,
    place_rows,
)
from mm_models_vl.qwen3_vl import positions as pos
from mm_models_vl.qwen3_vl.language import Qwen3VLTextModel
from mm_models_vl.qwen3_vl.vision import Qwen3VLVisionModel
from mm_parallel.moe import load_balancing_loss
from mm_parallel.ops.device import host_array as host
from mm_parallel.topology import Topology


class Qwen3VLModel(Qwen2_5_VLModel):
    """Vision tower with DeepStack + language model (no head); the parts this pipeline stage owns."""

    vision_class = Qwen3VLVisionModel
    text_class = Qwen3VLTextModel

    def inputs_embeds(self, input_ids: np.ndarray, pixel_values=None, image_grid_thw=None,
                      pixel_values_videos=None, video_grid_thw=None, media_copies: int = 1):
        """(token embeddings with the vision features in place, [DeepStack level l: its features
        at the same positions, zeros elsewhere, (batch, seq, hidden)])."""
        embeds = self.language_model.embed(Tensor(input_ids.astype(np.int32)))
        parts = self.vision_features(input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
                                     media_copies)
        merged = place_rows(embeds.shape, [(slots, out[0]) for slots, out in parts], embeds)
        levels = len(self.config.vision_config.deepstack_visual_indexes) if parts else 0
        deepstack = [place_rows(embeds.shape, [(slots, out[1][level]) for slots, out in parts])
                     for level in range(levels)]
        return merged, deepstack

    def position_ids(self, input_ids: np.ndarray, attention_mask=None, image_grid_thw=None, video_grid_thw=None,
                     second_per_grid_ts=None, mm_token_type_ids=None, past_length: int = 0, rope_deltas=None):
        """(3, batch, seq) positions and deltas, as transformers' Qwen3-VL get_rope_index."""
        b, s = input_ids.shape
        if past_length == 0 and (image_grid_thw is not None or video_grid_thw is not None):
            types = host(mm_token_type_ids)
            if types is None:
                raise ValueError("images or videos were given (image_grid_thw / video_grid_thw) without "
                                 "mm_token_type_ids: pass the processor's mm_token_type_ids (0 text, 1 image, "
                                 "2 video) so that M-RoPE can place the vision tokens, as transformers requires")
            return pos.rope_index(input_ids, types, host(image_grid_thw), host(video_grid_thw),
                                  host(attention_mask), spatial_merge_size=self.config.vision_config.spatial_merge_size)
        text = np.broadcast_to(np.arange(past_length, past_length + s), (3, b, s))
        if rope_deltas is not None and past_length > 0:
            return text + np.asarray(rope_deltas)[None], rope_deltas
        return np.ascontiguousarray(text), None


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Qwen3-VL with its language-model head; see the module docstring. Under pipeline
    parallelism the object holds one virtual stage (mm_parallel.model_base)."""

    hf_config_name = "Qwen3VLConfig"
    base_model_class = Qwen3VLModel

    def __init__(self, config, topology: Optional[Topology] = None, chunk: int = 0, pipeline_num_layers=None):
        super().__init__(config, topology, chunk, pipeline_num_layers)
        self.sparse_layers = [layer.mlp for layer in self.model.language_model.layers if layer.is_sparse]

    def disk_names(self, name: str):
        """Released Qwen3-VL folders use transformers 5's module names."""
        return (name,)

    def flops(self, batch: dict) -> float:
        """Forward FLOPs per sample of a micro-batch (mm_models_vl.qwen3_vl.flops)."""
        from mm_models_vl.qwen3_vl.flops import batch_flops

        return batch_flops(self.config, batch)

    def rotary_tables(self, position_ids: np.ndarray):
        text = self.config.text_config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        rope = text.rope_parameters or {}
        return pos.interleaved_mrope_cos_sin(position_ids, head_dim, rope.get("rope_theta", 5e6),
                                             rope.get("mrope_section", [24, 20, 20]))

    def embed(self, input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
              video_grid_thw=None, media_copies=None):
        """(embeddings, {level: DeepStack features}) cut to this rank's part of the sequence."""
        embeds, deepstack = self.model.inputs_embeds(host(input_ids, np.int64), pixel_values, image_grid_thw,
                                                     pixel_values_videos, video_grid_thw, media_copies or 1)
        return self.enter_sequence(embeds, 1), {level: self.enter_sequence(d, 1) for level, d in enumerate(deepstack)}

    def _router_loss(self, stats, output_router_logits: bool):
        """transformers' load-balancing loss over every MoE layer's statistics, or None."""
        if not output_router_logits or not stats:
            return None
        return load_balancing_loss(stats, self.config.text_config.num_experts)

    def _wants_router_loss(self, output_router_logits) -> bool:
        if output_router_logits is None:
            output_router_logits = getattr(self.config.text_config, "output_router_logits", False)
        return bool(output_router_logits) and bool(getattr(self.config.text_config, "num_experts", 0))

    # -- forward -----------------------------------------------------------------------------

    def construct(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                  labels=None, use_cache: bool = False, pixel_values=None, pixel_values_videos=None,
                  image_grid_thw=None, video_grid_thw=None, mm_token_type_ids=None, rope_deltas=None,
                  output_router_logits=None, num_items_in_batch=None, loss_per_sample: bool = False, preference=None,
                  media_copies=None, **unused: Any):
        ids, cache = self.forward_inputs(input_ids, past_key_values, use_cache, unused)
        plan = self.sequence_plan(ids, attention_mask, position_ids, labels, image_grid_thw, video_grid_thw,
                                  mm_token_type_ids, None, cache.length() if cache else 0, rope_deltas,
                                  num_items_in_batch=num_items_in_batch, loss_per_sample=loss_per_sample)
        embeds, deepstack = self.embed(ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
                                       media_copies)
        hidden = self.model.language_model(embeds, plan.cos, plan.sin, plan.key_padding_mask, cache, deepstack,
                                           plan.token_mask, plan.segment_ids)
        logits = self.lm_head(hidden)
        loss = None if plan.targets is None else self.loss(logits, plan, preference)
        stats = list(self.model.language_model.moe_stats)
        aux = self._router_loss(stats, self._wants_router_loss(output_router_logits))
        if loss is not None and aux is not None:
            loss = loss + self.config.text_config.router_aux_loss_coef * aux
        return self.forward_output(loss, logits, cache, plan, aux)

    def pipeline_stage(self, x, batch: dict) -> Dict:
        """This virtual stage's forward for mm_parallel.pipeline (``with_batch=True``): a dict of
        ``hidden`` (``logits`` on the last stage, split on the vocabulary under tp), the DeepStack
        levels later stages add and the MoE statistics so far."""
        cache = batch.get("past_key_values")
        plan = self.sequence_plan(**self.plan_args(batch), past_length=cache.length() if cache else 0)
        if self.is_first:
            hidden, deepstack = self.first_stage_embed(batch) \
                if not (cache and cache.length()) else (self.embed_tokens(batch["input_ids"]), {})
            stats = []
        else:
            hidden = x["hidden"]
            deepstack = {int(k.split("_")[1]): v for k, v in x.items() if k.startswith("deepstack_")}
            stats = _stage_stats(x)
        hidden = self.model.language_model(hidden, plan.cos, plan.sin, plan.key_padding_mask, cache, deepstack,
                                           plan.token_mask, plan.segment_ids)
        stats = stats + list(self.model.language_model.moe_stats)
        end = self.layer_offset + len(self.model.language_model.layers)
        out = {"logits": self.lm_head(last_positions(hidden, batch.get("logits_to_keep")))} if self.is_last else \
            {"hidden": hidden}
        out.update({f"deepstack_{level}": d for level, d in deepstack.items() if level >= end and not self.is_last})
        if stats:
            out["moe_stats"] = ops.stack(stats)
        return out

    def pipeline_loss(self, out: Dict, batch: dict):
        """The last stage's loss of a micro-batch: cross entropy, plus the weighted load-balancing
        loss when the config sets output_router_logits."""
        plan = self.sequence_plan(**self.plan_args(batch))
        loss = self.loss(out["logits"], plan, batch.get("preference"))
        aux = self._router_loss(_stage_stats(out), self._wants_router_loss(None))
        return loss if aux is None else loss + self.config.text_config.router_aux_loss_coef * aux


def _stage_stats(value: Dict) -> list:
    """The per-layer MoE statistics a stage dict carries (``moe_stats``, stacked), as a list."""
    stats = value.get("moe_stats")
    return [] if stats is None else [stats[i] for i in range(stats.shape[0])]


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL-MoE: Qwen3-VL whose decoder layers are MoE layers (mm_parallel.moe) where
    ``mlp_only_layers`` / ``decoder_sparse_step`` say so; the experts' layout on disk (fused,
    transposed as on the hub, or per expert) is detected when read and kept when written, except
    that a per-expert folder is written in the hub's layout: transformers reads only the fused two."""

    hf_config_name = "Qwen3VLMoeConfig"
    transformers_expert_layouts = ("fused", "fused_transposed")

    def save_pretrained(self, path, chunks=None, dtype=None, folder_writer=None) -> None:
        for model in list(chunks) if chunks else [self]:
            for layer in model.sparse_layers:
                experts = layer.experts
                if experts.save_layout is None and experts.checkpoint_layout not in self.transformers_expert_layouts:
                    experts.save_layout = "fused_transposed"
        super().save_pretrained(path, chunks, dtype, folder_writer)
