"""The CogVideoX family: video DiT pre-training and LoRA (1.0 / 1.5, T2V / I2V) on v-prediction.

`CogVideoXTask` supplies the model (CogVideoXTransformer3DModel from a diffusers folder or an
inline config; the plan's recompute and LoRA) and the data (`cogvideox_data.CogVideoXTrainData`:
the video pipeline of the Wan family with CogVideoX's VAE and T5 encoder, a feature cache or
clips encoded every step, turned into v-prediction micro-batches with the pipeline's rotary
tables). The version and task come from the model's config: 1.5 has patch_size_t, I2V takes
twice the latent channels in (the noisy latents, then the image condition) and 1.5 I2V an ofs
embedding. The model's ``loss`` is mean((out - v)^2), the training scripts' weighted x0 loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

from mm_train.families.video import tiny as tiny_video
from mm_train.families.video.cogvideox_data import CogVideoXTrainData
from mm_train.families.video.data import clip_shape, objective_problems
from mm_train.families.video.encoders import online_encoder_configs
from mm_train.families.video.generate import generate_video
from mm_train.families.video.samples import CogVideoXSampler
from mm_train.families.video.task import VideoTask
from mm_train.families.video.wan import VideoDataSection, video_source_problems
from mm_train.plan.workload import AttentionForm, LayerStack, Workload
from mm_train.preflight import attention_rules, layer_rules
from mm_train.registry import BuiltinRecipe, FamilySpec, register

# Deferred imports: mm-data, mm-models-video (optional: a missing one is named when a run needs it).


@dataclass
class CogVideoXDiffusionSection:
    """CogVideoX's schedule (mm_models_video.cogvideox.objective; the checkpoints' scheduler_config:
    snr_shift_scale 3.0 for the 2B, 1.0 for the 5B models)."""

    num_train_timesteps: int = 1000
    snr_shift_scale: float = 3.0
    rescale_betas_zero_snr: bool = True
    # I2V (diffusers' CogVideoX I2V training script): the first frame gets noise of log sigma ~
    # N(image_noise_mean, image_noise_std^2) before the VAE; its condition is zeroed with this probability
    image_noise_mean: float = -3.0
    image_noise_std: float = 0.5
    noised_image_dropout: float = 0.05

    def __post_init__(self):
        if self.snr_shift_scale <= 0:
            raise ValueError(f"diffusion.snr_shift_scale must be positive, got {self.snr_shift_scale}")
        if not 0.0 <= self.noised_image_dropout <= 1.0:
            raise ValueError(f"diffusion.noised_image_dropout is a probability, got {self.noised_image_dropout}")
        if self.image_noise_std < 0:
            raise ValueError(f"diffusion.image_noise_std must be >= 0, got {self.image_noise_std}")


def preflight(recipe, config: dict) -> List[str]:
    """CogVideoX: the annotations or the feature cache there; the heads against tp and Ulysses,
    the blocks against the pipeline stages (`mm_train.preflight`; the MLP, 4 x the width, splits
    wherever the heads do)."""
    problems = video_source_problems(recipe.data) + objective_problems(recipe)
    attention_rules(problems, "", config.get("num_attention_heads"), None, recipe.parallel)
    layer_rules(problems, "num_layers", config.get("num_layers"), recipe.parallel)
    return problems


def workload(recipe, config):
    """The planner's shapes (mm_train.plan.workload) of the largest clip (`data.clip_shape`):
    num_frames frames of its height x width through the VAE's 4 x 8 x 8 compression (1.5: latent
    frames padded to whole temporal patches) and the patches, joined by the text tokens: every
    block runs over text + video rows. With data.online the VAE encoder and T5 run every step."""
    from mm_models_video.cogvideox.conditioning import patch_frames
    from mm_models_video.cogvideox.flops import cogvideox_flops, vae_encode_flops
    from mm_models_video.encoders.t5 import t5_encoder_flops

    shape = clip_shape(recipe.data, read_cache=True)
    frames = patch_frames((shape["num_frames"] - 1) // 4 + 1, config.patch_size_t)
    pt, p = config.patch_size_t or 1, config.patch_size
    height, width = shape["height"] // 8, shape["width"] // 8  # latent pixels
    tokens, text = frames // pt * (height // p) * (width // p), shape["text_length"]
    h = config.inner_dim
    # per block: two LayerNorm-zero inputs and outputs and two gated residual inputs outside the
    # tp-split linears; q, k, v, their norms and rotations, the attention output and the 4 h MLP's
    # two intermediates inside. The reference kernels keep 60 h (emulated bf16 28 h more), set from
    # Wan's and checked by benchmarks/plan_activation_memory.py: within 14 % (fp32 / bf16, recompute
    # none / full) at 2,368 rows, 8.6 % in another shape
    stack = LayerStack("DiT", config.num_layers, text + tokens, h, outside=6 * h, inside=16 * h,
                       heads=config.num_attention_heads, keys=text + tokens, reference=60 * h,
                       reference_emulated=28 * h)
    flops = cogvideox_flops(config, frames, height, width, text)
    notes = [f"{shape['num_frames']} frames of {shape['height']} x {shape['width']}: {tokens} video tokens + {text} "
             "text rows"]
    encoder = 0.0
    if recipe.data.online and recipe.data.kind != "video_features":
        vae, t5, note = online_encoder_configs(recipe.data, tiny_video.COGVIDEOX_VAE_CONFIG, "CogVideoX-5B")
        encoder = float(vae_encode_flops(vae, shape["num_frames"], shape["height"], shape["width"]) +
                        t5_encoder_flops(t5, text))
        notes += [note] if note else []
    heads = config.num_attention_heads
    joint = AttentionForm("DiT joint text + video attention", text + tokens, heads, heads, config.attention_head_dim)
    return Workload([stack], float(flops), tokens, boundary_hidden=h, encoder_flops=encoder, notes=notes,
                    attention=[joint])


class CogVideoXTask(VideoTask):
    """See the module docstring and mm_train.task."""

    clip_sampler = CogVideoXSampler

    def __init__(self, recipe, topo):
        from mm_data import Collator
        from mm_models_video import CogVideoXTransformerConfig

        super().__init__(recipe, topo)
        self.config = CogVideoXTransformerConfig.from_dict(self.model_json)
        c = self.config
        if c.in_channels not in (c.out_channels, 2 * c.out_channels):
            raise ValueError(f"in_channels {c.in_channels} with out_channels {c.out_channels}: a CogVideoX model takes "
                             "its latents (T2V: in = out) or latents and the image condition (I2V: in = 2 x out)")
        if c.ofs_embed_dim and c.in_channels == c.out_channels:
            raise ValueError("ofs_embed_dim is CogVideoX 1.5 I2V's: a T2V model (in_channels = out_channels) has none")
        self.data = CogVideoXTrainData(recipe, topo, self.config)
        self.dataset, self.sampler, self.collate = self.data.dataset, self.data.sampler, Collator()

    def tokens(self, batch: Dict) -> int:
        """Video tokens of a micro-batch (the text's are not counted)."""
        samples, frames, _, height, width = batch["hidden_states"].shape
        p = self.config.patch_size
        return samples * frames // (self.config.patch_size_t or 1) * (height // p) * (width // p)


_TINY, _NODE = "1-2 CPU processes", "1 x 8 Ascend NPUs"

SPEC = register(FamilySpec(
    objectives=("pretrain", "dpo"),
    name="cogvideox",
    description="CogVideoX (1.0, 1.5): text- and image-to-video DiT pre-training and LoRA on v-prediction",
    models={"CogVideoXTransformer3DModel": "mm_models_video:CogVideoXTransformer3DModel"},
    task=CogVideoXTask,
    data_sections={"tiny_video": VideoDataSection, "video": VideoDataSection, "video_features": VideoDataSection},
    sections={"diffusion": CogVideoXDiffusionSection},
    plan="mm_models_video.cogvideox.parallel_plan:parallelize",
    lora_config="mm_models_video.cogvideox.parallel_plan:LoraConfig",
    extra="video",
    preflight=preflight,
    workload=workload,
    generate=generate_video,
    recipes=(
        BuiltinRecipe("cogvideox_t2v_tiny", "cogvideox_t2v_tiny.yaml",
                      "a tiny random CogVideoX 1.0 T2V DiT on the built-in clips (feature cache)", _TINY),
        BuiltinRecipe("cogvideox_i2v_tiny", "cogvideox_i2v_tiny.yaml",
                      "a tiny random CogVideoX 1.0 I2V DiT on the built-in clips and their first frames", _TINY),
        BuiltinRecipe("cogvideox1_5_t2v_tiny", "cogvideox1_5_t2v_tiny.yaml",
                      "a tiny random CogVideoX 1.5 T2V DiT (3-D patches) on the built-in clips", _TINY),
        BuiltinRecipe("cogvideox1_5_i2v_tiny", "cogvideox1_5_i2v_tiny.yaml",
                      "a tiny random CogVideoX 1.5 I2V DiT (3-D patches, ofs) on the built-in clips", _TINY),
        BuiltinRecipe("cogvideox_5b_t2v", "cogvideox_5b_t2v.yaml",
                      "CogVideoX-5B T2V pre-training, 49 frames at 480 x 720: TP4 + SP, full recompute, bf16", _NODE),
        BuiltinRecipe("cogvideox1_5_5b_i2v", "cogvideox1_5_5b_i2v.yaml",
                      "CogVideoX1.5-5B I2V pre-training, 37 frames at 480 x 720: TP4 + SP, full recompute, bf16",
                      _NODE),
        BuiltinRecipe("cogvideox1_5_5b_t2v_lora", "cogvideox1_5_5b_t2v_lora.yaml",
                      "CogVideoX1.5-5B T2V LoRA r 128 on the attention projections: DP8, bf16", _NODE),
    ),
))
