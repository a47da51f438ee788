"""The feature encoders of the video families: numpy in, numpy out, shared by the feature cache,
online training and sampling, so that training and sampling see one conditioning.

`wan_feature_encoders` (a Wan VAE, UMT5, for I2V CLIP) and `cogvideox_feature_encoders` (a
CogVideoX VAE and T5) turn a batch of clips and captions into the named features; `encoder_sources`
says which folders a recipe's encoders load from (the tiny random ones written once when the
recipe says ``tiny``).
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional

import numpy as np

from mm_train.families.video import tiny as tiny_video
from mm_train.task import once_on_rank_zero

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore); mm-models-video,
# transformers (optional: a missing one is named when a run needs it).


def wan_feature_encoders(vae, text, image_encoder=None, image_processor=None, condition: Optional[bool] = None,
                         frame_group=None):
    """Feature-cache encoders from a MindSpore VAE and UMT5 (numpy in, numpy out); for I2V
    (``condition``, default: with an image encoder) also the VAE latents of [first frame, black
    frames...], and with ``image_encoder`` the first frame's CLIP features. ``frame_group``
    (data.vae_context_parallel) splits each clip's frames over its ranks
    (mm_models_video.wan.vae_context_parallel.encode_gathered)."""
    import mindspore as ms

    from mm_models_video.wan import vae_context_parallel

    def latent_means(video):
        if frame_group is not None:
            return vae_context_parallel.encode_gathered(vae, video, frame_group).mean
        return vae.encode(ms.Tensor(video)).mean

    def latents(batch):
        return vae.normalize_latents(latent_means(batch["video"])).asnumpy()

    def prompt_embeds(batch):
        mask = batch["attention_mask"]
        hidden = text(ms.Tensor(batch["input_ids"]), ms.Tensor(mask)).last_hidden_state.asnumpy()
        return hidden * mask[..., None]  # as the Wan pipelines: nothing past the caption

    encoders = {"latents": latents, "prompt_embeds": prompt_embeds}
    if condition if condition is not None else image_encoder is not None:
        encoders["condition"] = lambda batch: _first_frame_latents(vae, batch["video"])
    if image_encoder is None:
        return encoders

    def image_embeds(batch):  # the penultimate layer of CLIP on the first frame, as diffusers' I2V pipeline
        first = np.rint((batch["video"][:, :, 0].transpose(0, 2, 3, 1) + 1.0) * 127.5).astype(np.uint8)
        pixels = image_processor(images=list(first), return_tensors="np")["pixel_values"]
        return image_encoder(ms.Tensor(pixels), output_hidden_states=True).hidden_states[-2].asnumpy()

    encoders["image_embeds"] = image_embeds
    return encoders


def _first_frame_latents(vae, video: np.ndarray) -> np.ndarray:
    """What an I2V DiT sees beside the noise: the latents of the first frame, then black frames."""
    import mindspore as ms

    given = np.zeros_like(video)
    given[:, :, 0] = video[:, :, 0]
    return vae.normalize_latents(vae.encode(ms.Tensor(given)).mean).asnumpy()


def pipeline_part(model_path: Optional[str], field: str) -> Optional[str]:
    """``model_path``'s sub-folder ``field`` (vae, text_encoder, ...) when model_path is a diffusers
    pipeline folder (model_index.json) that has it, else None."""
    if not model_path or not os.path.isfile(os.path.join(model_path, "model_index.json")):
        return None
    folder = os.path.join(model_path, field)
    return folder if os.path.isdir(folder) else None


# T5 v1.1 XXL's shapes (every CogVideoX's text encoder; Wan's UMT5-XXL has the same widths)
T5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, feed_forward_proj="gated-gelu")


def online_encoder_configs(data, tiny_vae: dict, label: str, model_path: Optional[str] = None):
    """(VAE config, text encoder config, note) the planner counts online encoding with: the tiny
    set's (``tiny_vae`` and the tiny text encoder), or the folders' config.json (a pipeline folder's
    vae/ and text_encoder/ for those unset), or — a folder not readable here — the published
    model's (``label``: the VAE's defaults and T5 XXL), said in the note."""
    if data.kind == "tiny_video":
        return tiny_vae, tiny_video.TEXT_CONFIG, ""
    configs, assumed = [], []
    for field, default in (("vae", {}), ("text_encoder", T5_XXL)):
        folder = getattr(data, field)
        if folder is None:
            folder = pipeline_part(model_path, field)
        path = os.path.join(folder or "", "config.json")
        if os.path.exists(path):
            with open(path) as f:
                configs.append(json.load(f))
        else:
            configs.append(default)
            assumed.append(field)
    note = f"online encoding with the {label} {' and '.join(assumed)} shapes (data.{assumed[0]} has no " \
           "config.json here)" if assumed else ""
    return configs[0], configs[1], note


def encoder_sources(data, topo, family: str = "wan", model_path: Optional[str] = None) -> Dict[str, str]:
    """{vae, text_encoder, tokenizer, image_encoder, image_processor: folder} of a ``video`` data
    section: its own folders, and for each set to ``tiny`` the ``family``'s tiny random encoders'
    (written once under the tiny set's folder, `tiny_video.encoder_folders`); those it leaves
    unset, when ``model_path`` is a diffusers pipeline folder (model_index.json), its sub-folders of
    those names (a Wan2.2 folder's own VAE: TI2V-5B's of Wan2.2's layout, A14B's Wan2.1's). The
    tokenizer defaults to the text encoder's folder, the image processor to the image encoder's."""
    given = {field: getattr(data, field) for field in tiny_video.ENCODER_FIELDS}
    given = {field: pipeline_part(model_path, field) if value is None else value for field, value in given.items()}
    if tiny_video.TINY in given.values():
        folder = "tiny_encoders" if family == "wan" else f"tiny_encoders-{family}"
        root = os.path.join(tiny_video.default_folder(), folder)
        once_on_rank_zero(topo, lambda: tiny_video.encoder_folders(root, family=family))
        tiny = tiny_video.encoder_folders(root, family=family)
        given = {field: tiny.get(field) if value == tiny_video.TINY else value for field, value in given.items()}
        for encoder, companion in (("text_encoder", "tokenizer"), ("image_encoder", "image_processor")):
            if getattr(data, encoder) == tiny_video.TINY and not getattr(data, companion):
                given[companion] = tiny.get(companion)
    given["tokenizer"] = given["tokenizer"] or given["text_encoder"]
    given["image_processor"] = given["image_processor"] or given["image_encoder"]
    return given


def wan_folder_encoders(folders, i2v: bool, clip: Optional[bool] = None, frame_group=None):
    """The feature encoders of a Wan recipe's encoder folders (AutoencoderKLWan, UMT5; I2V: the
    first frame's latents, and with ``clip`` (default: I2V) its CLIP features)."""
    from mm_models_video import AutoencoderKLWan, UMT5EncoderModel

    vae = AutoencoderKLWan.from_pretrained(folders["vae"])
    text = UMT5EncoderModel.from_pretrained(folders["text_encoder"])
    if not (i2v if clip is None else clip):
        return wan_feature_encoders(vae, text, condition=i2v, frame_group=frame_group)
    if not folders["image_encoder"]:
        raise ValueError("an I2V model needs data.image_encoder: a CLIP vision folder (with its "
                         "preprocessor_config.json, or data.image_processor), or tiny")
    from transformers import CLIPImageProcessorPil

    from mm_models_video import CLIPVisionModel

    return wan_feature_encoders(vae, text, CLIPVisionModel.from_pretrained(folders["image_encoder"]),
                                CLIPImageProcessorPil.from_pretrained(folders["image_processor"]),
                                frame_group=frame_group)


def cogvideox_feature_encoders(vae, text, image_noise: Optional[dict] = None, frame_group=None):
    """{latents, prompt_embeds[, image_latents]}: numpy-in numpy-out encoders of a CogVideoX VAE
    and T5; ``image_noise`` {seed, mean, std} adds the I2V image latents (cogvideox_data's docstring);
    ``frame_group`` (data.vae_context_parallel) splits each clip's frames over its ranks
    (vae_context_parallel.encode_gathered: the clip whole, GroupNorm over all its frames)."""
    import mindspore as ms

    from mm_models_video.cogvideox import vae_context_parallel
    from mm_models_video.cogvideox.conditioning import image_latent_scale, noisy_first_frame

    scale = float(vae.config["scaling_factor"])

    def latents(batch):
        if frame_group is not None:
            return (vae_context_parallel.encode_gathered(vae, batch["video"], frame_group).mean * scale).asnumpy()
        return (vae.encode(ms.Tensor(batch["video"])).mean * scale).asnumpy()

    def prompt_embeds(batch):
        return text(ms.Tensor(batch["input_ids"])).last_hidden_state.asnumpy()

    encoders = {"latents": latents, "prompt_embeds": prompt_embeds}
    if image_noise is None:
        return encoders
    image_scale = image_latent_scale(vae.config)

    def image_latents(batch):
        frames = []
        for row, index in enumerate(batch["index"]):
            when = [int(batch["step"])] if "step" in batch else []  # online: fresh noise every step
            rng = np.random.default_rng([image_noise["seed"], *when, int(index)])
            frames.append(noisy_first_frame(batch["video"][row:row + 1], rng, image_noise["mean"],
                                            image_noise["std"]))
        return (vae.encode(ms.Tensor(np.concatenate(frames))).mean * image_scale).asnumpy()

    encoders["image_latents"] = image_latents
    return encoders
