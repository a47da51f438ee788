"""The built-in tiny video-caption set of the Wan recipes, and its tiny random encoders.

Each clip is 9 frames of 32 x 32 pixels (H.264, written with PyAV): a coloured square moving in
one of four directions over a coloured background, captioned "a red square moving left on blue".
The set is written as the reference suite's data.json (path, cap, num_frames, fps, resolution)
beside a byte-level BPE tokenizer (tokenizer.json), and as clip pairs for Diffusion-DPO
(data_pairs.json: each caption with its clip chosen and a clip of the square moving the other way
rejected; mm_data.video.pairs). The encoders are a tiny Wan2.1 VAE (z 4,
8 x spatial and 4 x temporal compression: a clip is 3 x 4 x 4 latents; for TI2V one of Wan2.2's
layout, z 8, the same compression) and a tiny UMT5 (width 32) — and for I2V a tiny CLIP vision
tower (width 48, 32 px); for CogVideoX a tiny CogVideoX VAE
(the same compression) and a tiny T5 — their weights drawn with numpy from a fixed seed so that
every process builds the same ones.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict

import numpy as np

from mm_train.families.tiny_sets import COLOURS, train_tokenizer

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore); PyAV,
# mm-models-video, transformers (optional: a missing one is named when a run needs it).

MOVES = {"left": (0, -2), "right": (0, 2), "up": (-2, 0), "down": (2, 0)}
SIZE, FRAMES, FPS = 32, 9, 8
PAIRS = "data_pairs.json"  # the clip pairs (train.objective dpo)
SPECIAL = ["<pad>", "</s>", "<unk>"]
VAE_CONFIG = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True],
                  latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
# TI2V's (Wan2.2's VAE layout: residual blocks, 2 x 2 patchified frames) at the same compression,
# 8 x spatial (patches x encoder's 4) and 4 x temporal: a clip is 3 x 4 x 4 latents of z 8
VAE22_CONFIG = dict(base_dim=8, decoder_base_dim=12, z_dim=8, dim_mult=[1, 2, 2], num_res_blocks=1,
                    temperal_downsample=[True, True], is_residual=True, patch_size=2, in_channels=12, out_channels=12,
                    scale_factor_spatial=8, latents_mean=[0.0] * 8, latents_std=[1.0] * 8)
TEXT_CONFIG = dict(vocab_size=320, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=16, relative_attention_max_distance=20,
                   feed_forward_proj="gated-gelu", dropout_rate=0.0)
# CogVideoX's encoders: a tiny VAE (4 blocks: 8 x spatial, 4 x temporal; z 4) and a tiny T5 v1.1
COGVIDEOX_VAE_CONFIG = dict(block_out_channels=[8, 8, 8, 8], latent_channels=4, layers_per_block=1,
                            norm_num_groups=4, sample_height=SIZE, sample_width=SIZE, scaling_factor=1.0)
# I2V's image encoder: a tiny CLIP vision tower (width 48 = the tiny I2V DiT's image_dim) on 32 px
IMAGE_CONFIG = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                    patch_size=8, hidden_act="quick_gelu")


def _clip(colour, background, move, rng: np.random.Generator) -> np.ndarray:
    frames = np.empty((FRAMES, SIZE, SIZE, 3), np.uint8)
    y, x = (int(v) for v in rng.integers(8, 16, 2))
    for t in range(FRAMES):
        frame = frames[t]
        frame[:] = background
        cy, cx = y + move[0] * t, x + move[1] * t
        frame[max(cy, 0):cy + 8, max(cx, 0):cx + 8] = colour
    return frames


def generate(folder: str, samples: int = 64, seed: int = 0) -> Path:
    """Write the set into ``folder`` (clips/*.mp4, data.json, data_pairs.json, tokenizer.json)
    unless complete."""
    folder = Path(folder)
    done = folder / ".complete"
    stamp = {"samples": samples, "pairs": PAIRS}
    if done.exists() and json.loads(done.read_text()) == stamp:
        return folder
    rng = np.random.default_rng(seed)
    (folder / "clips").mkdir(parents=True, exist_ok=True)
    names, entries, pairs = list(COLOURS), [], []
    for i in range(samples):
        colour, background = rng.choice(len(names), 2, replace=False)
        move = list(MOVES)[int(rng.integers(len(MOVES)))]
        colours = COLOURS[names[colour]], COLOURS[names[background]]
        path, wrong = f"clips/{i:05d}.mp4", f"clips/{i:05d}_rejected.mp4"
        _write_clip(folder / path, _clip(*colours, MOVES[move], rng))
        backwards = tuple(-v for v in MOVES[move])  # the rejected clip: the square moving the other way
        _write_clip(folder / wrong, _clip(*colours, backwards, np.random.default_rng([seed, i])))
        caption = f"a {names[colour]} square moving {move} on {names[background]}"
        entries.append({"path": path, "cap": caption, "num_frames": FRAMES, "fps": FPS,
                        "resolution": {"height": SIZE, "width": SIZE}})
        pairs.append({"prompt": caption, "chosen": path, "rejected": wrong})
    (folder / "data.json").write_text(json.dumps(entries, indent=1))
    (folder / PAIRS).write_text(json.dumps(pairs, indent=1))
    train_tokenizer([e["cap"] for e in entries], folder / "tokenizer.json", SPECIAL, TEXT_CONFIG["vocab_size"],
                    unk_token="<unk>")
    done.write_text(json.dumps(stamp))
    return folder


def _write_clip(path: Path, frames: np.ndarray) -> None:
    """An H.264 mp4 of (frames, SIZE, SIZE, 3) uint8 frames at FPS."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width = stream.height = SIZE
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def tokenizer(folder: str):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"), pad_token="<pad>",
                                   eos_token="</s>", unk_token="<unk>")


def _randomise(model, seed: int, scale: float = 0.5) -> None:
    """Weights from numpy (the same in every process): norms near 1, the rest ``scale`` / sqrt(fan-in)."""
    from mindspore import Tensor

    rng = np.random.default_rng(seed)
    for param in sorted(model.get_parameters(), key=lambda p: p.name):
        shape = tuple(param.shape)
        if "norm" in param.name or "gamma" in param.name:
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
            value = rng.standard_normal(shape) * (scale / fan_in ** 0.5 if len(shape) > 1 else 0.05)
        param.set_data(Tensor(value.astype(np.float32)))


def encoders(seed: int = 0, image: bool = False, wan2_2: bool = False):
    """(VAE, UMT5 text encoder, CLIP image encoder or None, its image processor or None): the
    tiny set's random encoders; the image pair only for I2V (``image``); the VAE Wan2.2's layout
    for TI2V (``wan2_2``), else Wan2.1's (which Wan2.2 A14B keeps)."""
    from mm_models_video import AutoencoderKLWan, CLIPVisionModel, UMT5EncoderModel

    vae, text = AutoencoderKLWan(VAE22_CONFIG if wan2_2 else VAE_CONFIG), UMT5EncoderModel(dict(TEXT_CONFIG))
    _randomise(vae, seed, scale=1.5)  # latents of about unit spread, as latents_mean / std give real ones
    _randomise(text, seed + 1)
    if not image:
        return vae, text, None, None
    from transformers import CLIPImageProcessorPil

    clip = CLIPVisionModel(dict(IMAGE_CONFIG))
    _randomise(clip, seed + 2)
    size = IMAGE_CONFIG["image_size"]
    processor = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return vae, text, clip, processor


def cogvideox_encoders(seed: int = 0):
    """(VAE, T5 text encoder): the tiny set's random CogVideoX encoders."""
    from mm_models_video import AutoencoderKLCogVideoX, T5EncoderModel

    vae, text = AutoencoderKLCogVideoX(COGVIDEOX_VAE_CONFIG), T5EncoderModel(dict(TEXT_CONFIG))
    _randomise(vae, seed, scale=1.5)
    _randomise(text, seed + 1)
    return vae, text


TINY = "tiny"  # data.vae / text_encoder / image_encoder: the tiny random encoders, as folders
# the data fields that name encoder folders, which are also the Wan2.1 diffusers folder's sub-folders
ENCODER_FIELDS = ("vae", "text_encoder", "tokenizer", "image_encoder", "image_processor")


def encoder_folders(root: str, seed: int = 0, family: str = "wan") -> Dict[str, str]:
    """The tiny random encoders written once under ``root`` as the folders users point real
    recipes at, in the diffusers layouts: for Wan (`encoders`) vae/ (diffusers AutoencoderKLWan;
    ``family`` "wan2_2": of Wan2.2's layout, TI2V's), text_encoder/ (transformers
    UMT5EncoderModel), image_encoder/ (CLIPVisionModel) and image_processor/ (its
    CLIPImageProcessor); for CogVideoX
    (`cogvideox_encoders`, ``family`` "cogvideox") vae/ (AutoencoderKLCogVideoX) and text_encoder/
    (T5EncoderModel); for both tokenizer/ (trained on every caption the tiny set can have).
    ``data.vae: tiny`` (and text_encoder / image_encoder) name them, so one's own clips train
    before real encoders are downloaded. Returns {field: folder}."""
    from transformers import PreTrainedTokenizerFast


    root = Path(root)
    wan = family in ("wan", "wan2_2")  # wan2_2: TI2V's, the VAE of Wan2.2's layout
    fields = ENCODER_FIELDS if wan else ("vae", "text_encoder", "tokenizer")
    folders = {field: str(root / field) for field in fields}
    done = root / ".complete"
    if done.exists() and json.loads(done.read_text()) == {"seed": seed, "family": family}:
        return folders
    if wan:
        modules = dict(zip(("vae", "text_encoder", "image_encoder", "image_processor"),
                           encoders(seed, image=True, wan2_2=family == "wan2_2")))
    else:
        modules = dict(zip(("vae", "text_encoder"), cogvideox_encoders(seed)))
    for field, module in modules.items():
        module.save_pretrained(folders[field])
    captions = [f"a {c} square moving {m} on {b}" for c in COLOURS for m in MOVES for b in COLOURS if b != c]
    os.makedirs(folders["tokenizer"], exist_ok=True)
    vocabulary = Path(folders["tokenizer"]) / "tokenizer.json"
    train_tokenizer(captions, vocabulary, SPECIAL, TEXT_CONFIG["vocab_size"], unk_token="<unk>")
    PreTrainedTokenizerFast(tokenizer_file=str(vocabulary), pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folders["tokenizer"])
    done.write_text(json.dumps({"seed": seed, "family": family}))  # last: a folder without it is written again
    return folders


def default_folder() -> str:
    """Where the set lives unless the recipe says: $MM_TRAIN_VIDEO_DATA or ~/.cache/mm-train/tiny_video."""
    return os.environ.get("MM_TRAIN_VIDEO_DATA",
                          os.path.join(os.path.expanduser("~"), ".cache", "mm-train", "tiny_video"))
