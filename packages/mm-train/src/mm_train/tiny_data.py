"""The built-in tiny image-caption set the default recipe trains on, generated on first use.

Each sample is a 56 x 56 PNG of a coloured shape on a coloured background and its caption
("a red circle on blue"); the caption is predictable from the picture, so a model that learns to
look at the image drives the loss well below what the text alone allows. A byte-level BPE
tokenizer is trained on the captions with `tokenizers` and saved beside them (tokenizer.json),
with Qwen2-VL's special tokens. Everything is written once into the data folder and read back
from the files afterwards (the PNGs go through mm-data's Qwen2-VL image processor, as real data).

A sample becomes  <|vision_start|> <|image_pad|> x 4 <|vision_end|> caption <|im_end|>  padded to
``max_length``; labels are the caption and <|im_end|> (-100 elsewhere).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List

import numpy as np

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
           "white": (245, 245, 245), "black": (15, 15, 15)}
SHAPES = ("circle", "square", "triangle", "cross")
SPECIAL = ["<|pad|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SIZE = 56  # pixels a side: 4 x 4 patches of 14, 2 x 2 merged tokens


def _draw(shape: str, colour, background, rng: np.random.Generator) -> np.ndarray:
    image = np.empty((SIZE, SIZE, 3), np.uint8)
    image[:] = background
    y, x = np.mgrid[:SIZE, :SIZE]
    cy, cx = rng.integers(20, 36, 2)
    r = int(rng.integers(10, 16))
    if shape == "circle":
        mask = (y - cy) ** 2 + (x - cx) ** 2 <= r * r
    elif shape == "square":
        mask = (abs(y - cy) <= r) & (abs(x - cx) <= r)
    elif shape == "triangle":
        mask = (y >= cy - r) & (y <= cy + r) & (abs(x - cx) <= (y - cy + r) / 2)
    else:
        mask = ((abs(y - cy) <= r) & (abs(x - cx) <= r // 3)) | ((abs(x - cx) <= r) & (abs(y - cy) <= r // 3))
    image[mask] = colour
    noise = rng.integers(-12, 13, image.shape)
    return np.clip(image.astype(np.int16) + noise, 0, 255).astype(np.uint8)


def generate(folder: str, samples: int = 256, seed: int = 0) -> Path:
    """Write the set into ``folder`` (images/*.png, captions.jsonl, tokenizer.json) unless complete."""
    from PIL import Image

    folder = Path(folder)
    done = folder / ".complete"
    if done.exists() and json.loads(done.read_text()).get("samples") == samples:
        return folder
    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    names = list(COLOURS)
    rows = []
    for i in range(samples):
        colour, background = rng.choice(len(names), 2, replace=False)
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        image = _draw(shape, COLOURS[names[colour]], COLOURS[names[background]], rng)
        file = f"images/{i:05d}.png"
        Image.fromarray(image).save(folder / file)
        rows.append({"image": file, "caption": f"a {names[colour]} {shape} on {names[background]}"})
    with open(folder / "captions.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    _train_tokenizer([row["caption"] for row in rows], folder / "tokenizer.json")
    done.write_text(json.dumps({"samples": samples}))
    return folder


def _train_tokenizer(texts: List[str], path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))


class TinyVLDataset:
    """Model inputs of the generated set: see the module docstring. ``vocab_size`` is the
    tokenizer's, rounded up to a multiple of 64 (so any tp up to 64 divides the embedding)."""

    def __init__(self, folder: str, max_length: int = 24):
        from tokenizers import Tokenizer

        from mm_data.vl import Qwen2VLImageProcessor

        self.folder = Path(folder)
        with open(self.folder / "captions.jsonl") as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        self.tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        self.ids = {token: self.tokenizer.token_to_id(token) for token in SPECIAL}
        self.vocab_size = -(-self.tokenizer.get_vocab_size() // 64) * 64
        self.processor = Qwen2VLImageProcessor(min_pixels=SIZE * SIZE, max_pixels=SIZE * SIZE)
        self.max_length = max_length

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        from PIL import Image

        row = self.rows[index]
        with Image.open(self.folder / row["image"]) as image:
            vision = self.processor([image.convert("RGB")])
        grid = vision["image_grid_thw"][0]
        image_tokens = int(np.prod(grid)) // 4  # 2 x 2 merge
        prompt = [self.ids["<|vision_start|>"]] + [self.ids["<|image_pad|>"]] * image_tokens + [self.ids["<|vision_end|>"]]
        answer = self.tokenizer.encode(row["caption"]).ids + [self.ids["<|im_end|>"]]
        ids = (prompt + answer)[: self.max_length]
        labels = ([-100] * len(prompt) + answer)[: self.max_length]
        pad = self.max_length - len(ids)
        types = [1 if t == self.ids["<|image_pad|>"] else 0 for t in ids]
        return {"input_ids": np.array(ids + [self.ids["<|pad|>"]] * pad, np.int64),
                "attention_mask": np.array([1] * len(ids) + [0] * pad, np.int64),
                "labels": np.array(labels + [-100] * pad, np.int64),
                "mm_token_type_ids": np.array(types + [0] * pad, np.int64),
                "pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"]}

    def model_config(self) -> dict:
        """The special-token ids the model config must name."""
        return {"vocab_size": self.vocab_size, "pad_token_id": self.ids["<|pad|>"],
                "eos_token_id": self.ids["<|im_end|>"], "image_token_id": self.ids["<|image_pad|>"],
                "video_token_id": self.ids["<|video_pad|>"], "vision_start_token_id": self.ids["<|vision_start|>"],
                "vision_end_token_id": self.ids["<|vision_end|>"]}


def collate(samples: List[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    """Stack the token arrays, concatenate the images' patches and grids."""
    out = {k: np.stack([s[k] for s in samples]) for k in ("input_ids", "attention_mask", "labels", "mm_token_type_ids")}
    out["pixel_values"] = np.concatenate([s["pixel_values"] for s in samples])
    out["image_grid_thw"] = np.concatenate([s["image_grid_thw"] for s in samples])
    return out


def default_folder() -> str:
    """Where the set lives unless the recipe says: $MM_TRAIN_DATA or ~/.cache/mm-train/tiny_vl."""
    return os.environ.get("MM_TRAIN_DATA", os.path.join(os.path.expanduser("~"), ".cache", "mm-train", "tiny_vl"))
