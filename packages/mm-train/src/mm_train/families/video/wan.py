"""The Wan2.1 family: video DiT pre-training (T2V, I2V) on flow matching.

`WanTask` supplies the model (WanTransformer3DModel from a diffusers folder or an inline config;
the plan's recompute and LoRA) and the data (`video_data.WanTrainData`: a feature cache of VAE
latents and UMT5 embeddings — or clips encoded every step — turned into flow-matching
micro-batches). The model's ``loss`` is diffusers' flow-matching objective:
mean((v_pred - (noise - x0))^2), optionally weighted per sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from mm_train.families.video.data import WanTrainData, clip_shape, latent_tokens, objective_problems
from mm_train.families.video.generate import generate_video
from mm_train.families.video.task import VideoTask
from mm_train.families.video.tiny import ENCODER_FIELDS, TINY
from mm_train.plan.workload import AttentionForm, LayerStack, Workload
from mm_train.preflight import attention_rules, layer_rules, require_divisible, require_exists
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
    num_frames: int = 81  # clip length, 1 + 4n
    fps: float = 16.0
    max_area: int = 480 * 832
    text_max_length: int = 512
    caption_dropout: float = 0.0
    online: bool = False  # encode clips every step (random crops) instead of once into the cache
    # ranks that encode one clip together while the feature cache is built, each holding 1 / n of
    # its frames' VAE activations (CogVideoX: mm_models_video.cogvideox.vae_context_parallel)
    vae_context_parallel: int = 1

    def __post_init__(self):
        if self.vae_context_parallel < 1:
            raise ValueError(f"data.vae_context_parallel is a number of ranks (>= 1), got {self.vae_context_parallel}")
        if self.kind == "video":
            self.require_path("video annotations")
            if not (self.vae and self.text_encoder):
                raise ValueError("data.kind video needs data.vae and data.text_encoder (the encoders of the "
                                 "feature cache)")
        if self.kind == "video_features":
            self.require_path("a feature cache folder")


@dataclass
class DiffusionSection:
    """Flow matching for the video DiTs (mm_models_video.flow_matching)."""

    shift: float = 3.0
    num_train_timesteps: int = 1000
    density: str = "uniform"  # uniform | logit_normal | mode
    weighting: str = "none"  # none | sigma_sqrt | cosmap

    def __post_init__(self):
        from_choices = {"density": ("uniform", "logit_normal", "mode"), "weighting": ("none", "sigma_sqrt", "cosmap")}
        for name, choices in from_choices.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"diffusion.{name} {getattr(self, name)!r} is not one of {choices}")


def video_source_problems(data) -> List[str]:
    """A video data section's annotations or feature cache and its encoder folders (or tiny) exist."""
    problems = []
    if data.kind == "video":
        require_exists(problems, "data.path", data.path, "video annotations (data.json / .jsonl / .txt or a folder)")
        for field in ENCODER_FIELDS:
            if getattr(data, field) != TINY:
                require_exists(problems, f"data.{field}", getattr(data, field), "its model folder (or tiny)", True)
    elif data.kind == "video_features":
        require_exists(problems, "data.path", data.path, "a feature cache folder", True)
    return problems


def preflight(recipe, config: dict) -> List[str]:
    """Wan2.1: the annotations or the feature cache and the encoders' folders (or tiny) are there;
    the DiT's heads and FFN against tp and Ulysses, its blocks against the pipeline stages
    (`mm_train.preflight`)."""
    par, problems = recipe.parallel, video_source_problems(recipe.data) + objective_problems(recipe)
    attention_rules(problems, "", config.get("num_attention_heads"), None, par)
    require_divisible(problems, "ffn_dim", config.get("ffn_dim"), "parallel.tp", par.tp)
    layer_rules(problems, "num_layers", config.get("num_layers"), par)
    return problems


