"""What a Wan2.2 pipeline adds to the Wan family's training: TI2V's per-token timesteps and clean
first frames, and A14B's experts chosen by noise level.

    settings     model_index.json's expand_timesteps and boundary_ratio (model.path a pipeline
                 folder, or a checkpoint of one), the diffusion section's where it sets them (a
                 model built from an inline config has no folder)
    model        mm_models_video.WanExperts holding the experts model.expert names (a pipeline
                 folder, or an inline config with model.expert), else WanTransformer3DModel
    experts      an expert trains on its own timesteps: the flow-matching draw restricted to its
                 range of u (FlowMatchingSchedule.expert_u_ranges: t >= boundary_ratio x 1000 for
                 the high-noise one). With both, each micro-batch draws its expert — with the
                 probability the density gives its range — from a generator seeded by (seed,
                 step, its first sample, EXPERT_STREAM), then each sample its timestep in that
                 range: the draw is the same under every layout that makes the same micro-batches
    TI2V         each sample is image-to-video with probability data.image_to_video (a draw of
                 the sample's own generator after its noise, timestep and caption dropout): its
                 first latent frame kept clean — its noise set to the latents there, so the input
                 is the image's latents and the target 0, as MindSpeed-MM and DiffSynth-Studio
                 train — and its tokens at timestep 0 (diffusers' expand_timesteps); the others
                 text-to-video, every token at the sample's t
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from mm_train.registry import PIPELINE_KEY

# Deferred imports: mm-models-video (optional: a missing one is named when a run needs it).

EXPERTS = ("high_noise", "low_noise", "both")
EXPERT_STREAM = 7  # the micro-batch expert draw's generator: (seed, step, first sample, EXPERT_STREAM)
DEFAULT_IMAGE_TO_VIDEO = 0.5  # TI2V: half the samples image-to-video, half text-to-video


@dataclass(frozen=True)
class WanPipelineSettings:
    """See the module docstring."""

    expand_timesteps: bool = False
    boundary_ratio: Optional[float] = None
    expert: Optional[str] = None  # model.expert
    pipeline: Optional[dict] = None  # model_index.json of model.path, when it is a pipeline folder
    num_train_timesteps: int = 1000

    @classmethod
    def of(cls, recipe, model_json: dict) -> "WanPipelineSettings":
        pipeline = model_json.get(PIPELINE_KEY)
        d, index = recipe.section("diffusion"), pipeline or {}
        expand = d.expand_timesteps if d.expand_timesteps is not None else bool(index.get("expand_timesteps"))
        ratio = d.boundary_ratio if d.boundary_ratio is not None else index.get("boundary_ratio")
        return cls(expand, ratio, recipe.model.expert, pipeline, d.num_train_timesteps)

    @property
    def experts(self) -> bool:
        """Whether the model is a WanExperts (a pipeline folder, or an inline config with model.expert)."""
        return self.pipeline is not None or self.expert is not None

    def model_class(self):
        """The class `mm_train.loop` builds the model with."""
        from mm_models_video import WanExperts, WanTransformer3DModel

        if not self.experts:
            return WanTransformer3DModel
        fields = {k: v for k, v in (("boundary_ratio", self.boundary_ratio),
                                    ("expand_timesteps", self.expand_timesteps)) if v is not None}
        return WanExperts.choosing(self.expert, fields, self.num_train_timesteps, self.trained_experts() or None)

    def problems(self, recipe) -> List[str]:
        """What the recipe cannot mean with these settings (before launch)."""
        out = []
        trained = self.trained_experts()
        if self.expert is not None and self.boundary_ratio is None:
            out.append(f"model.expert {self.expert} needs the experts' boundary: a Wan2.2 A14B folder (its "
                       "model_index.json's boundary_ratio) or diffusion.boundary_ratio")
        if self.expert is not None and self.pipeline is not None and len(self.folder_experts()) < 2:
            out.append(f"model.expert {self.expert}: {recipe.model.path} holds one denoiser "
                       f"({', '.join(self.folder_experts())}), not a pair of experts; drop model.expert")
        if len(trained) > 1 and recipe.parallel.zero_stage == 3:
            out.append("model.expert both with parallel.zero_stage 3: ranks whose micro-batches chose different "
                       "experts would gather different experts' weights at once; train one expert per run "
                       "(model.expert high_noise / low_noise, as MindSpeed-MM does with FSDP2) or use "
                       "zero_stage 1 / 2")
        other = [name for name in ("transformer", "transformer_2") if name not in trained]
        if len(trained) == 1 and self.boundary_ratio is not None and recipe.eval.prompts and \
                not set(other) <= set(self.folder_experts()):
            out.append(f"eval.prompts: samples cross the experts' boundary and this run trains {trained[0]} alone; "
                       f"set model.path to the Wan2.2 folder that also holds {other[0]} (read for sampling only), "
                       "or drop eval.prompts")
        share = getattr(recipe.data, "image_to_video", None)
        if share is not None and not 0.0 <= share <= 1.0:
            out.append(f"data.image_to_video is a share of samples in [0, 1], got {share}")
        if share is not None and not self.expand_timesteps:
            out.append("data.image_to_video trains TI2V models (expand_timesteps: per-token timesteps); this model "
                       "takes one timestep per sample: drop it")
        return out

    @staticmethod
    def image_to_video_share(data) -> float:
        """data.image_to_video, or DEFAULT_IMAGE_TO_VIDEO unset."""
        share = getattr(data, "image_to_video", None)
        return DEFAULT_IMAGE_TO_VIDEO if share is None else float(share)

    def folder_experts(self) -> List[str]:
        from mm_models_video.wan.experts import pipeline_experts

        return pipeline_experts(self.pipeline or {})

    def trained_experts(self) -> Tuple[str, ...]:
        """The diffusers components trained: ("transformer",) / ("transformer_2",) / both, or () for
        a plain WanTransformer3DModel."""
        from mm_models_video.wan.experts import EXPERTS as COMPONENTS

        if not self.experts:
            return ()
        return COMPONENTS[self.expert] if self.expert else tuple(self.folder_experts())

    # -- timesteps ---------------------------------------------------------------------------------

    def u_ranges(self, schedule) -> List[Tuple[float, float]]:
        """The u ranges the trained experts cover (none: the whole schedule)."""
        from mm_models_video.wan.experts import HIGH

        trained = self.trained_experts()
        if self.boundary_ratio is None or not trained:
            return []
        high, low = schedule.expert_u_ranges(self.boundary_ratio * schedule.num_train_timesteps)
        return [high if name == HIGH else low for name in trained]

    def micro_batch_range(self, schedule, density: str, seed: int, step: int, first: int):
        """The u range of a micro-batch whose first sample is ``first`` (module docstring), or None."""
        ranges = self.u_ranges(schedule)
        if len(ranges) < 2:
            return ranges[0] if ranges else None
        masses = np.array([np.diff(schedule.density_cdf(np.array(r), density))[0] for r in ranges])
        rng = np.random.default_rng([seed, step, first, EXPERT_STREAM])
        return ranges[int(rng.choice(len(ranges), p=masses / masses.sum()))]


def borrow_missing_experts(chunks, model_path: Optional[str]) -> None:
    """A one-expert run's model chunks given the other expert for sampling, from model.path's
    pipeline folder (frozen, not trained or saved: WanExperts.borrow); nothing for other models."""
    from mm_models_video import WanExperts, WanTransformer3DModel

    for chunk in chunks:
        for name in chunk.missing() if isinstance(chunk, WanExperts) else []:
            folder = os.path.join(model_path or "", name)
            if not model_path or not os.path.isfile(os.path.join(folder, "config.json")):
                raise ValueError(f"sampling crosses the experts' boundary and the model does not hold {name}: set "
                                 "model.path to the Wan2.2 folder that holds it (read for sampling only)")
            chunk.borrow(name, WanTransformer3DModel.from_pretrained(folder, chunk.topology, chunk=chunk.chunk))


def first_frame_clean(row: dict, x0: np.ndarray) -> None:
    """An image-to-video sample of a TI2V model (module docstring): the first latent frame's input
    the clean latents, its target 0 (in place)."""
    row["hidden_states"][:, :, 0] = x0[:, :, 0]
    row["target"][:, :, 0] = 0.0


def token_timesteps(t: np.ndarray, latents_shape, patch, image_to_video: np.ndarray) -> np.ndarray:
    """(B, S) per-token timesteps (diffusers' expand_timesteps): each sample's t, 0 on the first
    latent frame's tokens of the image-to-video ones."""
    _, _, frames, height, width = latents_shape
    per_frame = (height // patch[1]) * (width // patch[2])
    out = np.repeat(np.asarray(t, np.float32).reshape(-1, 1), (frames // patch[0]) * per_frame, 1)
    out[np.asarray(image_to_video, bool), :per_frame] = 0.0
    return out
