"""The part of a video family's task its data decides: files, skipped clips, the stream of forward
keywords, validation, and samples drawn while training."""

from __future__ import annotations

import dataclasses
import os

from mm_train import samples
from mm_train.evaluation import VALIDATION_STEP
from mm_train.families.video import samples as video_samples
from mm_train.task import FamilyTask


class VideoTask(FamilyTask):
    """The part of a video family's task its data object (``self.data``, a WanTrainData) decides:
    the files it reads, the clips it skipped, and the stream of forward keywords."""

    def data_files(self):
        return self.data.files()

    def samples(self, batch):
        """A micro-batch's samples: its clips, or with train.objective dpo its clip pairs."""
        return int(batch["clip_pairs"]) if "clip_pairs" in batch else super().samples(batch)

    def bad_samples(self):
        """The clips skipped while training online or while building the feature cache."""
        return super().bad_samples() + self.data.cache_skips

    clip_sampler = video_samples.WanSampler  # how samples are drawn (mm_train.families.video.samples)

    @staticmethod
    def prepare_sampling(chunks, recipe) -> None:
        """What the model needs beside its trained weights to sample (a family may lend it more)."""

    def write_samples(self, chunks, out: str, writer: bool):
        """One clip per eval prompt (mm_train.samples / video_samples)."""
        self.prepare_sampling(chunks, self.recipe)
        if getattr(self, "_clip_sampler", None) is None:
            settings = getattr(self, "settings", None)  # Wan2.2's (wan_pipeline.WanPipelineSettings)
            self._clip_sampler = video_samples.recipe_sampler(self.clip_sampler, self.recipe, self.topo,
                                                              chunks[0].config, settings is not None and
                                                              settings.expand_timesteps)
        e = self.recipe.eval
        return video_samples.write_clips(self._clip_sampler, lambda inputs, shape: samples.predict(
            chunks, self.topo, inputs, shape), e.prompts, e.images, video_samples.recipe_settings(self.recipe), out,
            writer)

    def validation_source(self):
        """The held-out part of the training features (eval.fraction), or the clips / feature
        cache at eval.path (encoded into OUT/features-eval like the training data)."""
        if not self.recipe.eval.path:
            return self.data.dataset, self.data.dataset.keys, self.data.held_out
        if self.recipe.data.kind == "tiny_video":
            raise ValueError("eval.path with data.kind tiny_video: the built-in clips have no separate file; "
                             "use eval.fraction")
        if getattr(self, "_validation_data", None) is None:
            data = dataclasses.replace(self.recipe.data, path=self.recipe.eval.path, online=False,
                                       features_dir=os.path.join(self.recipe.output_dir, "features-eval"))
            recipe = dataclasses.replace(self.recipe, data=data, eval=dataclasses.replace(self.recipe.eval, path=None))
            self._validation_data = self.data.for_recipe(recipe)
        return self._validation_data.dataset, self._validation_data.dataset.keys, None

    def validation_inputs(self, batches):
        data = getattr(self, "_validation_data", None) or self.data
        return [self.model_inputs(b) for b in data.prepare(VALIDATION_STEP, batches)]

    def stream(self, first_step: int):
        """The shared loader's micro-batches of features as the model's forward keywords."""
        features = super().stream(first_step)
        try:
            for step, batches in enumerate(features, first_step):
                yield self.data.prepare(step, batches)
        finally:
            features.close()