class WanTask(VideoTask):
    """See the module docstring and mm_train.task."""

    def __init__(self, recipe, topo):
        from mm_data import Collator

        super().__init__(recipe, topo)
        self.data = WanTrainData(recipe, topo, i2v=self.model_json.get("image_dim") is not None)
        self.dataset, self.sampler, self.collate = self.data.dataset, self.data.sampler, Collator()

    def plan(self, model, lora) -> None:
        super().plan(model, lora)
        self.patch_size = tuple(model.config.patch_size)

    def tokens(self, batch: Dict) -> int:
        return latent_tokens(batch, self.patch_size)


def workload(recipe, config):
    """The planner's shapes (mm_train.plan.workload) of the largest clip (`data.clip_shape`):
    num_frames frames of max_area pixels, through the VAE's 4 x 8 x 8 compression and the DiT's
    patches; each block keeps its self-attention, cross-attention to the text tokens and GELU FFN."""
    from mm_models_video.wan.flops import wan_dit_flops

    shape = clip_shape(recipe.data, read_cache=True)
    pt, ph, pw = config.patch_size
    frames = (shape["num_frames"] - 1) // 4 + 1
    side = int((shape["max_area"] / 64) ** 0.5)  # latent pixels a side of a square frame of max_area
    tokens = (frames // pt) * (side // ph) * (side // pw)
    h = config.num_attention_heads * config.attention_head_dim
    text = shape["text_length"]
    inside = 10 * h + 2 * config.ffn_dim
    # the reference kernels' LayerNorms, modulation, q / k norms and rotary embeddings keep ~47
    # hidden-sized copies more per token and layer, emulated bf16 28 h more (measured with an FFN
    # of 4 h: benchmarks/plan_activation_memory.py)
    stack = LayerStack("DiT", config.num_layers, tokens, h, outside=8 * h, inside=inside,
                       heads=config.num_attention_heads, keys=tokens + text, reference=55 * h + inside,
                       reference_emulated=28 * h)
    flops = wan_dit_flops(config, frames, side, side, text, 257 if config.image_dim else 0)
    note = f"{shape['num_frames']} frames of {shape['max_area']} pixels: {tokens} video tokens per clip"
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    attention = [AttentionForm("DiT self-attention", tokens, heads, heads, head_dim),
                 AttentionForm("DiT cross-attention to the text", tokens, heads, heads, head_dim, keys=text)]
    return Workload([stack], float(flops), tokens, boundary_hidden=h, notes=[note], attention=attention)


_TINY, _ASCEND = "1-2 CPU processes", "Ascend NPUs"

SPEC = register(FamilySpec(
    objectives=("pretrain", "dpo"),
    name="wan",
    description="Wan2.1 (1.3B, 14B): text- and image-to-video DiT pre-training and LoRA on flow matching",
    models={"WanTransformer3DModel": "mm_models_video:WanTransformer3DModel"},
    task=WanTask,
    data_sections={"tiny_video": VideoDataSection, "video": VideoDataSection, "video_features": VideoDataSection},
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
        BuiltinRecipe("wan2_1_t2v_1_3b", "wan2_1_t2v_1_3b.yaml",
                      "Wan2.1-T2V-1.3B pre-training (CP4 Ulysses, DP2, ZeRO-1)", f"1 x 8 {_ASCEND}"),
        BuiltinRecipe("wan2_1_t2v_1_3b_dpo", "wan2_1_t2v_1_3b_dpo.yaml",
                      "Wan2.1-T2V-1.3B Diffusion-DPO on clip pairs (CP4 Ulysses, DP2, ZeRO-1)", f"1 x 8 {_ASCEND}"),
        BuiltinRecipe("wan2_1_t2v_14b", "wan2_1_t2v_14b.yaml",
                      "Wan2.1-T2V-14B pre-training (TP4-SP CP2 Ulysses, DP2)", f"2 x 8 {_ASCEND}"),
        BuiltinRecipe("wan2_1_t2v_14b_zero3", "wan2_1_t2v_14b_zero3.yaml",
                      "Wan2.1-T2V-14B pre-training on one node (ZeRO-3, CP8 Ulysses, no TP)", f"1 x 8 {_ASCEND}"),
    ),
))
