"""Qwen2_5_VLForConditionalGeneration: the MindSpore twin of transformers' class of the same name.

Same config (transformers' ``Qwen2_5_VLConfig``), same parameter names, same forward keywords
(``input_ids``, ``attention_mask``, ``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``,
``video_grid_thw``, ``second_per_grid_ts``, ``mm_token_type_ids``, ``labels`` ...), same outputs
(``loss``, ``logits``). Inputs may be numpy arrays or MindSpore tensors; ids, masks and grids are
read on the host, where the M-RoPE positions and the vision layout are computed.

One difference by design: without ``mm_token_type_ids`` transformers silently falls back to 1-D
positions for images and videos; here the types are derived from the placeholder tokens (what the
processor would have written), so M-RoPE is never lost.

Under context parallelism a right-padded ``attention_mask`` (a collator's) sets the positions and
is then dropped: causal attention keeps every real token off the pads at the end (whose labels are
-100), so real tokens' outputs equal the masked single-process run's. Other padding raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mm_models_vl.qwen2_5_vl import packed_rows
from mm_models_vl.qwen2_5_vl import positions as pos
from mm_models_vl.qwen2_5_vl.checkpoint import disk_name
from mm_models_vl.qwen2_5_vl.language import Qwen2_5_VLTextModel, lm_head
from mm_models_vl.qwen2_5_vl.vision import Qwen2_5_VisionTransformerPretrainedModel
from mm_parallel import decoding, mappings
from mm_parallel.context_parallel import split_sequence
from mm_parallel.decoding import KVCache
from mm_parallel.model_base import ParallelModel
from mm_parallel.ops.device import host_array as host
from mm_parallel.ops.device import zeros
from mm_parallel.preference import sequence_log_probs
from mm_parallel.sampling import Sampling
from mm_parallel.tensor_parallel import vocab_parallel_cross_entropy
from mm_parallel.topology import Topology


@dataclass
class CausalLMOutput:
    loss: Optional[Tensor] = None
    logits: Optional[Tensor] = None
    past_key_values: Optional[KVCache] = None
    rope_deltas: Optional[np.ndarray] = None
    aux_loss: Optional[Tensor] = None  # MoE models: the load-balancing loss (output_router_logits)


def hf_config(config, class_name: str = "Qwen2_5_VLConfig"):
    """transformers' config class ``class_name`` from a config object, a dict or a folder holding config.json."""
    import transformers

    cls = getattr(transformers, class_name)
    if isinstance(config, cls):
        return config
    if isinstance(config, dict):
        return cls(**config)
    return cls.from_pretrained(str(config))


def load_config(config):
    """transformers' Qwen2_5_VLConfig from a config object, a dict or a folder holding config.json."""
    return hf_config(config)


def _constant(value):
    """``value`` (a tensor, or tuples / lists of them) cut from autodiff."""
    if isinstance(value, (tuple, list)):
        return type(value)(_constant(v) for v in value)
    return ops.stop_gradient(value) if isinstance(value, Tensor) else value


TOWER_MEMO = "_frozen_tower_outputs"  # a micro-batch's key for its frozen towers' outputs (first_stage_embed)


