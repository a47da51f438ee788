"""The Qwen3-VL families: dense (``qwen3_vl``) and MoE (``qwen3_vl_moe``) vision-language SFT.

Both train as Qwen2.5-VL does (`VLTask`: LLaMA-Factory data through mm-data's `VLSFTDataset`, the
same sampler, padding and resumable stream) with Qwen3-VL's processors: patches of 16, merged
2 x 2 (32-pixel units), mean and std 0.5, and videos sampled by fps whose temporal patches are
each written with their timestamp (``<t seconds>``) in the chat template. The MoE family's
recipes set ``output_router_logits`` so the load-balancing loss trains the routers; the loop logs
their routing (expert imbalance, dropped tokens) and steps aux-free expert biases where configured.
"""

from __future__ import annotations

from mm_train.families.vl.data import VLDataSection, pixel_bounds, write_processing_files
from mm_train.families.vl.generate import generate_answer
from mm_train.families.vl.qwen2_5_vl import VLTask, preflight, workload
from mm_train.registry import BuiltinRecipe, FamilySpec, register

# Deferred imports: mm-data, transformers (optional: a missing one is named when a run needs it).

QWEN3_PROCESSING = dict(patch_size=16, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))


class Qwen3VLTask(VLTask):
    processor_class = "Qwen3VLProcessor"
    processor_options = QWEN3_PROCESSING

    @staticmethod
    def config_class() -> type:
        from transformers import Qwen3VLConfig

        return Qwen3VLConfig

    @classmethod
    def processors(cls, data):
        from mm_data.vl import Qwen2VLImageProcessor, Qwen3VLVideoProcessor

        pixels = pixel_bounds(data)
        return (Qwen2VLImageProcessor(**{**cls.processor_options, **pixels}),
                Qwen3VLVideoProcessor(fps=data.video_fps, **pixels))


class Qwen3VLMoeTask(Qwen3VLTask):
    @staticmethod
    def config_class() -> type:
        from transformers import Qwen3VLMoeConfig

        return Qwen3VLMoeConfig


_COMMON = dict(data_sections={"tiny_vl": VLDataSection, "llamafactory": VLDataSection, "tiny_vl_pairs": VLDataSection,
                             "tiny_vl_colours": VLDataSection},
               plan="mm_models_vl.qwen3_vl.parallel_plan:parallelize",
               lora_config="mm_models_vl.qwen3_vl.parallel_plan:LoraConfig", extra="vl",
               processing=write_processing_files, preflight=preflight, workload=workload, generate=generate_answer,
               objectives=("sft", "dpo", "grpo"))

DENSE = register(FamilySpec(
    name="qwen3_vl",
    description="Qwen3-VL (dense, 2B-32B): vision-language SFT and LoRA",
    models={"qwen3_vl": "mm_models_vl:Qwen3VLForConditionalGeneration"},
    task=Qwen3VLTask,
    recipes=(
        BuiltinRecipe("qwen3_vl_tiny", "qwen3_vl_tiny.yaml",
                      "a tiny random Qwen3-VL captions generated pictures (about a minute)", "1-2 CPU processes"),
        BuiltinRecipe("qwen3_vl_8b_sft", "qwen3_vl_8b_sft.yaml",
                      "Qwen3-VL-8B-Instruct SFT on LLaMA-Factory data (TP2-SP PP2 ZeRO-1, bf16)", "1 x 8 Ascend NPUs"),
    ),
    **_COMMON,
))

MOE = register(FamilySpec(
    name="qwen3_vl_moe",
    description="Qwen3-VL-MoE (30B-A3B, 235B-A22B): vision-language SFT with expert parallelism",
    models={"qwen3_vl_moe": "mm_models_vl:Qwen3VLMoeForConditionalGeneration"},
    task=Qwen3VLMoeTask,
    recipes=(
        BuiltinRecipe("qwen3_vl_moe_tiny", "qwen3_vl_moe_tiny.yaml",
                      "a tiny random Qwen3-VL-MoE (4 experts) captions generated pictures", "1-2 CPU processes"),
        BuiltinRecipe("qwen3_vl_30b_a3b_sft", "qwen3_vl_30b_a3b_sft.yaml",
                      "Qwen3-VL-30B-A3B-Instruct SFT (TP2-SP PP4 EP2, bf16)", "2 x 8 Ascend NPUs"),
        BuiltinRecipe("qwen3_vl_30b_a3b_zero3", "qwen3_vl_30b_a3b_zero3.yaml",
                      "Qwen3-VL-30B-A3B-Instruct SFT with ZeRO-3, experts cut over expert-dp (EP8, no TP / PP)",
                      "2 x 8 Ascend NPUs"),
    ),
    **_COMMON,
))
