"""The Qwen2.5-VL parallel plan: what a training recipe chooses on top of the layout.

The layout itself (tp, sp, cp, pp — they decide parameter shapes and where the sequence is cut)
is fixed when the model is built with a topology; `parallelize` then applies the choices that do
not change shapes:

  recompute  "none" | "full" | "block" (first ``recompute_num_layers`` decoder layers) |
             "selective" (the attention core of every decoder layer); vision blocks (and the
             Qwen2.5-Omni thinker's audio encoder layers) are recomputed too with "full"
  lora       PEFT-style adapters on q/k/v/o/gate/up/down (tensor-parallel aware), everything
             else frozen
  freeze     any of "vision" (the tower without its mergers), "merger" (the merger, and
             Qwen3-VL's DeepStack mergers), "language_model" (decoder, embeddings and head),
             "audio" (the Qwen2.5-Omni thinker's audio tower, projection included): what SFT
             recipes keep fixed

ZeRO (`mm_parallel.DistributedOptimizer`) and data parallelism need nothing from the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from mm_parallel.lora import LoraConfig as BaseLoraConfig
from mm_parallel.lora import apply_lora
from mm_parallel.recompute import apply_recompute
from mm_parallel.recompute import recompute as mark_recompute
from mm_parallel.topology import Topology

FREEZABLE = ("vision", "merger", "language_model", "audio")
MERGERS = ("merger.", "deepstack_merger_list.")  # the tower's projections into the language model
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig(BaseLoraConfig):
    target_modules: List[str] = field(default_factory=lambda: list(LORA_TARGETS))


def _freeze(model, parts: Sequence[str]) -> None:
    unknown = set(parts) - set(FREEZABLE)
    if unknown:
        raise ValueError(f"cannot freeze {sorted(unknown)}; choose among {list(FREEZABLE)}")
    if "audio" in parts and not hasattr(model.model, "audio_tower"):
        raise ValueError(f"cannot freeze 'audio': {type(model).__name__} has no audio tower")
    visual, audio = model.model.visual, getattr(model.model, "audio_tower", None)  # None: not on this stage
    named = [] if visual is None else list(visual.parameters_and_names())
    groups = {
        "audio": [] if audio is None else list(audio.get_parameters()),
        "vision": [p for n, p in named if not n.startswith(MERGERS)],
        "merger": [p for n, p in named if n.startswith(MERGERS)],
        "language_model": list(model.model.language_model.get_parameters()) +
                          ([] if model.lm_head is None else list(model.lm_head.get_parameters())),
    }
    for part in parts:
        for param in groups[part]:
            param.requires_grad = False


def parallelize(model, topology: Optional[Topology] = None, *, recompute: str = "none",
                recompute_num_layers: Optional[int] = None, lora: Optional[LoraConfig] = None,
                freeze: Sequence[str] = ()):
    """Apply recomputation, LoRA and freezing to a Qwen2_5_VLForConditionalGeneration; returns it.

    ``topology``, if given, must be the one the model was built with (the layout decides the
    parameter shapes, so it cannot change after construction)."""
    if topology is not None and topology is not model.topology:
        raise ValueError("parallelize got a topology other than the model's: build the model under the layout "
                         "you want, e.g. Qwen2_5_VLForConditionalGeneration.from_pretrained(path, topology)")
    layers = list(model.model.language_model.layers)
    if layers:
        apply_recompute(layers, recompute, recompute_num_layers)
    if recompute == "full":
        visual, audio = model.model.visual, getattr(model.model, "audio_tower", None)
        blocks = (list(visual.blocks) if visual is not None else []) + (list(audio.layers) if audio is not None else [])
        for block in blocks:
            mark_recompute(block)
    if lora is not None:
        apply_lora(model, lora.target_modules, lora.r, lora.alpha, lora.dropout)
    _freeze(model, freeze)
    return model
