"""A CogVideoX recipe's data: the video pipeline of mm_train.families.video.data with CogVideoX's
encoders and objective.

Features: ``latents`` = scaling_factor x the AutoencoderKLCogVideoX latent mean, (C, F, H, W) as
cached; ``prompt_embeds`` = the T5 encoder's last hidden state over the caption padded to
data.text_max_length, without an attention mask (the CogVideoX pipelines encode the padding too);
for an I2V model ``image_latents`` (C, 1, H, W): the latent mean of the noise-augmented first
frame, scaled as the I2V pipeline scales it (mm_models_video.cogvideox.conditioning; the noise is
drawn from (train.seed, sample) into the cache, from (train.seed, step, sample) online).
Each sample becomes v-prediction inputs (mm_models_video.cogvideox.objective, seeded by
(train.seed, step, sample) as Wan's): latents permuted to (F, C, H, W) and, for 1.5, padded in
front to whole temporal patches; an integer timestep; the velocity target; for I2V the image
condition (dropped with diffusion.noised_image_dropout) on channels after the noisy latents and
1.5's ofs. The micro-batch carries the pipeline's rotary tables for its latent shape.
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from mm_train.evaluation import VALIDATION_STEP
from mm_train.families.video import tiny as tiny_video
from mm_train.families.video.data import WanTrainData
from mm_train.families.video.encoders import cogvideox_feature_encoders

# Deferred imports: mm-models-video (optional: a missing one is named when a run needs it).


class CogVideoXTrainData(WanTrainData):
    """See the module docstring; ``config``: the transformer's CogVideoXTransformerConfig."""

    cache_name = "cogvideox"
    shared_inputs = ("image_rotary_emb",)  # the rotary tables of the clips' one latent shape
    i2v_features = ("image_latents",)
    splits_vae_frames = True

    def __init__(self, recipe, topo, config):
        self.model_config = config
        super().__init__(recipe, topo, i2v=config.in_channels != config.out_channels)

    def for_recipe(self, recipe):
        return type(self)(recipe, self.topo, self.model_config)

    def image_noise(self, i2v: bool) -> Optional[dict]:
        d = self.recipe.section("diffusion")
        return {"seed": self.recipe.train.seed, "mean": d.image_noise_mean, "std": d.image_noise_std} if i2v else None

    def tiny_encoders(self, i2v: bool):
        return cogvideox_feature_encoders(*tiny_video.cogvideox_encoders(), self.image_noise(i2v), self.frame_group)

    def folder_encoders(self, folders, i2v: bool):
        from mm_models_video import AutoencoderKLCogVideoX, T5EncoderModel

        return cogvideox_feature_encoders(AutoencoderKLCogVideoX.from_pretrained(folders["vae"]),
                                          T5EncoderModel.from_pretrained(folders["text_encoder"]),
                                          self.image_noise(i2v), self.frame_group)

    def make_schedule(self):
        from mm_models_video.cogvideox import CogVideoXSchedule

        d = self.recipe.section("diffusion")
        return CogVideoXSchedule(num_train_timesteps=d.num_train_timesteps, snr_shift_scale=d.snr_shift_scale,
                                 rescale_betas_zero_snr=d.rescale_betas_zero_snr)

    def prepare(self, step: int, batches):
        if self.online:  # the image noise of clips encoded now is drawn per step
            batches = [dict(b, step=np.int64(step)) for b in batches]
        return super().prepare(step, batches)

    def flow_inputs(self, step: int, batch: Dict) -> Dict:
        from mm_models_video.cogvideox import rotary_tables
        from mm_models_video.cogvideox.conditioning import I2V_OFS, image_condition, pad_to_patch_frames

        config, image_dropout = self.model_config, self.recipe.section("diffusion").noised_image_dropout
        dropout = self.caption_dropout(step)
        rows, texts, conditions = [], [], []
        for row, index in enumerate(batch["index"]):
            rng = np.random.default_rng([self.recipe.train.seed, step, int(index)])
            x0 = np.ascontiguousarray(batch["latents"][row:row + 1].transpose(0, 2, 1, 3, 4), np.float32)
            rows.append(self.schedule.training_batch(pad_to_patch_frames(x0, config.patch_size_t), rng))
            dropped = dropout and rng.random() < dropout
            texts.append(self.null_embeds if dropped else batch["prompt_embeds"][row])
            if self.i2v:
                condition = image_condition(batch["image_latents"][row:row + 1].transpose(0, 2, 1, 3, 4), x0.shape[1])
                if image_dropout and step != VALIDATION_STEP and rng.random() < image_dropout:
                    condition = np.zeros_like(condition)
                conditions.append(pad_to_patch_frames(condition, config.patch_size_t))
        out = {key: np.concatenate([r[key] for r in rows]) for key in ("hidden_states", "timestep", "target")}
        out["encoder_hidden_states"] = np.stack(texts).astype(np.float32)
        if self.i2v:  # [noisy latents | image condition] on channels, as the I2V pipeline
            out["hidden_states"] = np.concatenate([out["hidden_states"], np.concatenate(conditions)], axis=2)
        if config.ofs_embed_dim:
            out["ofs"] = np.full((len(rows),), I2V_OFS, np.float32)
        _, frames, _, height, width = out["hidden_states"].shape
        if config.use_rotary_positional_embeddings:
            out["image_rotary_emb"] = rotary_tables(config, frames, height, width)
        return out