class Qwen2_5_VLModel(nn.Cell):
    """Vision tower + language model (no head); holds the parts this pipeline stage owns."""

    vision_class = Qwen2_5_VisionTransformerPretrainedModel
    text_class = Qwen2_5_VLTextModel
    tower_memo: Optional[dict] = None  # while a pipeline stage embeds: its micro-batch's frozen tower outputs

    def __init__(self, config, topology: Topology, first: int = 0, last: Optional[int] = None,
                 pre: bool = True, post: bool = True):
        super().__init__()
        self.config = config
        self.visual = self.vision_class(config.vision_config) if pre else None
        self.language_model = self.text_class(config.text_config, topology, first, last, embed=pre, norm=post)

    def vision_features(self, input_ids: np.ndarray, pixel_values=None, image_grid_thw=None,
                        pixel_values_videos=None, video_grid_thw=None, copies: int = 1) -> List[Tuple[np.ndarray, Any]]:
        """[(flat positions of the placeholders, the tower's output)] for the images, then the
        videos given; the number of placeholders must equal the number of features times
        ``copies`` (`media_copies`: the grids list every placeholder run, the pixels the first
        1 / copies of them)."""
        flat_ids, parts = input_ids.reshape(-1), []
        for token, pixels, grid, name in ((self.config.image_token_id, pixel_values, image_grid_thw, "image"),
                                          (self.config.video_token_id, pixel_values_videos, video_grid_thw, "video")):
            slots = np.nonzero(flat_ids == token)[0]
            if pixels is None:
                if len(slots):
                    raise ValueError(f"input_ids hold {len(slots)} {name} placeholder tokens but no {name} pixels "
                                     f"were given")
                continue
            if grid is None:
                raise ValueError(f"{name} pixels need {name}_grid_thw")
            output = self.run_tower(self.visual, name, ms.Tensor(host(pixels, np.float32)),
                                    towered(host(grid, np.int64), copies, name))
            features = output[0] if isinstance(output, tuple) else output
            if features.shape[0] * copies != len(slots):
                raise ValueError(f"{name} features and {name} tokens do not match: {features.shape[0]} features"
                                 f"{f' x {copies} copies' if copies > 1 else ''}, {len(slots)} placeholder tokens in "
                                 "input_ids")
            parts.append((slots, output))
        return parts

    def run_tower(self, tower, key: str, *inputs):
        """``tower(*inputs)``; under ``tower_memo`` a tower with no trainable parameter (frozen, no
        adapters) runs once per micro-batch: its output is kept under ``key`` and given again when
        the stage's forward runs again in its backward (mm_parallel.pipeline), as a constant."""
        memo = self.tower_memo
        if memo is None or tower.trainable_params():
            return tower(*inputs)
        if key not in memo:
            memo[key] = _constant(tower(*inputs))
        return memo[key]

    def inputs_embeds(self, input_ids: np.ndarray, pixel_values=None, image_grid_thw=None,
                      pixel_values_videos=None, video_grid_thw=None, media_copies: int = 1):
        """Token embeddings with each image / video placeholder replaced by its vision feature, in order."""
        embeds = self.language_model.embed(Tensor(input_ids.astype(np.int32)))
        parts = self.vision_features(input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
                                     media_copies)
        return place_rows(embeds.shape, parts, embeds)

    def position_ids(self, input_ids: np.ndarray, attention_mask=None, image_grid_thw=None, video_grid_thw=None,
                     second_per_grid_ts=None, mm_token_type_ids=None, past_length: int = 0, rope_deltas=None):
        """(3, batch, seq) M-RoPE positions and deltas, as transformers' compute_3d_position_ids."""
        b, s = input_ids.shape
        if past_length == 0 and (image_grid_thw is not None or video_grid_thw is not None):
            types = host(mm_token_type_ids)
            if types is None:
                types = pos.token_types(input_ids, self.config.image_token_id, self.config.video_token_id)
            return pos.rope_index(input_ids, types, host(image_grid_thw), host(video_grid_thw),
                                  host(second_per_grid_ts), host(attention_mask),
                                  spatial_merge_size=self.config.vision_config.spatial_merge_size,
                                  tokens_per_second=self.config.vision_config.tokens_per_second)
        text = np.broadcast_to(np.arange(past_length, past_length + s), (3, b, s))
        if rope_deltas is not None and past_length > 0:
            return text + np.asarray(rope_deltas)[None], rope_deltas
        return np.ascontiguousarray(text), None


