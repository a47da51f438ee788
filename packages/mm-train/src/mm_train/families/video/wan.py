"""The Wan family (2.1 and 2.2): video DiT pre-training (T2V, I2V, TI2V) on flow matching.

`WanTask` supplies the model (WanTransformer3DModel from a diffusers transformer folder or an
inline config; a Wan2.2 pipeline folder's experts as a WanExperts; the plan's recompute and LoRA)
and the data (`video_data.WanTrainData`: a feature cache of VAE latents and UMT5 embeddings — or
clips encoded every step — turned into flow-matching micro-batches; Wan2.2's TI2V first frames and
A14B experts as `wan_pipeline` says). The model's ``loss`` is diffusers' flow-matching objective:
mean((v_pred - (noise - x0))^2), optionally weighted per sample.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional

from mm_train.families.video import tiny as tiny_video
from mm_train.families.video.data import WanTrainData, clip_shape, latent_tokens, objective_problems
from mm_train.families.video.encoders import online_encoder_configs, pipeline_part
from mm_train.families.video.generate import generate_video
from mm_train.families.video.task import VideoTask
from mm_train.families.video.tiny import ENCODER_FIELDS, TINY
from mm_train.families.video.wan_pipeline import EXPERTS, WanPipelineSettings, borrow_missing_experts
from mm_train.plan.workload import AttentionForm, LayerStack, Workload
from mm_train.preflight import attention_rules, layer_rules, require_divisible, require_exists, shard_rules
from mm_train.recipe import DataSection
from mm_train.registry import BuiltinRecipe, FamilySpec, register

# Deferred imports: mm-data, mm-models-video (optional: a missing one is named when a run needs it).


@dataclass
class VideoDataSection(DataSection):
    """data.kind tiny_video (the built-in clips) | video (annotations: data.json / data.txt /
    data.jsonl / videos + labels, encoded by data.vae and data.text_encoder into a feature cache
    and trained from it) | video_features (a ready feature cache at data.path)."""

    kind: str = "tiny_video"
    samples: int = 256  # tiny_video only
    tokenizer: Optional[str] = None  # the text encoder's tokenizer (default: data.text_encoder)
    vae: Optional[str] = None  # a diffusers AutoencoderKLWan folder
    text_encoder: Optional[str] = None  # a transformers UMT5 encoder folder
    image_encoder: Optional[str] = None  # I2V: a transformers CLIP vision folder
    image_processor: Optional[str] = None  # I2V: its preprocessor_config.json folder (default: image_encoder)
    features_dir: Optional[str] = None  # the feature cache (default: output_dir/features)
    # whether features_dir is one folder every node sees (default: checkpoint.shared_fs); false:
    # each node builds its part on its own disk and reads from there (families.video.cache_nodes)
    features_shared_fs: Optional[bool] = None
    num_frames: int = 81  # clip length, 1 + 4n
    fps: float = 16.0
    max_area: int = 480 * 832
    text_max_length: int = 512
    caption_dropout: float = 0.0
    online: bool = False  # encode clips every step (random crops) instead of once into the cache
    # online: the tp x cp ranks sharing micro-batches encode different ones and all-gather the
    # features (families.video.encoder_dp), as MindSpeed-MM's enable_encoder_dp
    encoder_dp: bool = False
    # ranks that encode one clip together while the feature cache is built, each holding 1 / n of
    # its frames' VAE activations (CogVideoX: mm_models_video.cogvideox.vae_context_parallel)
    vae_context_parallel: int = 1

    def __post_init__(self):
        if self.vae_context_parallel < 1:
            raise ValueError(f"data.vae_context_parallel is a number of ranks (>= 1), got {self.vae_context_parallel}")
        if self.encoder_dp and not (self.online and self.kind != "video_features"):
            raise ValueError("data.encoder_dp shares out online encoding (data.online true with data.kind video or "
                             "tiny_video); a feature cache is encoded once: set data.online true or leave encoder_dp "
                             "false")
        if self.format != "json" and self.kind != "video":
            raise ValueError(f"data.format {self.format} reads shards of captioned clips with data.kind video (encoded "
                             "into the feature cache, or online); set data.kind video, or data.format json")
        if self.kind == "video":
            self.require_path("video annotations")
            self.require_encoders()
        if self.kind == "video_features":
            self.require_path("a feature cache folder")

    def require_encoders(self) -> None:
        if not (self.vae and self.text_encoder):
            raise ValueError("data.kind video needs data.vae and data.text_encoder (the encoders of the feature cache)")


@dataclass
class WanVideoDataSection(VideoDataSection):
    """The Wan family's video data: VideoDataSection's (the encoders default to model.path's
    sub-folders when it is a diffusers pipeline folder: the preflight checks they are there), and
    for TI2V models the share of samples trained as image-to-video (wan_pipeline; unset: 0.5)."""

    image_to_video: Optional[float] = None

    def require_encoders(self) -> None:
        """Checked with model.path by the preflight (`video_source_problems`)."""


@dataclass
class DiffusionSection:
    """Flow matching for the video DiTs (mm_models_video.flow_matching); Wan2.2's boundary between
    its experts and TI2V's per-token timesteps default to the model folder's model_index.json."""

    shift: float = 3.0
    num_train_timesteps: int = 1000
    density: str = "uniform"  # uniform | logit_normal | mode
    weighting: str = "none"  # none | sigma_sqrt | cosmap
    boundary_ratio: Optional[float] = None  # A14B: the high-noise expert takes t >= boundary_ratio x 1000
    expand_timesteps: Optional[bool] = None  # TI2V: a timestep per token, the clean first frame's at 0

    def __post_init__(self):
        from_choices = {"density": ("uniform", "logit_normal", "mode"), "weighting": ("none", "sigma_sqrt", "cosmap")}
        for name, choices in from_choices.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"diffusion.{name} {getattr(self, name)!r} is not one of {choices}")


def video_source_problems(data, model_path: Optional[str] = None) -> List[str]:
    """A video data section's annotations or feature cache and its encoder folders (or tiny) exist;
    unset ones default to a pipeline folder's at ``model_path`` (`encoders.encoder_sources`)."""
    problems = []
    if data.kind == "video":
        if data.format == "json":
            require_exists(problems, "data.path", data.path,
                           "video annotations (data.json / .jsonl / .txt or a folder)")
        shard_rules(problems, data)
        for field in ENCODER_FIELDS:
            value = getattr(data, field)
            if value is None and pipeline_part(model_path, field):
                continue
            if value is None and field in ("vae", "text_encoder"):
                problems.append(f"data.{field}: data.kind video encodes the clips with it; give its folder (or tiny), "
                                "or set model.path to a diffusers pipeline folder that has one")
            elif value != TINY:
                require_exists(problems, f"data.{field}", value, "its model folder (or tiny)", True)
    elif data.kind == "video_features":
        require_exists(problems, "data.path", data.path, "a feature cache folder", True)
    return problems


