"""The Qwen2.5-Omni family: SFT of the thinker (text out) on LLaMA-Factory data with audio.

Trains as Qwen2.5-VL does (`VLTask`: the sampler, the padding every layout can cut, the
resumable stream, held-out validation) on mm-data's `OmniSFTDataset`: images, videos and audios
(`<audio>` placeholders, 16 kHz Whisper features), with ``data.use_audio_in_video`` each video's
own audio track interleaved with it. The interleaving's clock (position_id_per_seconds,
seconds_per_chunk) is the model's, read from its config. The model is the thinker alone: a
thinker folder, or the whole Qwen2.5-Omni folder as published (its talker and token2wav are
never read), or an inline thinker config for the tiny recipe.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from mm_train.families.vl.data import VLDataSection, write_processing_files
from mm_train.families.vl.generate import generate_answer
from mm_train.families.vl.qwen2_5_vl import VLTask
from mm_train.families.vl.qwen2_5_vl import preflight as vl_preflight
from mm_train.families.vl.qwen2_5_vl import workload as vl_workload
from mm_train.plan.workload import AttentionForm, LayerStack
from mm_train.registry import BuiltinRecipe, FamilySpec, register

# Deferred imports: mm-data, mm-models-vl, transformers (optional: a missing one is named when a run needs
# it).

OMNI_TOKENS = {"image_token_index": "<|IMAGE|>", "video_token_index": "<|VIDEO|>", "audio_token_index": "<|AUDIO|>",
               "vision_start_token_id": "<|vision_bos|>", "vision_end_token_id": "<|vision_eos|>",
               "audio_start_token_id": "<|audio_bos|>", "audio_end_token_id": "<|audio_eos|>"}
WHOLE_MODEL = "qwen2_5_omni"  # a published folder's config.json: the thinker's under thinker_config


def _omni_system() -> str:
    from mm_data.vl import OMNI_SYSTEM

    return OMNI_SYSTEM


@dataclass
class OmniDataSection(VLDataSection):
    """data.kind tiny_omni (the built-in set of pictures and sounds) or llamafactory; the default
    system turn is Qwen2.5-Omni's."""

    kind: str = "tiny_omni"
    samples: int = 192  # tiny_omni only
    system: Optional[str] = field(default_factory=_omni_system)
    use_audio_in_video: bool = False  # each video brings its own audio track, interleaved with it


def thinker_json(config: dict) -> dict:
    """The thinker's part of a config.json (a whole Qwen2.5-Omni's thinker_config, else itself)."""
    return config.get("thinker_config", config) if config.get("model_type") == WHOLE_MODEL else config


def preflight(recipe, config: dict) -> List[str]:
    """Qwen2.5-VL's checks (mm_train.families.vl.qwen2_5_vl.preflight) on the thinker's config."""
    return vl_preflight(recipe, thinker_json(config))


class OmniTask(VLTask):
    """See the module docstring and mm_train.families.vl.qwen2_5_vl.VLTask."""

    processor_class = "Qwen2_5OmniProcessor"
    media_tokens = OMNI_TOKENS
    data_section = OmniDataSection

    @staticmethod
    def config_class() -> type:
        from transformers import Qwen2_5OmniThinkerConfig

        return Qwen2_5OmniThinkerConfig

    @staticmethod
    def dataset_class() -> type:
        from mm_data.vl import OmniSFTDataset

        return OmniSFTDataset

    @staticmethod
    def chat_media():
        from mm_data.vl.template import OMNI_MEDIA

        return OMNI_MEDIA

    @staticmethod
    def audio_settings() -> Dict:
        """The Whisper feature extractor's settings: the hub folder's preprocessor_config.json holds
        them beside the image processor's."""
        from mm_data.audio import WhisperFeatureExtractor

        return WhisperFeatureExtractor().to_dict()

    def dataset_options(self) -> Dict:
        """Videos interleaved with their audio on the model's clock (its config's)."""
        thinker = thinker_json(self.model_json)
        return dict(use_audio_in_video=self.recipe.data.use_audio_in_video,
                    position_id_per_seconds=thinker.get("position_id_per_seconds", 25),
                    seconds_per_chunk=thinker.get("seconds_per_chunk", 2))

    def model_inputs(self, batch: Dict) -> Dict:
        """The batch with the run's use_audio_in_video (the model takes the attention mask under cp:
        TMRoPE needs it; see Qwen2_5OmniThinkerForConditionalGeneration)."""
        return {**batch, "use_audio_in_video": bool(self.recipe.data.use_audio_in_video)}


