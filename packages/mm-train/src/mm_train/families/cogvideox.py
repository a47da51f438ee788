"""The CogVideoX family: video DiT pre-training (1.0 / 1.5 T2V) on v-prediction.

`CogVideoXTask` supplies the model (CogVideoXTransformer3DModel from a diffusers folder or an
inline config; the plan's recompute and LoRA) and the data (`cogvideox_data.CogVideoXTrainData`:
the video pipeline of the Wan family with CogVideoX's VAE and T5 encoder, a feature cache or
clips encoded every step, turned into v-prediction micro-batches with the pipeline's rotary
tables). The model's ``loss`` is mean((out - v)^2), the training scripts' weighted x0 loss.
I2V (image latents beside the noise), the planner's workload and real-size recipes come next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

from mm_train.families import BuiltinRecipe, FamilySpec, register
from mm_train.families.wan import VideoDataSection
from mm_train.video_data import VideoTask


@dataclass
class CogVideoXDiffusionSection:
    """CogVideoX's schedule (mm_models_video.cogvideox.objective; the checkpoints' scheduler_config:
    snr_shift_scale 3.0 for the 2B, 1.0 for the 5B models)."""

    num_train_timesteps: int = 1000
    snr_shift_scale: float = 3.0
    rescale_betas_zero_snr: bool = True

    def __post_init__(self):
        if self.snr_shift_scale <= 0:
            raise ValueError(f"diffusion.snr_shift_scale must be positive, got {self.snr_shift_scale}")


def preflight(recipe, config: dict) -> List[str]:
    """CogVideoX: the annotations or the feature cache there; the heads against tp and Ulysses,
    the blocks against the pipeline stages (`mm_train.preflight`; the MLP, 4 x the width, splits
    wherever the heads do)."""
    from mm_train.families.wan import video_source_problems
    from mm_train.preflight import attention_rules, layer_rules

    problems = video_source_problems(recipe.data)
    attention_rules(problems, "", config.get("num_attention_heads"), None, recipe.parallel)
    layer_rules(problems, "num_layers", config.get("num_layers"), recipe.parallel)
    return problems


class CogVideoXTask(VideoTask):
    """See the module docstring and mm_train.task."""

    def __init__(self, recipe, topo):
        from mm_data import Collator
        from mm_models_video import CogVideoXTransformerConfig
        from mm_train.cogvideox_data import CogVideoXTrainData

        super().__init__(recipe, topo)
        self.config = CogVideoXTransformerConfig.from_dict(self.model_json)
        if self.config.in_channels != self.config.out_channels or self.config.ofs_embed_dim:
            raise ValueError("this CogVideoX model is an I2V one (in_channels != out_channels or ofs_embed_dim): "
                             "only T2V training is there yet")
        self.data = CogVideoXTrainData(recipe, topo, self.config)
        self.dataset, self.sampler, self.collate = self.data.dataset, self.data.sampler, Collator()

    def tokens(self, batch: Dict) -> int:
        """Video tokens of a micro-batch (the text's are not counted)."""
        samples, frames, _, height, width = batch["hidden_states"].shape
        p = self.config.patch_size
        return samples * frames // (self.config.patch_size_t or 1) * (height // p) * (width // p)


SPEC = register(FamilySpec(
    name="cogvideox",
    description="CogVideoX (1.0, 1.5): text-to-video DiT pre-training and LoRA on v-prediction",
    models={"CogVideoXTransformer3DModel": "mm_models_video:CogVideoXTransformer3DModel"},
    task="mm_train.families.cogvideox:CogVideoXTask",
    data_sections={"tiny_video": VideoDataSection, "video": VideoDataSection, "video_features": VideoDataSection},
    sections={"diffusion": CogVideoXDiffusionSection},
    plan="mm_models_video.cogvideox.parallel_plan:parallelize",
    lora_config="mm_models_video.cogvideox.parallel_plan:LoraConfig",
    extra="video",
    preflight="mm_train.families.cogvideox:preflight",
    recipes=(
        BuiltinRecipe("cogvideox_t2v_tiny", "cogvideox_t2v_tiny.yaml",
                      "a tiny random CogVideoX 1.0 T2V DiT on the built-in clips (feature cache)", "1-2 CPU processes"),
    ),
))
