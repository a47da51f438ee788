"""Video samples: a prompt (and for I2V a first frame) -> latents by the family's sampler -> VAE -> frames.

What the diffusers pipelines do, with the trained DiT behind ``predict`` (mm_train.samples):

    Wan        noise (1, z, 1 + (F - 1) / 4, H / s, W / s) (s the VAE's spatial compression) from
               (seed, prompt index); flow-matching Euler over ``steps`` of the recipe's shift
               (FlowMatchingSchedule.sample); I2V adds the 4 mask channels and the VAE latents of
               [image, black frames] to the input and the image's CLIP features if the model takes
               them (WanImageToVideoPipeline; Wan2.2 I2V-A14B takes none); TI2V (expand_timesteps)
               a timestep per token and, from an image, the first latent frame replaced by the
               image's latents before every step and at the end, its tokens at timestep 0; a pair
               of experts switches at the boundary (WanExperts); latents denormalised, decoded.
    CogVideoX  noise (1, F_lat, z, H / 8, W / 8), 1.5 padded in front to a multiple of patch_size_t
               (dropped again before decoding); DDIM or DPM (CogVideoXSchedule.sample) with rotary
               tables of the latent grid; I2V adds the image's VAE latents padded with zeros on the
               channels, and 1.5 the ofs embedding (CogVideoXImageToVideoPipeline); latents / the
               VAE's scaling factor, decoded.

Classifier-free guidance: v = v_u + g (v_c - v_u), the unconditional pass on
``eval.negative_prompt`` ("" by default). Prompts are encoded as the feature cache encodes
captions (`encoders.wan_feature_encoders`, `encoders.cogvideox_feature_encoders`: the same
tokenizer, the same length, the same zeroing past the caption), so training and sampling see one
conditioning.
The image latents are the VAE's means (the pipelines draw from the distribution).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import numpy as np

from mm_train import samples
from mm_train.families.video import tiny as tiny_video
from mm_train.families.video.data import clip_shape
from mm_train.families.video.encoders import cogvideox_feature_encoders, encoder_sources, wan_feature_encoders
from mm_train.families.video.wan_pipeline import token_timesteps
from mm_train.task import load_tokenizer

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore); Pillow,
# mm-models-video, transformers (optional: a missing one is named when a run needs it).

Predict = Callable[[Dict, tuple], np.ndarray]  # (forward keywords, output shape) -> the model's sample


@dataclass
class Settings:
    """What a sample is drawn with (eval section or `mm-train generate` flags)."""

    num_frames: int
    height: int
    width: int
    steps: int = 10
    guidance: float = 5.0
    sampler: str = "default"
    seed: int = 0
    negative_prompt: str = ""
    fps: float = 16.0

    def __post_init__(self):
        if (self.num_frames - 1) % 4:
            raise ValueError(f"num_frames must be 1 + 4k (the VAE's temporal compression), got {self.num_frames}")
        if self.height % 16 or self.width % 16:
            raise ValueError(f"height and width must be multiples of 16 (VAE x 8, patches x 2), got "
                             f"{self.height} x {self.width}")


def load_image(path: str, height: int, width: int) -> np.ndarray:
    """A picture file as the first frame: (3, H, W) in [-1, 1], resized to width x height."""
    from PIL import Image

    if not os.path.isfile(path):
        raise FileNotFoundError(f"no image {path} (a first frame for image-to-video)")
    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB").resize((width, height), Image.BICUBIC), np.float32)
    return pixels.transpose(2, 0, 1) / 127.5 - 1.0


class WanSampler:
    """See the module docstring; ``modules``: {vae, text_encoder, tokenizer, image_encoder,
    image_processor} (the last two for I2V), ``config`` the DiT's."""

    samplers = ("euler",)
    family = "wan"  # whose tiny encoders and folder layout (mm_train.families.video.encoders.encoder_sources)
    # a diffusers pipeline folder's: the pipeline's prompt length and call defaults
    pipeline_text_length = 512
    defaults = dict(num_frames=81, height=480, width=832, steps=50, guidance=5.0, fps=16.0)

    @staticmethod
    def tiny_modules(clip: bool, wan2_2: bool = False) -> Dict:
        """The tiny set's random encoders (the ones its feature cache was built with)."""
        return dict(zip(("vae", "text_encoder", "image_encoder", "image_processor"),
                        tiny_video.encoders(image=clip, wan2_2=wan2_2)))

    @staticmethod
    def folder_modules(folders: Dict, clip: bool) -> Dict:
        """The encoders of diffusers / transformers folders {vae, text_encoder, image_encoder, image_processor}."""
        from mm_models_video import AutoencoderKLWan, UMT5EncoderModel

        modules = {"vae": AutoencoderKLWan.from_pretrained(folders["vae"]),
                   "text_encoder": UMT5EncoderModel.from_pretrained(folders["text_encoder"])}
        if clip:
            from transformers import CLIPImageProcessorPil

            from mm_models_video import CLIPVisionModel

            if not folders.get("image_encoder"):
                raise ValueError("an I2V model samples with its CLIP image encoder: set data.image_encoder")
            modules["image_encoder"] = CLIPVisionModel.from_pretrained(folders["image_encoder"])
            modules["image_processor"] = CLIPImageProcessorPil.from_pretrained(folders["image_processor"]
                                                                               or folders["image_encoder"])
        return modules

    @staticmethod
    def pipeline_diffusion(scheduler: Dict, section):
        """The recipe's diffusion section from a pipeline's scheduler_config.json: the fields of
        the same names (the shift of Wan's UniPC scheduler is named flow_shift)."""
        values = dict(scheduler)
        if "flow_shift" in values:
            values.setdefault("shift", values["flow_shift"])
        return section(**{k: v for k, v in values.items() if k in section.__dataclass_fields__})

    def __init__(self, config, modules: Dict, text_length: int, diffusion, expand_timesteps: bool = False):
        from mm_models_video.flow_matching import FlowMatchingSchedule

        self.config, self.modules, self.text_length = config, modules, text_length
        self.i2v = is_i2v(config)  # the image's latents and a mask beside the noise
        self.expand_timesteps = expand_timesteps  # TI2V: a timestep per token, an image optional
        self.encoders = wan_feature_encoders(modules["vae"], modules["text_encoder"], modules.get("image_encoder"),
                                             modules.get("image_processor"), condition=self.i2v or expand_timesteps)
        self.schedule = FlowMatchingSchedule(diffusion.num_train_timesteps, diffusion.shift)
        self.spatial = int(modules["vae"].config.get("scale_factor_spatial") or 8)

    def sampler_of(self, settings: Settings) -> str:
        chosen = self.samplers[0] if settings.sampler == "default" else settings.sampler
        if chosen not in self.samplers:
            raise ValueError(f"sampler {settings.sampler!r} is not this family's; use one of {self.samplers}")
        return chosen

    def prompt_embeds(self, text: str) -> np.ndarray:
        tokens = self.modules["tokenizer"](text, padding="max_length", truncation=True, max_length=self.text_length,
                                           return_tensors="np")
        return self.encoders["prompt_embeds"]({k: tokens[k].astype(np.int64)
                                               for k in ("input_ids", "attention_mask")}).astype(np.float32)

    def noise_shape(self, settings: Settings) -> tuple:
        patch = self.spatial * self.config.patch_size[1]
        if settings.height % patch or settings.width % patch:
            raise ValueError(f"height and width must be multiples of {patch} (VAE x {self.spatial}, patches x "
                             f"{self.config.patch_size[1]}), got {settings.height} x {settings.width}")
        return (1, self.config.out_channels, (settings.num_frames - 1) // 4 + 1, settings.height // self.spatial,
                settings.width // self.spatial)

    def noise(self, settings: Settings, index: int) -> np.ndarray:
        """The starting latents of prompt ``index``: standard normal from (seed, index)."""
        rng = np.random.default_rng([settings.seed, index])
        return rng.standard_normal(self.noise_shape(settings)).astype(np.float32)

    def conditions(self, image: Optional[np.ndarray], settings: Settings) -> Dict:
        """The first frame's inputs of an I2V model (none for T2V; TI2V: the image's latents if given)."""
        if self.expand_timesteps:
            return {} if image is None else {"first_frame": self.encoders["condition"]({"video": image[None, :, None]})}
        if not self.i2v:
            return {}
        if image is None:
            raise ValueError("an image-to-video model samples from a first frame: give eval.images / --image")
        return self.image_inputs(image, settings)

    def image_inputs(self, image: np.ndarray, settings: Settings) -> Dict:
        """I2V: what the DiT sees beside the noise (the mask and image latents, CLIP features)."""
        video = np.zeros((1, 3, settings.num_frames, settings.height, settings.width), np.float32)
        video[:, :, 0] = image
        condition = self.encoders["condition"]({"video": video})
        mask = np.zeros((1, 4) + condition.shape[2:], np.float32)
        mask[:, :, 0] = 1.0
        out = {"extra": np.concatenate([mask, condition], 1)}
        if "image_embeds" in self.encoders:
            out["encoder_hidden_states_image"] = self.encoders["image_embeds"]({"video": video}).astype(np.float32)
        return out

    def latents(self, predict: Predict, prompt: str, image, settings: Settings, index: int) -> np.ndarray:
        self.sampler_of(settings)
        conditioned, unconditioned = self.prompt_embeds(prompt), self.prompt_embeds(settings.negative_prompt)
        extra = self.conditions(image, settings)
        first = extra.get("first_frame")  # TI2V from an image: its latents replace the first frame

        def inputs(x, t, text):
            if first is not None:
                x = np.concatenate([first, x[:, :, 1:]], 2)
            if self.expand_timesteps:
                t = token_timesteps(t, x.shape, self.config.patch_size, [first is not None] * len(x))
            out = {"hidden_states": np.concatenate([x, extra["extra"]], 1) if "extra" in extra else x,
                   "timestep": t, "encoder_hidden_states": text}
            if "encoder_hidden_states_image" in extra:
                out["encoder_hidden_states_image"] = extra["encoder_hidden_states_image"]
            return out

        def velocity(text):
            return lambda x, t: predict(inputs(x, t, text), x.shape)

        latents = self.schedule.sample(velocity(conditioned), self.noise(settings, index), settings.steps,
                                       settings.guidance, velocity(unconditioned))
        return latents if first is None else np.concatenate([first, latents[:, :, 1:]], 2)

    def decode(self, latents: np.ndarray, settings: Settings) -> np.ndarray:
        import mindspore as ms

        vae = self.modules["vae"]
        return vae.decode(vae.denormalize_latents(ms.Tensor(latents))).asnumpy()[0]


class CogVideoXSampler(WanSampler):
    """See the module docstring."""

    samplers = ("ddim", "dpm")
    family = "cogvideox"
    pipeline_text_length = 226
    defaults = dict(num_frames=49, height=480, width=720, steps=50, guidance=6.0, fps=8.0)

    @staticmethod
    def tiny_modules(i2v: bool, wan2_2: bool = False) -> Dict:
        return dict(zip(("vae", "text_encoder"), tiny_video.cogvideox_encoders()))

    @staticmethod
    def folder_modules(folders: Dict, i2v: bool) -> Dict:
        from mm_models_video import AutoencoderKLCogVideoX, T5EncoderModel

        return {"vae": AutoencoderKLCogVideoX.from_pretrained(folders["vae"]),
                "text_encoder": T5EncoderModel.from_pretrained(folders["text_encoder"])}

    def __init__(self, config, modules: Dict, text_length: int, diffusion, expand_timesteps: bool = False):
        from mm_models_video.cogvideox import CogVideoXSchedule

        if expand_timesteps:
            raise ValueError("CogVideoX takes one timestep per sample (no expand_timesteps)")
        self.expand_timesteps = False
        self.config, self.modules, self.text_length = config, modules, text_length
        self.i2v = config.in_channels != config.out_channels
        self.encoders = cogvideox_feature_encoders(modules["vae"], modules["text_encoder"])
        self.schedule = CogVideoXSchedule(num_train_timesteps=diffusion.num_train_timesteps,
                                          snr_shift_scale=diffusion.snr_shift_scale,
                                          rescale_betas_zero_snr=diffusion.rescale_betas_zero_snr)

    def latent_frames(self, settings: Settings):
        """(frames drawn, frames kept): 1.5 pads in front to a multiple of patch_size_t."""
        from mm_models_video.cogvideox.conditioning import patch_frames

        kept = (settings.num_frames - 1) // 4 + 1
        return (patch_frames(kept, self.config.patch_size_t) if self.config.patch_size_t else kept), kept

    def noise_shape(self, settings: Settings) -> tuple:
        return (1, self.latent_frames(settings)[0], self.config.out_channels, settings.height // 8,
                settings.width // 8)

    def image_inputs(self, image: np.ndarray, settings: Settings) -> Dict:
        import mindspore as ms

        from mm_models_video.cogvideox.conditioning import image_condition, image_latent_scale

        vae = self.modules["vae"]
        first = ms.Tensor(image[None, :, None].astype(np.float32))
        latents = (vae.encode(first).mean * image_latent_scale(vae.config)).asnumpy().transpose(0, 2, 1, 3, 4)
        return {"condition": image_condition(latents, self.latent_frames(settings)[0])}

    def latents(self, predict: Predict, prompt: str, image, settings: Settings, index: int) -> np.ndarray:
        from mm_models_video.cogvideox import rotary_tables
        from mm_models_video.cogvideox.conditioning import I2V_OFS

        sampler = self.sampler_of(settings)
        conditioned, unconditioned = self.prompt_embeds(prompt), self.prompt_embeds(settings.negative_prompt)
        extra, noise = self.conditions(image, settings), self.noise(settings, index)
        _, frames, _, height, width = noise.shape
        fixed = {}
        if self.config.ofs_embed_dim:
            fixed["ofs"] = np.full((1,), I2V_OFS, np.float32)
        if self.config.use_rotary_positional_embeddings:
            fixed["image_rotary_emb"] = rotary_tables(self.config, frames, height, width)

        def model_output(text):
            def run(x, t):
                hidden = np.concatenate([x, extra["condition"]], 2) if extra else x
                return predict({"hidden_states": hidden, "encoder_hidden_states": text, "timestep": t, **fixed},
                               x.shape)
            return run

        return self.schedule.sample(model_output(conditioned), noise, settings.steps, sampler, settings.guidance,
                                    model_output(unconditioned), rng=np.random.default_rng([settings.seed, index, 1]))

    def decode(self, latents: np.ndarray, settings: Settings) -> np.ndarray:
        import mindspore as ms

        drawn, kept = self.latent_frames(settings)
        latents = latents[:, drawn - kept:]  # 1.5: the frames padded in front go
        vae = self.modules["vae"]
        z = ms.Tensor(np.ascontiguousarray(latents.transpose(0, 2, 1, 3, 4)) / float(vae.config["scaling_factor"]))
        return vae.decode(z).asnumpy()[0]


def is_i2v(config) -> bool:
    """An image-to-video DiT: it takes more channels than it gives (the image's latents and, Wan, a
    mask beside the noise), or Wan's CLIP image features (an image_dim)."""
    return bool(getattr(config, "image_dim", None)) or config.in_channels != config.out_channels


def recipe_sampler(sampler_class, recipe, topo, config, expand_timesteps: bool = False) -> WanSampler:
    """The sampler of a training run: the tiny set's encoders for data.kind tiny_video, else the
    folders of data.vae / data.text_encoder / data.tokenizer (and the image encoder for I2V)."""
    data, i2v = recipe.data, bool(getattr(config, "image_dim", None)) or is_i2v(config)
    clip = bool(getattr(config, "image_dim", None)) if sampler_class.family == "wan" else i2v
    if data.kind == "tiny_video":
        modules = sampler_class.tiny_modules(clip, wan2_2=expand_timesteps)
        modules["tokenizer"] = tiny_video.tokenizer(data.path or tiny_video.default_folder())
    else:
        folders = encoder_sources(data, topo, sampler_class.family, recipe.model.path)
        if not (folders["vae"] and folders["text_encoder"]):
            raise ValueError("samples decode with the VAE and encode prompts with the text encoder: set data.vae and "
                             "data.text_encoder (their folders, or tiny)")
        modules = sampler_class.folder_modules(folders, clip)
        modules["tokenizer"] = load_tokenizer(folders["tokenizer"], pad_token="<pad>", eos_token="</s>")
    return sampler_class(config, modules, clip_shape(data)["text_length"], recipe.section("diffusion"),
                         expand_timesteps=expand_timesteps)


def pipeline_sampler(sampler_class, folder: str, config, diffusion_section):
    """A video sampler from a diffusers pipeline folder's encoders, scheduler config and
    model_index.json (expand_timesteps)."""
    folders = {f: os.path.join(folder, f) if os.path.isdir(os.path.join(folder, f)) else None
               for f in tiny_video.ENCODER_FIELDS}
    clip = bool(getattr(config, "image_dim", None)) if sampler_class.family == "wan" else is_i2v(config)
    modules = sampler_class.folder_modules(folders, clip)
    modules["tokenizer"] = load_tokenizer(folders["tokenizer"] or folders["text_encoder"])
    scheduler, path = {}, os.path.join(folder, "scheduler", "scheduler_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            scheduler = json.load(f)
    diffusion = sampler_class.pipeline_diffusion(scheduler, diffusion_section)
    index, path = {}, os.path.join(folder, "model_index.json")
    if os.path.isfile(path):
        with open(path) as f:
            index = json.load(f)
    return sampler_class(config, modules, sampler_class.pipeline_text_length, diffusion,
                         expand_timesteps=bool(index.get("expand_timesteps")))


def recipe_settings(recipe) -> Settings:
    """The eval section's sample settings; frames, size and fps default to the training clips'."""

    e, shape = recipe.eval, clip_shape(recipe.data)
    side = max(16, int(shape["max_area"] ** 0.5) // 16 * 16)
    fps = tiny_video.FPS if recipe.data.kind == "tiny_video" else recipe.data.fps
    return Settings(num_frames=e.num_frames or shape["num_frames"], height=e.height or side, width=e.width or side,
                    steps=e.steps, guidance=e.guidance, sampler=e.sampler, seed=e.seed,
                    negative_prompt=e.negative_prompt, fps=fps)


def clip(sampler: WanSampler, predict: Predict, prompt: str, image: Optional[str], settings: Settings,
         index: int = 0) -> np.ndarray:
    """One sample as frames (F, H, W, 3) uint8."""
    first = load_image(image, settings.height, settings.width) if image else None
    latents = sampler.latents(predict, prompt, first, settings, index)
    return samples.to_frames(sampler.decode(latents, settings))


def write_clips(sampler: WanSampler, predict: Predict, prompts: List[str], images: List[str], settings: Settings,
                out: str, writer: bool) -> Dict:
    """One mp4 and one contact sheet per prompt under ``out`` (``writer``: this rank writes);
    {"files": [...], "images": {name: contact sheet}} — and prompts.txt naming each."""
    files, sheets, lines = [], {}, []
    for index, prompt in enumerate(prompts):
        frames = clip(sampler, predict, prompt, images[index] if images else None, settings, index)
        if not writer:
            continue
        name = f"sample_{index}"
        sheet = samples.contact_sheet(frames, scale=max(1, 128 // max(frames.shape[1:3])))
        files += [samples.write_mp4(os.path.join(out, f"{name}.mp4"), frames, settings.fps),
                  samples.write_png(os.path.join(out, f"{name}.png"), sheet)]
        sheets[name] = sheet
        lines.append(f"{name}: {prompt}" + (f" (first frame {images[index]})" if images and images[index] else ""))
    if writer:
        with open(os.path.join(out, "prompts.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        files.append(os.path.join(out, "prompts.txt"))
    return {"files": files, "images": sheets}
