"""Video pre-training: a recipe's Wan2.1 DiT (T2V or I2V) on flow matching, run by the shared loop.

`WanTask` supplies the model (WanTransformer3DModel from a diffusers folder or an inline config;
the plan's recompute and LoRA) and the data (`video_data.WanTrainData`: a feature cache of VAE
latents and UMT5 embeddings, flow-matching micro-batches). The model's ``loss`` is diffusers'
flow-matching objective: mean((v_pred - (noise - x0))^2), optionally weighted per sample.
"""

from __future__ import annotations

from typing import Dict, List

from mm_train import loop
from mm_train.recipe import Recipe
from mm_train.video_data import WanTrainData, latent_tokens


class WanTask:
    """See the module docstring and `loop`."""

    def __init__(self, recipe: Recipe, topo):
        from mm_models_video import WanTransformer3DModel

        if recipe.model.freeze:
            raise ValueError("model.freeze is for VL towers; a Wan recipe trains the DiT (use model.lora for adapters)")
        self.recipe, self.topo = recipe, topo
        self.data = WanTrainData(recipe, topo)
        self.model_class = WanTransformer3DModel

    def inline_config(self):
        return dict(self.recipe.model.config)

    @staticmethod
    def lora_config(**options):
        from mm_models_video.wan.parallel_plan import LoraConfig

        return LoraConfig(**options)

    def plan(self, model, lora) -> None:
        from mm_models_video.wan.parallel_plan import parallelize

        spec = self.recipe.model
        parallelize(model, recompute=spec.recompute, recompute_num_layers=spec.recompute_num_layers, lora=lora)
        self.patch_size = tuple(model.config.patch_size)

    def stream(self, first_step: int):
        return self.data.stream(first_step)

    def position(self, step: int) -> dict:
        return self.data.position(step)

    def tokens(self, batch: Dict) -> int:
        return latent_tokens(batch, self.patch_size)

    @staticmethod
    def model_inputs(batch: Dict) -> Dict:
        return batch

    def flops_per_sample(self, config) -> float:
        from mm_profiling.flops import wan_dit_flops

        sample = self.data.first_sample()
        _, frames, height, width = sample["latents"].shape
        image = sample["image_embeds"].shape[0] if "image_embeds" in sample else 0
        return wan_dit_flops(config, frames, height, width, sample["prompt_embeds"].shape[0], image)


def train(recipe: Recipe, progress: bool = True, resume: bool = False) -> List[Dict]:
    """Run a video recipe (see `loop.train`)."""
    return loop.train(recipe, WanTask, progress=progress, resume=resume)
