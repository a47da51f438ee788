"""The built-in tiny Qwen2.5-Omni set: pictures and sounds with their captions, generated on first use.

A third of the samples is a 56 x 56 picture of a coloured shape (mm_train.families.vl.tiny's), a third a
0.6 s sound — a low, middle or high tone or noise, a WAV file at 22.05 kHz (so loading resamples
it to 16 kHz, the path real audio takes) — and a third both ("<image><audio>", captioned "a red
circle on blue, a high tone"). The set is LLaMA-Factory's multimodal JSON (images / audios lists)
beside a byte-level BPE tokenizer with Qwen2.5-Omni's special tokens, read back through mm-data's
`OmniSFTDataset`: decoding, Whisper features, the Omni chat template.
"""

from __future__ import annotations

import json
import os
import wave
from pathlib import Path

import numpy as np

from mm_train.families.tiny_sets import COLOURS, train_tokenizer
from mm_train.families.vl.tiny import SHAPES, _draw

# Deferred imports: Pillow (optional: a missing one is named when a run needs it).

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>",
           "<|VIDEO|>", "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"]
SOUNDS = {"low tone": 220.0, "middle tone": 440.0, "high tone": 1760.0, "noise": None}
RATE, SECONDS = 22050, 0.6


def _sound(kind: str, rng: np.random.Generator) -> np.ndarray:
    t = np.arange(int(RATE * SECONDS)) / RATE
    freq = SOUNDS[kind]
    signal = rng.standard_normal(t.size) * 0.3 if freq is None else 0.5 * np.sin(2 * np.pi * freq * t)
    return (np.clip(signal + rng.standard_normal(t.size) * 0.01, -1, 1) * 32767).astype(np.int16)


def _write_wav(path: Path, samples: np.ndarray) -> None:
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(RATE)
        f.writeframes(samples.tobytes())


def generate(folder: str, samples: int = 192, seed: int = 0) -> Path:
    """Write the set into ``folder`` (images/, audios/, data.json, tokenizer.json) unless complete."""
    from PIL import Image

    folder = Path(folder)
    done = folder / ".complete"
    if done.exists() and json.loads(done.read_text()) == {"samples": samples, "format": "llamafactory-omni"}:
        return folder
    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    (folder / "audios").mkdir(parents=True, exist_ok=True)
    names, sounds = list(COLOURS), list(SOUNDS)
    entries, captions = [], []
    for i in range(samples):
        kind = ("image", "audio", "both")[i % 3]
        entry, words, prompt = {}, [], ""
        if kind in ("image", "both"):
            colour, background = rng.choice(len(names), 2, replace=False)
            shape = SHAPES[int(rng.integers(len(SHAPES)))]
            file = f"images/{i:05d}.png"
            Image.fromarray(_draw(shape, COLOURS[names[colour]], COLOURS[names[background]], rng)).save(folder / file)
            entry["images"], prompt = [file], "<image>"
            words.append(f"a {names[colour]} {shape} on {names[background]}")
        if kind in ("audio", "both"):
            sound = sounds[int(rng.integers(len(sounds)))]
            file = f"audios/{i:05d}.wav"
            _write_wav(folder / file, _sound(sound, rng))
            entry["audios"], prompt = [file], prompt + "<audio>"
            words.append(f"a {sound}" if sound != "noise" else "noise")
        caption = ", ".join(words)
        captions.append(caption)
        entries.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": caption}],
                        **entry})
    (folder / "data.json").write_text(json.dumps(entries, indent=1))
    train_tokenizer(captions + ["user\n", "assistant\n", "system\n"], folder / "tokenizer.json", special=SPECIAL)
    done.write_text(json.dumps({"samples": samples, "format": "llamafactory-omni"}))
    return folder


def default_folder() -> str:
    """$MM_TRAIN_DATA/tiny_omni, else ~/.cache/mm-train/tiny_omni."""
    root = os.environ.get("MM_TRAIN_DATA")
    return os.path.join(root, "tiny_omni") if root else os.path.join(os.path.expanduser("~"), ".cache", "mm-train",
                                                                       "tiny_omni")
