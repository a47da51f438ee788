"""The Qwen2.5-VL family: vision-language SFT on LLaMA-Factory data.

`VLTask` supplies the model (Qwen2.5-VL from a Hugging Face folder, or an inline config with the
tokenizer's vocabulary and special tokens) and the data: mm-data's `VLSFTDataset` from the
recipe's data section (the tiny built-in set is generated first), a `BucketBatchSampler` over
global batches (seed = train.seed) and the shared loader. Step ``s`` is global batch ``s mod B``
of epoch ``s div B`` (B batches an epoch), so the stream is a function of the step: resuming at
any step, under any layout, continues it exactly. Bad samples are replaced by mm-data and
counted; past ``data.max_bad_fraction`` the run stops naming them. Micro-batches are padded to a
length every layout can cut: a multiple of 2 cp (and of tp under sequence parallelism), so the
padding — ignored by the loss — is the same for one process as for the layout.
"""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional

from mm_train.families.vl import samples as vl_samples
from mm_train.families.vl.data import (
    BUILTIN_SETS,
    VLDataSection,
    data_files,
    data_sources,
    pixel_bounds,
    row_budget,
    sequence_multiple,
    vl_tokenizer,
    write_processing_files,
)
from mm_train.families.vl.generate import generate_answer
from mm_train.micro_batches import Prompts
from mm_train.plan.workload import AttentionForm, LayerStack, PackedRow, Workload
from mm_train.preflight import attention_rules, layer_rules, require_divisible, require_exists, shard_rules
from mm_train.registry import BuiltinRecipe, FamilySpec, register
from mm_train.task import FamilyTask, once_on_rank_zero

# Deferred imports: mm-data, mm-models-vl, transformers (optional: a missing one is named when a run needs
# it).