def preflight(recipe, config: dict) -> List[str]:
    """Wan: the annotations or the feature cache and the encoders' folders (or tiny) are there;
    the DiT's heads and FFN against tp and Ulysses, its blocks against the pipeline stages
    (`mm_train.preflight`); Wan2.2's experts and TI2V settings (`wan_pipeline`)."""
    par = recipe.parallel
    problems = video_source_problems(recipe.data, recipe.model.path) + objective_problems(recipe)
    problems += WanPipelineSettings.of(recipe, config).problems(recipe)
    attention_rules(problems, "", config.get("num_attention_heads"), None, par)
    require_divisible(problems, "ffn_dim", config.get("ffn_dim"), "parallel.tp", par.tp)
    layer_rules(problems, "num_layers", config.get("num_layers"), par)
    return problems


class WanTask(VideoTask):
    """See the module docstring and mm_train.task."""

    def __init__(self, recipe, topo):
        from mm_data import Collator

        super().__init__(recipe, topo)
        config = self.model_json
        self.settings = WanPipelineSettings.of(recipe, config)  # the model class is its (choose_model)
        image = config.get("image_dim") is not None  # CLIP features of the first frame (Wan2.1 I2V)
        # the first frame's latents beside the noise (I2V: Wan2.1's and A14B's, which has no CLIP)
        i2v = image or config.get("in_channels", 16) > (config.get("out_channels") or config.get("in_channels", 16))
        self.data = WanTrainData(recipe, topo, i2v=i2v, clip=image, pipeline=self.settings,
                                 patch=config.get("patch_size", (1, 2, 2)))
        self.dataset, self.sampler, self.collate = self.data.dataset, self.data.sampler, Collator()

    def plan(self, model, lora) -> None:
        super().plan(model, lora)
        self.patch_size = tuple(model.config.patch_size)

    @staticmethod
    def prepare_sampling(chunks, recipe) -> None:
        """A one-expert Wan2.2 run samples with the other expert from model.path (wan_pipeline)."""
        borrow_missing_experts(chunks, recipe.model.path)

    def tokens(self, batch: Dict) -> int:
        return latent_tokens(batch, self.patch_size)