PLANNED_AUDIO_SECONDS = 30  # the planner's audio per sample: Whisper's window (the features hold up to 300 s)


def workload(recipe, config):
    """The planner's shapes (mm_train.plan.workload): Qwen2.5-VL's sample (data.max_length tokens,
    one picture of data.max_pixels) plus one audio of PLANNED_AUDIO_SECONDS through the audio
    tower (whole on each rank of the first stage; frozen under model.freeze [audio]). Its layers
    see the audio's conv positions (100 feature frames a second, halved), each attending within
    its chunk of n_window positions (mm_parallel's attention runs the chunks as a padded batch)."""
    from mm_models_vl.qwen2_5_omni.flops import audio_flops

    audio = config.audio_config
    frames = PLANNED_AUDIO_SECONDS * 100  # 10 ms hops (the Whisper features')
    positions = (frames - 1) // 2 + 1
    d, ffn = audio.d_model, audio.encoder_ffn_dim
    frozen = "audio" in (recipe.model.freeze or [])
    flops = float(audio_flops(config, [frames]))
    # the reference path keeps 27 d + 6 ffn per position and layer (its exact-gelu MLP: MindSpore's
    # GeLU and the linears' copies), measured by benchmarks/plan_activation_memory.py at 2 and 6
    # layers, ffn 4 d and 8 d (d 128): 7290 and 10300 elements with the scores, 7258 and 10330 here
    stack = LayerStack("audio tower", audio.encoder_layers, positions, d, outside=4 * d, inside=6 * d + 2 * ffn,
                       heads=audio.encoder_attention_heads, keys=min(positions, audio.n_window),
                       reference=27 * d + 6 * ffn, reference_emulated=42 * d, pipelined=False, trained=not frozen,
                       runs_whole=True, flops=flops, output_kept=frozen and not recipe.model.lora)
    vl = vl_workload(recipe, config)
    heads = audio.encoder_attention_heads
    chunks = AttentionForm("audio, chunks", positions, heads, heads, d // heads, segment=min(positions, audio.n_window),
                           split=False)
    return dataclasses.replace(vl, stacks=[stack] + vl.stacks, flops_per_sample=vl.flops_per_sample + flops,
                               attention=[chunks] + vl.attention,
                               frozen_flops=vl.frozen_flops + (flops if frozen else 0.0),
                               notes=[vl.notes[0] + f", one {PLANNED_AUDIO_SECONDS} s audio"] + vl.notes[1:])


SPEC = register(FamilySpec(
    name="qwen2_5_omni",
    description="Qwen2.5-Omni thinker (3B / 7B): SFT on images, videos and audio, LoRA",
    models={"qwen2_5_omni_thinker": "mm_models_vl:Qwen2_5OmniThinkerForConditionalGeneration",
            WHOLE_MODEL: "mm_models_vl:Qwen2_5OmniThinkerForConditionalGeneration"},
    task=OmniTask,
    data_sections={"tiny_omni": OmniDataSection, "llamafactory": OmniDataSection},
    plan="mm_models_vl.qwen2_5_omni.parallel_plan:parallelize",
    lora_config="mm_models_vl.qwen2_5_omni.parallel_plan:LoraConfig",
    extra="vl",
    processing=write_processing_files,
    preflight=preflight,
    workload=workload,
    generate=generate_answer,
    objectives=("sft", "dpo", "grpo"),
    recipes=(
        BuiltinRecipe("qwen2_5_omni_tiny", "qwen2_5_omni_tiny.yaml",
                      "a tiny random Qwen2.5-Omni thinker captions generated pictures and sounds (about a minute)",
                      "1-2 CPU processes"),
        BuiltinRecipe("qwen2_5_omni_7b_sft", "qwen2_5_omni_7b_sft.yaml",
                      "Qwen2.5-Omni-7B thinker SFT on LLaMA-Factory data with audio (PP2 ZeRO-1, bf16)",
                      "1 x 8 Ascend NPUs"),
    ),
))