def towered(grid: np.ndarray, copies: int, name: str) -> np.ndarray:
    """The grids the tower runs on: the first 1 / ``copies`` of ``grid`` (a preference pair's
    sequences share their prompt's media: mm_data.vl.pairs lists the rejected sequences' grids
    again after the chosen ones', and gives the pixels once)."""
    if copies < 1 or len(grid) % copies:
        raise ValueError(f"media_copies={copies} does not divide the {len(grid)} {name} grids")
    return grid[:len(grid) // copies]


def place_rows(shape, parts, base=None):
    """(batch, seq, hidden): the rows of ``base`` (zeros if None) with the flat positions of each
    part (positions, features) replaced by the features, in one gather; positions that outnumber
    the features take them over again in order (`media_copies`: the backward adds each copy's
    gradient to its feature)."""
    b, s, hidden = shape
    if not parts and base is not None:
        return base
    if base is None:
        rows, index = [zeros((1, hidden), parts[0][1].dtype)], np.zeros(b * s, np.int64)
    else:
        rows, index = [base.reshape(b * s, hidden)], np.arange(b * s)
    offset = rows[0].shape[0]
    for slots, features in parts:
        rows.append(features.astype(rows[0].dtype))
        index[slots] = offset + np.arange(len(slots)) % features.shape[0]
        offset += features.shape[0]
    return ops.gather(ops.concat(rows, 0), Tensor(index.astype(np.int32)), 0).reshape(b, s, hidden)


@dataclass
class SequencePlan:
    """Host-computed inputs of the decoder for this rank's part of the sequence."""
    cos: Tensor
    sin: Tensor
    key_padding_mask: Optional[Tensor]
    targets: Optional[Tensor]  # next-token targets (-100: not counted), split like the sequence
    count: int  # targets counted over the whole sequence (the loss divides by it)
    rope_deltas: Optional[np.ndarray]
    token_mask: Optional[np.ndarray] = None  # the attention mask of this rank's tokens (MoE statistics)
    # a packed row's sample numbers, whole under cp: host data (the attention reads them on the host,
    # and a device copy would be read back at every layer: a wait per call on Ascend)
    segment_ids: Optional[np.ndarray] = None
    weights: Optional[Tensor] = None  # per-target loss weights (loss_per_sample), split like the targets
    # each target's sequence (a packed row's samples, or the batch's rows; -1: none), split like the
    # targets, on the host; and how many sequences there are (sequence_log_probs)
    sequences: Optional[np.ndarray] = None
    sequence_count: int = 0


def _broadcast(array, shape):
    """A (1, seq) host array as ``shape`` (a packed row seen as a batch of its samples), or None."""
    return None if array is None else np.broadcast_to(host(array), shape)


def next_token_targets(labels: np.ndarray, segments: Optional[np.ndarray]) -> np.ndarray:
    """Each position's next-token target: the labels shifted before any split, -100 at the end
    and where a packed row's next token is another sample's."""
    shifted = np.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    return shifted if segments is None else packed_rows.cut_at_boundaries(shifted, segments)


def right_padded(mask) -> bool:
    """A (batch, seq) mask whose rows are ones then zeros (the collator's right padding)."""
    mask = np.asarray(mask).astype(bool)
    return bool(np.all(mask[:, :-1] >= mask[:, 1:]))


class Qwen2_5_VLForConditionalGeneration(ParallelModel):
    """Qwen2.5-VL with its language-model head; see the module docstring.

    Under pipeline parallelism the object holds one virtual stage (mm_parallel.model_base): the
    first holds the vision tower and embedding, the last the final norm and head. Layers are cut
    evenly or by ``pipeline_num_layers`` (see mm_parallel.pipeline.stage_layer_ranges).
    """

    layer_prefix = "model.language_model.layers."
    hf_config_name = "Qwen2_5_VLConfig"  # transformers' config class
    base_model_class = Qwen2_5_VLModel
    # the micro-batch keys a pipeline stage's sequence plan / first stage's embeddings read
    plan_keys = ("input_ids", "attention_mask", "position_ids", "labels", "image_grid_thw", "video_grid_thw",
                 "mm_token_type_ids", "second_per_grid_ts", "num_items_in_batch", "loss_per_sample")
    embed_keys = ("input_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                  "media_copies")

    def __init__(self, config, topology: Optional[Topology] = None, chunk: int = 0, pipeline_num_layers=None):
        super().__init__()
        self.config = config = hf_config(config, self.hf_config_name)
        layers = self.build_stage(topology, chunk, config.text_config.num_hidden_layers, pipeline_num_layers)
        if config.tie_word_embeddings and not (self.is_first and self.is_last):
            raise ValueError("tie_word_embeddings with pipeline parallelism is not supported yet: the embedding "
                             "and the head live on different stages; use pp=1 for this checkpoint")
        self.model = self.base_model_class(config, self.topology, layers.start, layers.stop, self.is_first,
                                           self.is_last)
        self.lm_head = lm_head(config.text_config, self.topology) if self.is_last else None
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

    # -- Hugging Face folders (mm_parallel.model_base) ---------------------------------------------

    @classmethod
    def load_config(cls, config, overrides=None):
        """transformers' config; an override goes to text_config when only text_config has the key."""
        config = hf_config(config, cls.hf_config_name)
        for key, value in (overrides or {}).items():
            target = config.text_config if hasattr(config.text_config, key) and not hasattr(config, key) else config
            setattr(target, key, value)
        return config

    def write_config(self, path, dtype: str = "float32") -> None:
        self.config.dtype = dtype  # what transformers' save_pretrained records
        self.config.save_pretrained(path)

    def disk_names(self, name: str):
        """The released checkpoints' layout (``model.layers.*``, ``visual.*``) first, then
        transformers 5's module names: both are found in the wild and transformers reads both."""
        return (disk_name(name), name) if disk_name(name) != name else (name,)

    def flops(self, batch: dict) -> float:
        """Forward FLOPs per sample of a micro-batch (mm_models_vl.qwen2_5_vl.flops)."""
        from mm_models_vl.qwen2_5_vl.flops import batch_flops

        return batch_flops(self.config, batch)

    # -- host side ---------------------------------------------------------------------------

    def sequence_plan(self, input_ids, attention_mask=None, position_ids=None, labels=None, image_grid_thw=None,
                      video_grid_thw=None, mm_token_type_ids=None, second_per_grid_ts=None, past_length: int = 0,
                      rope_deltas=None, split: bool = True, num_items_in_batch=None,
                      loss_per_sample: bool = False) -> SequencePlan:
        """Rotary tables, padding mask or packed segments, targets and their weights, cut to this
        rank's part of the sequence (a packed row: `mm_models_vl.qwen2_5_vl.packed_rows`)."""
        ids = host(input_ids, np.int64)
        mask = host(attention_mask)
        segments = packed_rows.row_segments(mask)
        if position_ids is None and segments is not None:  # each sample's own, as transformers gives it alone
            position_ids = packed_rows.per_sample_positions(
                lambda masks: self.model.position_ids(np.broadcast_to(ids, masks.shape), masks, image_grid_thw,
                                                      video_grid_thw, second_per_grid_ts,
                                                      _broadcast(mm_token_type_ids, masks.shape))[0], segments)
        elif position_ids is None:
            position_ids, rope_deltas = self.model.position_ids(
                ids, attention_mask, image_grid_thw, video_grid_thw, second_per_grid_ts, mm_token_type_ids,
                past_length, rope_deltas)
        return self.plan_from_positions(ids, mask, segments, position_ids, labels, rope_deltas, split,
                                        num_items_in_batch, loss_per_sample, past_length)

    def plan_from_positions(self, ids, mask, segments, position_ids, labels, rope_deltas, split: bool,
                            num_items_in_batch, loss_per_sample: bool, past_length: int = 0) -> SequencePlan:
        """The rest of `sequence_plan` once the positions are known."""
        position_ids = host(position_ids, np.int64)
        if position_ids.ndim == 2:
            position_ids = np.broadcast_to(position_ids, (3,) + position_ids.shape)
        cos, sin = (Tensor(table) for table in self.rotary_tables(position_ids))
        # float, not bool: a recomputed layer differentiates its inputs, and MindSpore 2.7.2 fails on bool ones
        padded = segments is None and mask is not None and not mask.all()
        key_padding_mask = Tensor(mask.astype(np.float32)) if padded else None
        segment_ids = segments
        shifted = None if labels is None else next_token_targets(host(labels, np.int64), segments)
        targets, weights, count = self.targets_of(shifted, segments, num_items_in_batch, loss_per_sample)
        sequences, sequence_count = (None, 0) if shifted is None else packed_rows.sequence_numbers(shifted, segments)
        topo = self.topology
        if split and topo.cp.size > 1:
            if key_padding_mask is not None and right_padded(mask):
                key_padding_mask = None  # positions are set; causal attention keeps real tokens off the end pads
            if key_padding_mask is not None or past_length:
                raise ValueError("with cp > 1 give full or right-padded sequences and no key/value cache")
            cos, sin = split_sequence(cos, 1, topo), split_sequence(sin, 1, topo)
            targets = None if targets is None else split_sequence(targets, 1, topo)
            weights = None if weights is None else split_sequence(weights, 1, topo)
            if sequences is not None:  # the targets' positions on this rank (no tp chunk: the logits are whole)
                sequences = sequences[:, self.local_positions(sequences.shape[1], sequence_parallel=False)]
        token_mask = None
        if segments is not None and not segments.all():  # a packed row's end padding: this rank's tokens
            token_mask = (segments > 0).astype(np.int64)
            token_mask = token_mask[:, self.local_positions(token_mask.shape[1])] if split else token_mask
        elif key_padding_mask is not None:
            token_mask = mask[:, mask.shape[1] - ids.shape[1]:]  # a cached step's mask covers the cache too
            if split and topo.config.sequence_parallel and topo.tp.size > 1:  # this rank's chunk, as enter_sequence
                chunk = mask.shape[1] // topo.tp.size
                token_mask = mask[:, topo.tp.rank * chunk:(topo.tp.rank + 1) * chunk]
        return SequencePlan(cos, sin, key_padding_mask, targets, count, rope_deltas, token_mask, segment_ids,
                            weights, sequences, sequence_count)

    def loss_items(self, batch: dict, per_sample: bool = False) -> int:
        """What a micro-batch (forward keywords) adds to ``num_items_in_batch``: the targets its
        loss counts, or with ``per_sample`` the samples that have one (mm_train.loss_share)."""
        segments = packed_rows.row_segments(host(batch.get("attention_mask")))
        return self.loss_targets(batch.get("labels"), segments, None, per_sample)[2]

    @staticmethod
    def loss_targets(labels, segments, num_items_in_batch, loss_per_sample: bool):
        """(next-token targets, their weights or None, the loss's divisor) of the whole sequence:
        labels shifted before any split, -100 where a packed row's next token is another
        sample's; the divisor is ``num_items_in_batch`` when given, else the counted targets (or,
        with ``loss_per_sample``, the samples that have one) — transformers' ForCausalLMLoss."""
        shifted = None if labels is None else next_token_targets(host(labels, np.int64), segments)
        return Qwen2_5_VLForConditionalGeneration.targets_of(shifted, segments, num_items_in_batch, loss_per_sample)

    @staticmethod
    def targets_of(shifted, segments, num_items_in_batch, loss_per_sample: bool):
        """`loss_targets` from the next-token targets (`next_token_targets`) already made."""
        if shifted is None:
            return None, None, 0
        weights, count = None, int((shifted != -100).sum())
        if loss_per_sample:
            samples = segments if segments is not None else np.broadcast_to(np.arange(len(shifted))[:, None],
                                                                            shifted.shape)
            weights, count = packed_rows.sample_weights(shifted, samples)
            weights = Tensor(weights)
        if num_items_in_batch is not None:
            count = float(host(num_items_in_batch, np.float64))
        return Tensor(shifted.astype(np.int32)), weights, count

    def rotary_tables(self, position_ids: np.ndarray):
        """(cos, sin) numpy tables (batch, seq, head_dim) of (3, batch, seq) positions: M-RoPE."""
        text = self.config.text_config
        head_dim = text.hidden_size // text.num_attention_heads
        return pos.mrope_cos_sin(position_ids, head_dim, text.rope_parameters["rope_theta"],
                                 text.rope_parameters.get("mrope_section", [16, 24, 24]))

    def embed(self, input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
              video_grid_thw=None, media_copies=None):
        """Embeddings with the vision features in place, cut to this rank's part of the sequence:
        the context-parallel split over cp, then the sequence-parallel chunk over tp."""
        embeds = self.model.inputs_embeds(host(input_ids, np.int64), pixel_values, image_grid_thw,
                                          pixel_values_videos, video_grid_thw, media_copies or 1)
        return self.enter_sequence(embeds, 1)

    def embed_tokens(self, input_ids):
        """A cached decoding step's embeddings: its tokens as text, a generated placeholder id
        included (transformers embeds it as any token when no media come with the step)."""
        return self.enter_sequence(self.model.language_model.embed(Tensor(host(input_ids, np.int64).astype(np.int32))))

    # -- forward -----------------------------------------------------------------------------

    def construct(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                  labels=None, use_cache: bool = False, pixel_values=None, pixel_values_videos=None,
                  image_grid_thw=None, video_grid_thw=None, mm_token_type_ids=None, second_per_grid_ts=None,
                  rope_deltas=None, num_items_in_batch=None, loss_per_sample: bool = False, preference=None,
                  media_copies=None, **unused: Any):
        ids, cache = self.forward_inputs(input_ids, past_key_values, use_cache, unused)
        plan = self.sequence_plan(ids, attention_mask, position_ids, labels, image_grid_thw, video_grid_thw,
                                  mm_token_type_ids, second_per_grid_ts, cache.length() if cache else 0, rope_deltas,
                                  num_items_in_batch=num_items_in_batch, loss_per_sample=loss_per_sample)
        embeds = self.embed(ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, media_copies)
        hidden = self.model.language_model(embeds, plan.cos, plan.sin, plan.key_padding_mask, cache, plan.segment_ids)
        logits = self.lm_head(hidden)
        loss = None if plan.targets is None else self.loss(logits, plan, preference)
        return self.forward_output(loss, logits, cache, plan)

    def forward_inputs(self, input_ids, past_key_values, use_cache: bool, unused: dict):
        """(input_ids on the host as (batch, seq) int64, the key/value cache or None), checked."""
        if unused:
            raise TypeError(f"unexpected forward arguments: {sorted(unused)}")
        self.require_whole_model()
        ids = host(input_ids, np.int64)
        if ids is None or ids.ndim != 2:
            raise ValueError("input_ids must be given as (batch, seq)")
        return ids, past_key_values if past_key_values is not None else (KVCache() if use_cache else None)

    def forward_output(self, loss, logits, cache, plan: SequencePlan, aux_loss=None) -> CausalLMOutput:
        """The forward's output, logits gathered over the vocabulary under tp."""
        if self.topology.tp.size > 1:
            logits = mappings.gather_from_region(logits, self.topology.tp, -1)
        return CausalLMOutput(loss=loss, logits=logits, past_key_values=cache, rope_deltas=plan.rope_deltas,
                              aux_loss=aux_loss)

    def plan_args(self, batch: dict) -> dict:
        """The sequence plan's keywords from a micro-batch's forward keywords."""
        return {k: batch[k] for k in self.plan_keys if k in batch}

    def pipeline_stage(self, x, batch: dict):
        """This virtual stage's forward for mm_parallel.pipeline (``with_batch=True``): ``batch`` is
        the micro-batch's forward keywords, ``x`` the previous stage's output (ignored on the first).
        Returns hidden states, or on the last stage the logits (split on the vocabulary under tp).
        Decoding (mm_parallel.decoding) adds this stage's ``past_key_values`` and ``logits_to_keep``."""
        cache = batch.get("past_key_values")
        plan = self.sequence_plan(**self.plan_args(batch), past_length=cache.length() if cache else 0)
        if self.is_first:
            x = self.first_stage_embed(batch) if not (cache and cache.length()) else \
                self.embed_tokens(batch["input_ids"])
        x = self.model.language_model(x, plan.cos, plan.sin, plan.key_padding_mask, cache, plan.segment_ids)
        return self.lm_head(last_positions(x, batch.get("logits_to_keep"))) if self.is_last else x

    def first_stage_embed(self, batch: dict):
        """The first stage's embeddings of a micro-batch; a frozen tower's output is kept in the
        micro-batch (``TOWER_MEMO``) the first time, so the stage's forward run again in its
        backward does not run the tower again (Qwen2_5_VLModel.run_tower)."""
        self.model.tower_memo = batch.setdefault(TOWER_MEMO, {})
        try:
            return self.embed(**{k: batch.get(k) for k in self.embed_keys})
        finally:
            self.model.tower_memo = None

    def pipeline_loss(self, logits, batch: dict):
        """The last stage's loss of a micro-batch (the schedule averages over micro-batches)."""
        plan = self.sequence_plan(**self.plan_args(batch))
        return self.loss(logits, plan, batch.get("preference"))

    def loss(self, logits, plan: SequencePlan, preference=None):
        """Next-token cross entropy summed over the targets != -100 (each times its weight with
        ``loss_per_sample``) and divided by the plan's count (transformers' ForCausalLMLoss with
        num_items_in_batch); under cp the ranks' parts are summed (ParallelModel.reduce_loss_over_cp).
        With ``preference`` (an objective's micro-batch: mm_parallel.preference.PairedBatch, the
        pairs' loss on the sequences' log-probabilities; mm_parallel.grpo.PolicyBatch, GRPO's on the
        tokens') its ``model_loss`` instead."""
        if preference is not None:
            return preference.model_loss(self, logits, plan)
        group = self.topology.tp
        if plan.weights is None:
            total = vocab_parallel_cross_entropy(logits, plan.targets, group, reduction="sum")
        else:
            total = (vocab_parallel_cross_entropy(logits, plan.targets, group, reduction="none") * plan.weights).sum()
        return self.reduce_loss_over_cp(total / (plan.count if plan.count > 0 else 1))

    def token_log_probs(self, logits, plan: SequencePlan, temperature: float = 1.0):
        """(batch, this rank's positions) float32 log-probabilities of each counted next-token
        target under softmax(logits / temperature), 0 where there is none (the vocabulary split
        over tp; GRPO's per-token terms, mm_parallel.grpo)."""
        logits = logits if temperature == 1.0 else logits / temperature
        token = -vocab_parallel_cross_entropy(logits, plan.targets, self.topology.tp, reduction="none")
        return token if token.dtype == ms.float32 else token.astype(ms.float32)

    def target_part(self, array: np.ndarray) -> np.ndarray:
        """A (batch, seq) host array over the whole sequence's targets cut to this rank's positions
        (its context-parallel part; the logits are whole over sp)."""
        if self.topology.cp.size == 1:
            return np.asarray(array)
        return np.asarray(array)[:, self.local_positions(np.shape(array)[1], sequence_parallel=False)]

    def sequence_log_probs(self, logits, plan: SequencePlan):
        """(plan.sequence_count,) float32: each sequence's summed log-probabilities of its counted
        next-token targets, the whole sequence's under cp (mm_parallel.preference: the vocabulary
        split over tp, the sequence over cp)."""
        return sequence_log_probs(self.token_log_probs(logits, plan), plan.sequences, plan.sequence_count,
                                  self.topology.cp)

    def prompt_positions(self, ids: np.ndarray, inputs: dict) -> np.ndarray:
        """(3, batch, seq) positions of a prompt given with ``inputs`` (generate's keywords); a
        left-padded text-only batch counts its real tokens from 0, as transformers' generate."""
        mask = host(inputs.get("attention_mask"))
        if inputs.get("image_grid_thw") is None and inputs.get("video_grid_thw") is None and mask is not None:
            text = np.maximum(np.cumsum(mask, -1) - 1, 0)
            return np.ascontiguousarray(np.broadcast_to(text, (3,) + ids.shape))
        positions, _ = self.model.position_ids(
            ids, mask, inputs.get("image_grid_thw"), inputs.get("video_grid_thw"),
            inputs.get("second_per_grid_ts"), inputs.get("mm_token_type_ids"))
        return positions

    def generate(self, input_ids, max_new_tokens: int = 20, eos_token_id=None, pad_token_id=None,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 num_return_sequences: int = 1, seed: int = 0, **inputs) -> np.ndarray:
        """Prompt + new tokens, as transformers' generate: ``input_ids`` a left-padded batch (with
        its ``attention_mask``), greedy or sampled (``do_sample``, ``temperature``, ``top_k``,
        ``top_p``; the draws seeded by ``seed``, mm_parallel.sampling), ``num_return_sequences``
        completions per prompt, a finished row padded with ``pad_token_id`` (mm_parallel.decoding:
        a key/value cache; this object must hold the whole model).

        As transformers 5.24, each new token's position is the previous token's position + 1 on all
        three M-RoPE axes (not max(position) + 1, which differs after a video whose temporal span is
        longer than its spatial one).
        """
        self.require_whole_model()
        text = self.config.text_config
        if pad_token_id is None:
            pad_token_id = getattr(text, "pad_token_id", None) or 0
        ids = host(input_ids, np.int64)
        out = decoding.decode([self], {**inputs, "input_ids": ids}, max_new_tokens,
                              Sampling(do_sample, temperature, top_k, top_p),
                              decoding.end_tokens(self.config) if eos_token_id is None else
                              np.atleast_1d(eos_token_id).tolist(), pad_token_id,
                              num_return_sequences, seed, topology=self.topology)
        return np.concatenate([np.repeat(ids, num_return_sequences, 0), out.tokens], 1)


def last_positions(hidden, keep):
    """The last ``keep`` positions of (batch, seq, hidden) states (transformers' logits_to_keep; None: all)."""
    return hidden if not keep else hidden[:, hidden.shape[1] - int(keep):]
