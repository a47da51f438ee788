"""A VL recipe's data: LLaMA-Factory conversations through mm-data, cut into this rank's micro-batches.

`VLTrainData` builds mm-data's `VLSFTDataset` from the recipe's data section (the tiny built-in
set is generated first), a `BucketBatchSampler` over global batches (seed = train.seed) and a
`DataLoader` (``data.num_workers`` processes) whose batches are this data-parallel rank's share of
a step, already split into ``micro_batch_size`` micro-batches. Step ``s`` is global batch
``s mod B`` of epoch ``s div B`` (B batches an epoch), so the stream is a function of the step:
resuming at any step, under any layout, continues it exactly. Bad samples are replaced by mm-data
and counted; past ``data.max_bad_fraction`` the run stops naming them. Micro-batches are padded
to a length every layout can cut: a multiple of 2 cp (and of tp under sequence parallelism), so
the padding — ignored by the loss — is the same for one process as for the layout.
"""

from __future__ import annotations

import os
from typing import Dict, List

from mm_train.recipe import Recipe
from mm_train.tiny_data import default_folder, generate

QWEN_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def load_tokenizer(path: str):
    """A transformers tokenizer from a model folder or a tokenizer.json file (no remote code)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if os.path.isfile(path):
        return PreTrainedTokenizerFast(tokenizer_file=path, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


class MicroBatches:
    """Collate a rank's share of a step into consecutive micro-batches of ``size`` samples."""

    def __init__(self, collate, size: int):
        self.collate, self.size = collate, size

    def __call__(self, samples: List[dict]) -> List[Dict]:
        return [self.collate(samples[i:i + self.size]) for i in range(0, len(samples), self.size)]


class VLTrainData:
    """See the module docstring."""

    def __init__(self, recipe: Recipe, topo):
        from mm_data import BucketBatchSampler
        from mm_data.vl import Qwen2VLImageProcessor, Qwen2VLVideoProcessor, VLSFTDataset

        data, train = recipe.data, recipe.train
        if data.kind == "tiny_vl":
            folder = data.path or default_folder()
            if topo.rank == 0:
                generate(folder, data.samples)
            if topo.world_size > 1:
                from mm_parallel import comm

                comm.barrier(topo.world)  # the set exists before anyone reads it
            annotations, tokenizer_path = os.path.join(folder, "data.json"), os.path.join(folder, "tokenizer.json")
        else:
            annotations, tokenizer_path = data.path, data.tokenizer or recipe.model.path
        self.tokenizer = load_tokenizer(tokenizer_path)
        pixels = {k: v for k, v in (("min_pixels", data.min_pixels), ("max_pixels", data.max_pixels)) if v}
        self.dataset = VLSFTDataset.from_file(
            annotations, self.tokenizer, media_dir=data.media_dir, max_bad_fraction=data.max_bad_fraction,
            image_processor=Qwen2VLImageProcessor(**pixels), video_processor=Qwen2VLVideoProcessor(**pixels),
            max_length=data.max_length, video_fps=data.video_fps, default_system=data.system)
        self.sampler = BucketBatchSampler(len(self.dataset), train.global_batch_size, topo.dp.rank, topo.dp.size,
                                          seed=train.seed)
        self.micro_batch_size, self.num_workers = train.micro_batch_size, data.num_workers
        par = recipe.parallel  # sequences cut into equal parts: 2 per cp rank (load-balanced ring), tp under sp
        self.pad_to = (2 * par.cp if par.cp > 1 else 1) * (par.tp if par.sequence_parallel else 1)

    def token_ids(self) -> dict:
        """Vocabulary size (rounded up to 64, so any tp up to 64 divides it) and special-token ids
        for an inline model config."""
        ids = {name: self.tokenizer.convert_tokens_to_ids(token) for name, token in zip(
            ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"), QWEN_TOKENS)}
        ids["vocab_size"] = -(-len(self.tokenizer) // 64) * 64
        ids["pad_token_id"] = self.tokenizer.pad_token_id
        ids["eos_token_id"] = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        return ids

    def position(self, step: int) -> dict:
        """The data loader's state at the start of ``step``."""
        return self.sampler.state_at(step)

    def stream(self, first_step: int):
        """This rank's micro-batches of every step from ``first_step`` on."""
        from mm_data import DataLoader

        collate = MicroBatches(self.dataset.collator(self.pad_to), self.micro_batch_size)
        loader = DataLoader(self.dataset, self.sampler, collate, num_workers=self.num_workers)
        loader.load_state_dict(self.position(first_step))
        return iter(loader)