def vae_compression(recipe, settings: WanPipelineSettings) -> int:
    """The VAE's spatial compression: its config.json's (data.vae, or model.path's vae/ in a
    pipeline folder), else Wan2.2's 16 for a TI2V model and 8 otherwise (the tiny set's VAEs: 8)."""
    if recipe.data.kind == "tiny_video":
        return 8
    folder = recipe.data.vae if recipe.data.vae not in (None, TINY) else \
        os.path.join(recipe.model.path, "vae") if settings.pipeline is not None else None
    config = os.path.join(folder or "", "config.json")
    if folder and os.path.isfile(config):
        with open(config) as f:
            return int(json.load(f).get("scale_factor_spatial") or 8)
    return 16 if settings.expand_timesteps else 8


def workload(recipe, config):
    """The planner's shapes (mm_train.plan.workload) of the largest clip (`data.clip_shape`):
    num_frames frames of its height x width, through the VAE's 4 x s x s compression (s 8, 16 for
    Wan2.2's VAE: `vae_compression`) and the DiT's patches; each block keeps its self-attention,
    cross-attention to the text tokens and GELU FFN. A Wan2.2 pair of experts runs one expert per
    micro-batch: a sample's FLOPs are one expert's (the memory of both is the model's build)."""
    from mm_models_video.wan.flops import wan_dit_flops

    settings = WanPipelineSettings.of(recipe, recipe.model_source.config_json())
    shape = clip_shape(recipe.data, read_cache=True)
    pt, ph, pw = config.patch_size
    frames = (shape["num_frames"] - 1) // 4 + 1
    s = vae_compression(recipe, settings)
    height, width = shape["height"] // s, shape["width"] // s  # latent pixels
    tokens = (frames // pt) * (height // ph) * (width // pw)
    h = config.num_attention_heads * config.attention_head_dim
    text = shape["text_length"]
    inside = 10 * h + 2 * config.ffn_dim
    # the reference kernels' LayerNorms, modulation, q / k norms and rotary embeddings keep ~47
    # hidden-sized copies more per token and layer, emulated bf16 28 h more (measured with an FFN
    # of 4 h: benchmarks/plan_activation_memory.py)
    stack = LayerStack("DiT", config.num_layers, tokens, h, outside=8 * h, inside=inside,
                       heads=config.num_attention_heads, keys=tokens + text, reference=55 * h + inside,
                       reference_emulated=28 * h)
    flops = wan_dit_flops(config, frames, height, width, text, 257 if config.image_dim else 0)
    note = f"{shape['num_frames']} frames of {shape['height']} x {shape['width']}: {tokens} video tokens per clip"
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    attention = [AttentionForm("DiT self-attention", tokens, heads, heads, head_dim),
                 AttentionForm("DiT cross-attention to the text", tokens, heads, heads, head_dim, keys=text)]
    encoder, notes = _online_encoding(recipe, settings, shape)
    return Workload([stack], float(flops), tokens, boundary_hidden=h, notes=[note, *notes], attention=attention,
                    encoder_flops=encoder)


def _online_encoding(recipe, settings, shape):
    """(FLOPs, notes) of data.online's encoders per sample: the VAE encoder on the clip and UMT5
    on the caption (an I2V model's CLIP image encoder, a few hundred GFLOPs, is not counted)."""
    from mm_models_video.encoders.t5 import t5_encoder_flops
    from mm_models_video.wan.flops import vae_encode_flops

    data = recipe.data
    if not data.online or data.kind == "video_features":
        return 0.0, []
    tiny = tiny_video.VAE22_CONFIG if vae_compression(recipe, settings) == 16 else tiny_video.VAE_CONFIG
    vae, text, note = online_encoder_configs(data, tiny, "Wan", recipe.model.path)
    flops = vae_encode_flops(vae, shape["num_frames"], shape["height"], shape["width"]) + \
        t5_encoder_flops(text, shape["text_length"])
    return float(flops), [note] if note else []


_TINY, _ASCEND = "1-2 CPU processes", "Ascend NPUs"

SPEC = register(FamilySpec(
    objectives=("pretrain", "dpo"),
    experts=EXPERTS,
    choose_model=lambda recipe, config: WanPipelineSettings.of(recipe, config).model_class(),
    name="wan",
    description="Wan2.1 (1.3B, 14B) and Wan2.2 (TI2V-5B, A14B experts): text- and image-to-video DiT pre-training "
                "and LoRA on flow matching",
    models={"WanTransformer3DModel": "mm_models_video:WanTransformer3DModel",
            "WanPipeline": "mm_models_video:WanExperts", "WanImageToVideoPipeline": "mm_models_video:WanExperts"},
    task=WanTask,
    data_sections={"tiny_video": WanVideoDataSection, "video": WanVideoDataSection,
                   "video_features": WanVideoDataSection},
    sections={"diffusion": DiffusionSection},
    plan="mm_models_video.wan.parallel_plan:parallelize",
    lora_config="mm_models_video.wan.parallel_plan:LoraConfig",
    extra="video",
    preflight=preflight,
    workload=workload,
    generate=generate_video,
    recipes=(
        BuiltinRecipe("wan2_1_t2v_tiny", "wan2_1_t2v_tiny.yaml",
                      "a tiny random Wan2.1 T2V DiT on the built-in clips (feature cache)", _TINY),
        BuiltinRecipe("wan2_1_t2v_tiny_dpo", "wan2_1_t2v_tiny_dpo.yaml",
                      "Diffusion-DPO on the tiny Wan2.1 T2V: the built-in clips against clips moving the other way",
                      _TINY),
        BuiltinRecipe("wan2_1_i2v_tiny", "wan2_1_i2v_tiny.yaml",
                      "a tiny random Wan2.1 I2V DiT on the built-in clips and their first frames", _TINY),
        BuiltinRecipe("wan2_2_ti2v_tiny", "wan2_2_ti2v_tiny.yaml",
                      "a tiny random Wan2.2 TI2V DiT: text- and text+image-to-video in one run (Wan2.2's VAE layout)",
                      _TINY),
        BuiltinRecipe("wan2_2_a14b_tiny", "wan2_2_a14b_tiny.yaml",
                      "two tiny random Wan2.2 A14B-style experts switched by noise level, trained together", _TINY),
        BuiltinRecipe("wan2_1_t2v_1_3b", "wan2_1_t2v_1_3b.yaml",
                      "Wan2.1-T2V-1.3B pre-training (CP4 Ulysses, DP2, ZeRO-1)", f"1 x 8 {_ASCEND}"),
        BuiltinRecipe("wan2_1_t2v_1_3b_dpo", "wan2_1_t2v_1_3b_dpo.yaml",
                      "Wan2.1-T2V-1.3B Diffusion-DPO on clip pairs (CP4 Ulysses, DP2, ZeRO-1)", f"1 x 8 {_ASCEND}"),
        BuiltinRecipe("wan2_1_t2v_14b", "wan2_1_t2v_14b.yaml",
                      "Wan2.1-T2V-14B pre-training (TP4-SP CP2 Ulysses, DP2)", f"2 x 8 {_ASCEND}"),
        BuiltinRecipe("wan2_2_ti2v_5b", "wan2_2_ti2v_5b.yaml",
                      "Wan2.2-TI2V-5B pre-training, text- and text+image-to-video (DP8, ZeRO-1)",
                      "1 x 8 Ascend A3 NPUs"),
        BuiltinRecipe("wan2_2_t2v_a14b", "wan2_2_t2v_a14b.yaml",
                      "Wan2.2-T2V-A14B pre-training of one expert (DP16, ZeRO-3)", "1 x 16 Ascend A3 NPUs"),
        BuiltinRecipe("wan2_1_t2v_14b_zero3", "wan2_1_t2v_14b_zero3.yaml",
                      "Wan2.1-T2V-14B pre-training on one node (ZeRO-3, CP8 Ulysses, no TP)", f"1 x 8 {_ASCEND}"),
    ),
))
