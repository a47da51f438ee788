"""A CogVideoX recipe's data: the video pipeline of mm_train.video_data with CogVideoX's encoders
and objective.

Features: ``latents`` = scaling_factor x the AutoencoderKLCogVideoX latent mean, (C, F, H, W) as
cached; ``prompt_embeds`` = the T5 encoder's last hidden state over the caption padded to
data.text_max_length, without an attention mask (the CogVideoX pipelines encode the padding too).
Each sample becomes v-prediction inputs (mm_models_video.cogvideox.objective, seeded by
(train.seed, step, sample) as Wan's): latents permuted to (F, C, H, W), an integer timestep, the
velocity target; the micro-batch carries the pipeline's rotary tables for its latent shape.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from mm_train.video_data import WanTrainData


def cogvideox_encoders(vae, text):
    """{latents, prompt_embeds}: numpy-in numpy-out encoders of a CogVideoX VAE and T5."""
    import mindspore as ms

    scale = float(vae.config["scaling_factor"])

    def latents(batch):
        return (vae.encode(ms.Tensor(batch["video"])).mean * scale).asnumpy()

    def prompt_embeds(batch):
        return text(ms.Tensor(batch["input_ids"])).last_hidden_state.asnumpy()

    return {"latents": latents, "prompt_embeds": prompt_embeds}


def folder_encoders(folders, i2v: bool):
    from mm_models_video import AutoencoderKLCogVideoX, T5EncoderModel

    if i2v:
        raise ValueError("CogVideoX I2V training is not there yet: train a T2V model (in_channels 16, no ofs)")
    return cogvideox_encoders(AutoencoderKLCogVideoX.from_pretrained(folders["vae"]),
                              T5EncoderModel.from_pretrained(folders["text_encoder"]))


class CogVideoXTrainData(WanTrainData):
    """See the module docstring; ``config``: the transformer's CogVideoXTransformerConfig."""

    cache_name = "cogvideox"
    folder_encoders = staticmethod(folder_encoders)

    def __init__(self, recipe, topo, config):
        self.model_config = config
        super().__init__(recipe, topo, i2v=False)

    @staticmethod
    def tiny_encoders(i2v: bool):
        from mm_train import tiny_video

        return cogvideox_encoders(*tiny_video.cogvideox_encoders())

    def make_schedule(self):
        from mm_models_video.cogvideox import CogVideoXSchedule

        d = self.recipe.diffusion
        return CogVideoXSchedule(num_train_timesteps=d.num_train_timesteps, snr_shift_scale=d.snr_shift_scale,
                                 rescale_betas_zero_snr=d.rescale_betas_zero_snr)

    def flow_inputs(self, step: int, batch: Dict) -> Dict:
        from mm_models_video.cogvideox import rotary_tables

        dropout = 0.0 if self.online else self.recipe.data.caption_dropout
        rows, texts = [], []
        for row, index in enumerate(batch["index"]):
            rng = np.random.default_rng([self.recipe.train.seed, step, int(index)])
            x0 = np.ascontiguousarray(batch["latents"][row:row + 1].transpose(0, 2, 1, 3, 4), np.float32)
            rows.append(self.schedule.training_batch(x0, rng))
            dropped = dropout and rng.random() < dropout
            texts.append(self.null_embeds if dropped else batch["prompt_embeds"][row])
        out = {key: np.concatenate([r[key] for r in rows]) for key in ("hidden_states", "timestep", "target")}
        out["encoder_hidden_states"] = np.stack(texts).astype(np.float32)
        _, frames, _, height, width = out["hidden_states"].shape
        if frames % (self.model_config.patch_size_t or 1):
            raise ValueError(f"{frames} latent frames cannot be cut into patches of {self.model_config.patch_size_t} "
                             "frames: choose data.num_frames so that (num_frames - 1) / 4 + 1 divides")
        if self.model_config.use_rotary_positional_embeddings:
            out["image_rotary_emb"] = rotary_tables(self.model_config, frames, height, width)
        return out