QWEN_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def preflight(recipe, config: dict) -> List[str]:
    """Qwen2.5-VL / Qwen3-VL (dense, MoE): the annotations and the tokenizer are there; the text
    model's heads, FFN, vocabulary (the tokenizer's, rounded up to 64, for an inline config),
    layers and experts against the layout, the vision tower's heads and FFN against tp
    (`mm_train.preflight`)."""
    par, problems, data = recipe.parallel, [], recipe.data
    if data.kind not in BUILTIN_SETS:
        if data.format == "json":
            require_exists(problems, "data.path", data.path, "a LLaMA-Factory JSON / JSONL file")
        shard_rules(problems, data)
        require_exists(problems, "data.dataset_info", data.dataset_info, "LLaMA-Factory's dataset_info.json or its "
                                                                           "folder")
        if data.dataset_info and os.path.exists(data.dataset_info):
            try:  # the names, columns, tags and files it declares, before any process starts
                data_sources(recipe)
            except (OSError, ValueError) as error:
                problems.append(f"data.dataset: {error}")
        require_exists(problems, "data.media_dir", data.media_dir, "the folder the media paths start in", True)
        if not (data.tokenizer or recipe.model.path):
            problems.append("no tokenizer: set data.tokenizer (a model folder or a tokenizer.json) or model.path")
        require_exists(problems, "data.tokenizer", data.tokenizer, "a model folder or a tokenizer.json")
    _budget_rule(problems, data, config.get("vision_config", {}))
    text = {**config, **config.get("text_config", {})}  # hub folders hold the text fields at the top
    attention_rules(problems, "text_config.", text.get("num_attention_heads"), text.get("num_key_value_heads"), par)
    require_divisible(problems, "text_config.intermediate_size", text.get("intermediate_size"), "parallel.tp", par.tp)
    if recipe.model.path:
        require_divisible(problems, "text_config.vocab_size", text.get("vocab_size"), "parallel.tp", par.tp)
    else:
        tokens = _inline_vocabulary(recipe, par.tp)
        require_divisible(problems, f"the vocabulary size (the tokenizer's {tokens} tokens rounded up to 64)",
                          tokens and -(-tokens // 64) * 64, "parallel.tp", par.tp)
    layer_rules(problems, "text_config.num_hidden_layers", text.get("num_hidden_layers"), par)
    require_divisible(problems, "text_config.num_experts", text.get("num_experts"), "parallel.ep", par.ep)
    if text.get("num_experts"):
        require_divisible(problems, "text_config.moe_intermediate_size", text.get("moe_intermediate_size"),
                          "the experts' tp (parallel.expert_tp)", par.expert_tp_size)
    vision = config.get("vision_config", {})
    require_divisible(problems, "vision_config.num_heads", vision.get("num_heads"), "parallel.tp", par.tp)
    require_divisible(problems, "vision_config.intermediate_size", vision.get("intermediate_size"), "parallel.tp",
                      par.tp)
    return problems


def _budget_rule(problems: List[str], data, vision: dict) -> None:
    """A packed row must hold the largest picture a sample may carry (data.max_pixels, else the
    processors' 12,845,056 pixels) when such a sample fits data.max_length."""
    unit = (vision.get("patch_size", 14) * vision.get("spatial_merge_size", 2)) ** 2
    picture = -(-(data.max_pixels or 12845056) // unit)  # merged tokens of the largest picture
    budget = row_budget(data)
    if data.packing and budget < picture <= data.max_length:
        problems.append(f"data.max_tokens={budget} cannot hold a picture of data.max_pixels ({picture} tokens) that "
                        f"samples of data.max_length={data.max_length} may carry: set data.max_tokens >= "
                        f"{data.max_length} (or lower data.max_pixels)")


def _inline_vocabulary(recipe, tp: int) -> Optional[int]:
    """The tokenizer's size, which an inline config's vocabulary rounds up to 64
    (`VLTask.token_ids`); None when tp does not split it or the tokenizer is not written yet (the
    built-in set's is made by the first run; the model checks it then)."""
    _, _, path = data_sources(recipe)
    if tp <= 1 or not path or not os.path.exists(path):
        return None
    return len(vl_tokenizer(path))


class VLTask(FamilyTask):
    """See the module docstring and mm_train.task. A sibling family (Qwen3-VL) changes the class
    attributes: its transformers config class and its processors' settings."""

    processor_class = "Qwen2_5_VLProcessor"  # what a saved folder's preprocessor_config.json names
    processor_options: Dict = {}  # patch size, mean / std ... of both processors (defaults: Qwen2-VL's)
    data_section = VLDataSection  # a Hugging Face folder's answers use its defaults
    media_tokens = dict(zip(("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"),
                            QWEN_TOKENS))  # an inline config's token-id fields and their tokens

    # transformers and mm-data are extras: the classes below are imported when a run asks for them

    @staticmethod
    def config_class() -> type:
        """The transformers config class of an inline model config."""
        from transformers import Qwen2_5_VLConfig

        return Qwen2_5_VLConfig

    @staticmethod
    def dataset_class() -> type:
        """What encodes training samples and prompts."""
        from mm_data.vl import VLSFTDataset

        return VLSFTDataset

    @staticmethod
    def chat_media():
        """The chat template's media tokens."""
        from mm_data.vl.template import QWEN_MEDIA

        return QWEN_MEDIA

    @staticmethod
    def audio_settings() -> Dict:
        """What preprocessor_config.json holds beside the image processor's (Omni: its feature extractor)."""
        return {}

    @classmethod
    def processors(cls, data):
        """(image processor, video processor) with the data section's pixel bounds."""
        from mm_data.vl import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

        options = {**cls.processor_options, **pixel_bounds(data)}
        return Qwen2VLImageProcessor(**options), Qwen2VLVideoProcessor(**options)

    def __init__(self, recipe, topo):
        from mm_data import BucketBatchSampler

        super().__init__(recipe, topo)
        data, train = recipe.data, recipe.train
        if data.kind in BUILTIN_SETS:  # the set exists before anyone reads it
            once_on_rank_zero(topo, lambda: BUILTIN_SETS[data.kind].generate(data_sources(recipe)[0], data.samples))
        _, annotations, tokenizer_path = data_sources(recipe)
        self.annotations = annotations
        self.tokenizer = vl_tokenizer(tokenizer_path)
        self.dataset = self.read_dataset(annotations)
        self.sampler = BucketBatchSampler(len(self.dataset), train.global_batch_size, topo.dp.rank, topo.dp.size,
                                          seed=train.seed, indices=self.training_indices(len(self.dataset)),
                                          costs=self.dataset.costs if data.packing else None,
                                          global_batch_tokens=train.global_batch_tokens,
                                          blocks=self.dataset.shards and self.dataset.shards.block_sizes)
        self.collate = self.dataset.collator(sequence_multiple(recipe.parallel))
        if self.pairs:  # a micro-batch of P pairs: 2P sequences, the pairs' media once (mm_data.vl.pairs)
            from mm_data.vl import PairCollate

            self.collate = PairCollate(self.collate)

    @property
    def pairs(self) -> bool:
        """Whether the samples are preference pairs (train.objective dpo)."""
        return self.recipe.train.objective == "dpo"

    @property
    def prompts(self) -> bool:
        """Whether the samples are prompts to complete (train.objective grpo)."""
        return self.recipe.train.objective == "grpo"

    def read_dataset(self, annotations):
        """The SFT data set (`dataset_class`) of a LLaMA-Factory file (or of dataset_info.json's data
        sets: `data_sources`) with the recipe's tokenizer and processors, plus the family's
        ``dataset_options()``."""
        data = self.recipe.data
        image_processor, video_processor = self.processors(data)
        return self.dataset_class().from_file(
            annotations, self.tokenizer, media_dir=data.media_dir, max_bad_fraction=data.max_bad_fraction,
            image_processor=image_processor, video_processor=video_processor,
            max_length=data.max_length - (self.recipe.grpo.max_completion_length if self.prompts else 0),
            video_fps=data.video_fps, default_system=data.system, pairs=self.pairs, prompts=self.prompts,
            data_format=data.format, **self.dataset_options())

    def dataset_options(self) -> Dict:
        """What the family's data set takes beyond VLSFTDataset's arguments."""
        return {}

    def validation_source(self):
        """The held-out part of the training set, or the LLaMA-Factory file at eval.path (its
        media paths start at data.media_dir, else the file's folder)."""
        if not self.recipe.eval.path:
            return super().validation_source()
        if getattr(self, "_validation_set", None) is None:
            self._validation_set = self.read_dataset(self.recipe.eval.path)
        return self._validation_set, None, None

    @classmethod
    def answer_kit(cls, recipe=None, folder: Optional[str] = None):
        """(tokenizer, (image, video) processors, default system turn) to answer prompts with: a
        run's (its recipe), or a Hugging Face folder's (its tokenizer, the pixel bounds of its
        preprocessor_config.json, the default system turn)."""
        if recipe is not None:
            return vl_tokenizer(data_sources(recipe)[2]), cls.processors(recipe.data), recipe.data.system
        bounds, path = {}, os.path.join(folder, "preprocessor_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                config = json.load(f)
            size = config.get("size") or {}
            bounds = {"min_pixels": config.get("min_pixels") or size.get("shortest_edge"),
                      "max_pixels": config.get("max_pixels") or size.get("longest_edge")}
        data = cls.data_section(kind="llamafactory", path=folder, **{k: v for k, v in bounds.items() if v})
        return vl_tokenizer(folder), cls.processors(data), data.system

    def write_samples(self, chunks, out: str, writer: bool):
        """Greedy answers to the eval prompts (mm_train.families.vl.samples)."""
        e = self.recipe.eval
        media = {"images": e.images, "videos": e.videos, "audios": e.audios}
        return vl_samples.write_answers(self, chunks, e.prompts, media, e.max_new_tokens, out, writer)

    def data_files(self):
        return data_files(self.dataset, self.annotations)

    def token_ids(self) -> dict:
        """Vocabulary size (rounded up to 64, so any tp up to 64 divides it) and special-token ids
        for an inline model config."""
        ids = {name: self.tokenizer.convert_tokens_to_ids(token) for name, token in self.media_tokens.items()}
        ids["vocab_size"] = -(-len(self.tokenizer) // 64) * 64
        ids["pad_token_id"] = self.tokenizer.pad_token_id
        ids["eos_token_id"] = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        return ids

    def inline_config(self):
        """The recipe's inline transformers config with the tokenizer's vocabulary and special tokens."""
        values = dict(self.recipe.model.config)
        ids = self.token_ids()
        values["text_config"] = {**values.get("text_config", {}), "vocab_size": ids["vocab_size"],
                                 "pad_token_id": ids["pad_token_id"], "eos_token_id": ids["eos_token_id"],
                                 "bos_token_id": ids["eos_token_id"]}
        media = {name: ids[name] for name in self.media_tokens}
        return self.config_class()(**values, **media, bos_token_id=ids["eos_token_id"],
                                   eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])

    def micro_batches(self):
        """Packed rows under the token budget with data.packing (mm_data.vl.PackedRows), else
        micro_batch_size samples each; under grpo the rank's prompts as they are."""
        if self.prompts:  # a rank's prompts as one list: mm_train.grpo_step makes the training rows
            return Prompts()
        if not self.recipe.data.packing:
            return super().micro_batches()
        from mm_data.vl import PackedRows, PairedRows

        par = self.recipe.parallel  # the interleaved schedule runs micro-batches in multiples of pp
        rows = PairedRows if self.pairs else PackedRows  # a pair's sequences share a row
        return rows(self.collate.collate if self.pairs else self.collate, row_budget(self.recipe.data),
                    par.pp if par.vpp > 1 else 1)

    @staticmethod
    def tokens(batch: Dict) -> int:
        return int((batch["attention_mask"] != 0).sum())  # a packed row's mask numbers its samples

    def samples(self, batch: Dict) -> int:
        if "answer_tokens" in batch:  # pairs: a sample is a pair (two sequences)
            return len(batch["answer_tokens"]) // 2
        mask = batch["attention_mask"]
        return int(mask.max(axis=-1).sum()) if self.recipe.data.packing else len(mask)

    def model_inputs(self, batch: Dict) -> Dict:
        if self.topo.cp.size > 1 and not self.recipe.data.packing:
            # the model takes whole unpadded rows under cp; right padding is harmless without the
            # mask: causal attention keeps real tokens from seeing it and its labels are -100
            return {k: v for k, v in batch.items() if k != "attention_mask"}
        return batch


def workload(recipe, config):
    """The planner's shapes (mm_train.plan.workload) of one sample: data.max_length tokens with
    one picture of data.max_pixels, through the vision tower (whole on each rank of the first
    stage; frozen under model.freeze [vision]) and the language model. Serves Qwen2.5-VL
    (windowed vision attention) and Qwen3-VL (whole-image attention; MoE layers count their k
    routed experts and the dispatched / combined copies of each token)."""
    text, vision = config.text_config, config.vision_config
    seq, merge = recipe.data.max_length, vision.spatial_merge_size
    pixels = recipe.data.max_pixels or 1280 * (vision.patch_size * merge) ** 2  # unset: 1280 merged tokens
    side = max(1, math.isqrt(pixels // (vision.patch_size * merge) ** 2))  # merged tokens a side
    grid = [[1, side * merge, side * merge]]
    patches = (side * merge) ** 2
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv = text.num_key_value_heads * head_dim
    mlp = getattr(text, "moe_intermediate_size", 0) * getattr(text, "num_experts_per_tok", 0) or text.intermediate_size
    h, hv, fv = text.hidden_size, vision.hidden_size, vision.intermediate_size
    if hasattr(vision, "window_size"):  # Qwen2.5-VL: windows of window_size pixels, some blocks whole
        from mm_models_vl.qwen2_5_vl.flops import qwen2_5_vl_flops, vision_flops

        window = min(patches, (vision.window_size // vision.patch_size) ** 2)
        full = len(vision.fullatt_block_indexes)
        keys = (full * patches + (vision.depth - full) * window) / vision.depth
        flops, vision_inside = qwen2_5_vl_flops(config, seq, image_grid_thw=grid), 6 * hv + 4 * fv
    else:
        from mm_models_vl.qwen3_vl.flops import text_flops, vision_flops

        keys, vision_inside = patches, 6 * hv + 2 * fv
        flops = text_flops(config, seq) + vision_flops(config, grid)
    frozen = "vision" in (recipe.model.freeze or [])
    tower_flops = float(vision_flops(config, grid))
    frozen_flops = tower_flops if frozen else 0.0
    # the reference kernels' norms and rotary embeddings keep ~9 hidden-sized copies more per
    # token and layer (29.3 h in all), emulated bf16 42 h more (measured with 3 h of MLP per h:
    # benchmarks/plan_activation_memory.py); the vision blocks are taken to keep alike
    # MoE: each token's k routed copies, dispatched to the experts and combined back
    dispatch = 2 * getattr(text, "num_experts_per_tok", 0) * h if getattr(text, "moe_intermediate_size", 0) else 0
    text_inside = 3 * h + 3 * kv + 4 * mlp + dispatch
    stacks = [LayerStack("vision tower", vision.depth, patches, hv, outside=4 * hv, inside=vision_inside,
                         heads=vision.num_heads, keys=int(keys), reference=13 * hv + vision_inside,
                         reference_emulated=42 * hv, pipelined=False, trained=not frozen, runs_whole=True,
                         flops=tower_flops, output_kept=frozen and "merger" in recipe.model.freeze
                         and not recipe.model.lora),
              LayerStack("language model", text.num_hidden_layers, seq, h, outside=4 * h, inside=text_inside,
                         heads=text.num_attention_heads, keys=seq, reference=13 * h + text_inside,
                         reference_emulated=42 * h)]
    vision_heads = vision.num_heads
    towers = [AttentionForm("vision, whole picture", patches, vision_heads, vision_heads, hv // vision_heads,
                            split=False)]
    if hasattr(vision, "window_size"):
        towers.append(AttentionForm("vision, windows", patches, vision_heads, vision_heads, hv // vision_heads,
                                    segment=int(window), split=False))
    attention = towers + [AttentionForm("language model", seq, text.num_attention_heads, text.num_key_value_heads,
                                        head_dim, causal=True)]
    return Workload(stacks, float(flops), seq, boundary_hidden=h, logits_vocab=text.vocab_size,
                    frozen_flops=frozen_flops, attention=attention, packed=_packed_row(recipe, seq),
                    notes=[f"one {grid[0][1] * vision.patch_size} x {grid[0][2] * vision.patch_size} picture and "
                           f"{seq} tokens per sample (data.max_pixels, data.max_length)"])


def _packed_row(recipe, seq: int):
    """With data.packing, the row the planner assumes: as many samples of ``seq`` tokens as the
    budget holds (one when it holds none whole), in a row as long as the budget (the packer fills
    rows up to it from shorter samples: memory and collectives are those of a full row), rounded
    up to the multiple the layout cuts rows into (`sequence_multiple`, the collator's)."""
    if not recipe.data.packing:
        return None
    budget = row_budget(recipe.data)
    samples, multiple = max(1, budget // seq), sequence_multiple(recipe.parallel)
    return PackedRow(samples, samples * seq, -(-max(budget, samples * seq) // multiple) * multiple, budget)


SPEC = register(FamilySpec(
    name="qwen2_5_vl",
    description="Qwen2.5-VL (3B / 7B / 32B / 72B): vision-language SFT, LoRA, DPO and GRPO",
    models={"qwen2_5_vl": "mm_models_vl:Qwen2_5_VLForConditionalGeneration"},
    task=VLTask,
    data_sections={"tiny_vl": VLDataSection, "llamafactory": VLDataSection, "tiny_vl_pairs": VLDataSection,
                   "tiny_vl_colours": VLDataSection},
    plan="mm_models_vl.qwen2_5_vl.parallel_plan:parallelize",
    lora_config="mm_models_vl.qwen2_5_vl.parallel_plan:LoraConfig",
    extra="vl",
    processing=write_processing_files,
    preflight=preflight,
    workload=workload,
    generate=generate_answer,
    objectives=("sft", "dpo", "grpo"),
    recipes=(
        BuiltinRecipe("qwen2_5_vl_tiny", "qwen2_5_vl_tiny.yaml",
                      "a tiny random Qwen2.5-VL captions generated pictures (about a minute)", "1-2 CPU processes",
                      default=True),
        BuiltinRecipe("qwen2_5_vl_tiny_lora", "qwen2_5_vl_tiny_lora.yaml",
                      "LoRA adapters on the tiny Qwen2.5-VL", "1-2 CPU processes"),
        BuiltinRecipe("qwen2_5_vl_tiny_dpo", "qwen2_5_vl_tiny_dpo.yaml",
                      "DPO on the tiny Qwen2.5-VL: right captions of generated pictures against wrong ones",
                      "1-2 CPU processes"),
        BuiltinRecipe("qwen2_5_vl_tiny_colours", "qwen2_5_vl_tiny_colours.yaml",
                      "the tiny Qwen2.5-VL learns to name the background colour of a generated picture (SFT; "
                      "qwen2_5_vl_tiny_grpo starts from it)", "1-2 CPU processes"),
        BuiltinRecipe("qwen2_5_vl_tiny_grpo", "qwen2_5_vl_tiny_grpo.yaml",
                      "GRPO on the tiny Qwen2.5-VL: sampled answers to the colour question, rewarded when right",
                      "1-2 CPU processes"),
        BuiltinRecipe("qwen2_5_vl_7b_sft", "qwen2_5_vl_7b_sft.yaml",
                      "Qwen2.5-VL-7B-Instruct SFT on LLaMA-Factory data (TP1 PP2 ZeRO-1)", "1 x 8 Ascend NPUs"),
        BuiltinRecipe("qwen2_5_vl_7b_dpo", "qwen2_5_vl_7b_dpo.yaml",
                      "Qwen2.5-VL-7B-Instruct DPO with LoRA (adapters off as the reference, DP8 ZeRO-1)",
                      "1 x 8 Ascend NPUs"),
        BuiltinRecipe("qwen2_5_vl_7b_grpo", "qwen2_5_vl_7b_grpo.yaml",
                      "Qwen2.5-VL-7B-Instruct GRPO with LoRA (8 completions a prompt decoded in place, accuracy and "
                      "format rewards, adapters off as the KL reference, DP8 ZeRO-1)", "1 x 8 Ascend NPUs"),
        BuiltinRecipe("qwen2_5_vl_32b_sft", "qwen2_5_vl_32b_sft.yaml",
                      "Qwen2.5-VL-32B-Instruct SFT on one node (ZeRO-3, optimizer state offloaded, no TP / PP)",
                      "1 x 8 Ascend NPUs"),
        BuiltinRecipe("qwen2_5_vl_72b_sft", "qwen2_5_vl_72b_sft.yaml",
                      "Qwen2.5-VL-72B-Instruct SFT (TP2 PP8 DP4)", "8 x 8 Ascend NPUs"),
    ),
))
