"""Vision-language SFT: a recipe's Qwen2.5-VL on LLaMA-Factory data, run by the shared loop.

`VLTask` supplies the model (Qwen2.5-VL from a Hugging Face folder, or an inline config with the
tokenizer's vocabulary and special tokens; the plan's recompute, LoRA and freezing) and the data
(`vl_data.VLTrainData`: mm-data's VLSFTDataset in global batches, this rank's micro-batches).
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np

from mm_train import loop
from mm_train.recipe import Recipe
from mm_train.vl_data import VLTrainData


class VLTask:
    """See the module docstring and `loop`."""

    def __init__(self, recipe: Recipe, topo):
        from mm_models_vl import Qwen2_5_VLForConditionalGeneration

        self.recipe, self.topo = recipe, topo
        self.data = VLTrainData(recipe, topo)
        self.model_class = Qwen2_5_VLForConditionalGeneration

    def inline_config(self):
        """The recipe's inline transformers config with the tokenizer's vocabulary and special tokens."""
        from transformers import Qwen2_5_VLConfig

        values = dict(self.recipe.model.config)
        ids = self.data.token_ids()
        values["text_config"] = {**values.get("text_config", {}), "vocab_size": ids["vocab_size"],
                                 "pad_token_id": ids["pad_token_id"], "eos_token_id": ids["eos_token_id"],
                                 "bos_token_id": ids["eos_token_id"]}
        media = {k: v for k, v in ids.items() if k.endswith("token_id") and k not in ("pad_token_id", "eos_token_id")}
        return Qwen2_5_VLConfig(**values, **media, bos_token_id=ids["eos_token_id"], eos_token_id=ids["eos_token_id"],
                                pad_token_id=ids["pad_token_id"])

    @staticmethod
    def lora_config(**options):
        from mm_models_vl.qwen2_5_vl.parallel_plan import LoraConfig

        return LoraConfig(**options)

    def plan(self, model, lora) -> None:
        from mm_models_vl.qwen2_5_vl.parallel_plan import parallelize

        spec = self.recipe.model
        parallelize(model, recompute=spec.recompute, recompute_num_layers=spec.recompute_num_layers, lora=lora,
                    freeze=spec.freeze)

    def stream(self, first_step: int):
        return self.data.stream(first_step)

    def position(self, step: int) -> dict:
        return self.data.position(step)

    @staticmethod
    def tokens(batch: Dict) -> int:
        return int(batch["attention_mask"].sum())

    def model_inputs(self, batch: Dict) -> Dict:
        if self.topo.cp.size > 1:
            # the model takes whole unpadded rows under cp; right padding is harmless without the
            # mask: causal attention keeps real tokens from seeing it and its labels are -100
            return {k: v for k, v in batch.items() if k != "attention_mask"}
        return batch

    def flops_per_sample(self, config) -> float:
        """The FLOPs of the data set's first sample (samples differ in length)."""
        from mm_profiling.flops import qwen2_5_vl_flops

        sample = self.data.dataset.get(0)
        grid = sample.get("image_grid_thw", np.zeros((0, 3), np.int64))
        return qwen2_5_vl_flops(config, len(sample["input_ids"]), grid)


def train(recipe: Recipe, progress: bool = True, resume: bool = False) -> List[Dict]:
    """Run a VL recipe (see `loop.train`)."""
    return loop.train(recipe, VLTask, progress=progress, resume=resume)
