"""The built-in tiny image-caption set the default recipe trains on, generated on first use.

Each sample is a 56 x 56 PNG of a coloured shape on a coloured background and its caption
("a red circle on blue"); the caption is predictable from the picture, so a model that learns to
look at the image drives the loss well below what the text alone allows. The set is written as
real users' data is: LLaMA-Factory's multimodal JSON (data.json: a user turn "<image>", the
caption as the assistant's reply, the PNG in "images") beside a byte-level BPE tokenizer trained
with `tokenizers` (tokenizer.json, with Qwen2-VL's special tokens) — and read back through
mm-data's `VLSFTDataset`, the path of every real SFT recipe. `Pairs` is the same set as
preference pairs (data.kind tiny_vl_pairs): the right caption chosen, the picture's colours
swapped ("a blue circle on red") rejected, in LLaMA-Factory's ranking layout; `Colours` the
question "what colour is the background?" answered by its colour word (data.kind
tiny_vl_colours: SFT, and GRPO's prompts with that word as the reference answer).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mm_train.families.tiny_sets import COLOURS, train_tokenizer

# Deferred imports: Pillow (optional: a missing one is named when a run needs it).

SHAPES = ("circle", "square", "triangle", "cross")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
SIZE = 56  # pixels a side: 4 x 4 patches of 14, 2 x 2 merged tokens
QUESTION = "what colour is the background?"


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


def generate(folder: str, samples: int = 256, seed: int = 0, pairs: bool = False, question: bool = False) -> Path:
    """Write the set into ``folder`` (images/*.png, data.json, tokenizer.json) unless complete;
    with ``pairs``, as preference pairs; with ``question``, as the colour question (module docstring)."""
    from PIL import Image

    folder = Path(folder)
    done = folder / ".complete"
    stamp = {"samples": samples, "format": "llamafactory" + ("_ranking" if pairs else "_colour" if question else "")}
    if done.exists() and json.loads(done.read_text()) == stamp:
        return folder
    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    names = list(COLOURS)
    entries, captions = [], []
    for i in range(samples):
        colour, background = rng.choice(len(names), 2, replace=False)
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        image = _draw(shape, COLOURS[names[colour]], COLOURS[names[background]], rng)
        file = f"images/{i:05d}.png"
        Image.fromarray(image).save(folder / file)
        caption = f"a {names[colour]} {shape} on {names[background]}"
        captions.append(caption)
        if pairs:
            # the same words as the right captions: the tokenizer stays the SFT set's (an SFT start's vocabulary)
            wrong = f"a {names[background]} {shape} on {names[colour]}"
            entries.append({"messages": [{"role": "user", "content": "<image>"}], "images": [file],
                            "chosen": {"role": "assistant", "content": caption},
                            "rejected": {"role": "assistant", "content": wrong}})
            continue
        if question:  # the answer is the background's colour word: a reference answer for GRPO's accuracy
            entries.append({"messages": [{"role": "user", "content": "<image>" + QUESTION},
                                         {"role": "assistant", "content": names[background]}], "images": [file]})
            continue
        entries.append({"messages": [{"role": "user", "content": "<image>"},
                                     {"role": "assistant", "content": caption}], "images": [file]})
    (folder / "data.json").write_text(json.dumps(entries, indent=1))
    questions = [QUESTION] * 8 if question else []  # the other sets keep the captions' tokenizer
    train_tokenizer(captions + questions + ["user\n", "assistant\n", "system\n"], folder / "tokenizer.json", SPECIAL)
    done.write_text(json.dumps(stamp))
    return folder


def default_folder() -> str:
    """Where the set lives unless the recipe says: $MM_TRAIN_DATA or ~/.cache/mm-train/tiny_vl."""
    return os.environ.get("MM_TRAIN_DATA", os.path.join(os.path.expanduser("~"), ".cache", "mm-train", "tiny_vl"))


@dataclass(frozen=True)
class Variant:
    """The set written another way, in its own folder beside the default one (``options``: `generate`'s)."""

    suffix: str
    options: dict

    def generate(self, folder: str, samples: int = 256, seed: int = 0) -> Path:
        return generate(folder, samples, seed, **self.options)

    def default_folder(self) -> str:
        return default_folder() + self.suffix


# data.kind tiny_vl_pairs: the set as preference pairs (module docstring)
Pairs = Variant("_pairs", {"pairs": True})
# data.kind tiny_vl_colours: "what colour is the background?" answered by the colour word — SFT
# conversations, and for train.objective grpo prompts whose reference answer is that word
# (mm_data.vl.prompts: the answer ending the turns)
Colours = Variant("_colours", {"question": True})
