"""A video recipe's data: clips encoded into features (once into a cache, or online), then flow matching.

`WanTrainData` (the data of the Wan family's task, mm_train.families.video.wan) makes sure a
feature cache exists — for ``tiny_video`` (the built-in set, encoded by its tiny random VAE and
UMT5) and ``video`` (the user's annotations, encoded by the recipe's VAE and text encoder),
every rank encodes its share (mm-data's `build_feature_cache`: centre crops, VAE latent means
normalised by the VAE's latents_mean / std, text embeddings zeroed past the caption) — or uses a
ready one (``video_features``). Training then reads `FeatureDataset`
in global batches of one latent shape (`BucketBatchSampler` keyed by feature shapes), this rank's
share split into micro-batches, and turns each sample into flow-matching inputs: u, noise and
caption dropout drawn from a generator seeded by (train.seed, step, sample), so a step's inputs
are the same under every layout and after resuming. For an I2V DiT (config ``image_dim``) the
cache also holds the first frame's CLIP features (penultimate layer) and the VAE latents of the
first frame followed by black frames; the model's input is [noisy latents | 4 mask channels (1 on
the first latent frame) | those latents], as diffusers' Wan I2V pipeline builds it.

With ``data.online`` the clips are decoded and encoded every step instead (random clip starts and
crops seeded by (seed, epoch, sample), captions dropped by the data set): no cache, fresh
augmentation, the encoders' cost paid in every step — shared out over the tp x cp ranks with
``data.encoder_dp`` (`mm_train.families.video.encoder_dp`). Latents are the VAE's means either way.

With train.objective dpo the annotations are clip pairs (mm_data.video.pairs; the tiny set's
data_pairs.json): the cache holds both clips of every pair and their list, a sample is a pair
(`mm_data.FeaturePairs`), and a micro-batch of P pairs becomes 2P rows, the chosen clips first —
each clip's inputs made by the family's own `flow_inputs` from the same generator, so both clips
of a pair get the same noise and timestep (and the same caption dropout), as Diffusion-DPO needs.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import numpy as np
from safetensors.numpy import load_file, save_file

from mm_train import node_disks
from mm_train.evaluation import VALIDATION_STEP, training_split
from mm_train.families.video import cache_nodes, encoder_dp
from mm_train.families.video import tiny as tiny_video
from mm_train.families.video.encoders import encoder_sources, wan_feature_encoders, wan_folder_encoders
from mm_train.families.video.wan_pipeline import first_frame_clean, token_timesteps
from mm_train.recipe import Recipe
from mm_train.task import load_tokenizer, once_on_rank_zero

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore); mm-data,
# mm-models-video (optional: a missing one is named when a run needs it).

NULL_CAPTION = "null_prompt_embeds.safetensors"  # the empty caption's embedding, for caption dropout
REJECTED = "rejected_"  # a pair's rejected clip's features (mm_data.FeaturePairs)
BUCKET_STRIDE = 16  # frame sides in multiples of the VAE's 8 x the DiT's patch of 2


def clip_shape(data, read_cache: bool = False) -> Dict[str, int]:
    """{num_frames, max_area, height, width, text_length} of a recipe's largest clip: the built-in
    clips' own for data.kind tiny_video, else the data section's (clips resampled to num_frames,
    frames to the aspect bucket of max_area nearest theirs: height x width is the bucket of the
    most pixels, `largest_frame`); with ``read_cache`` (the planner) a ready cache's largest clip
    for video_features, when its index is there."""
    if data.kind == "tiny_video":
        side = tiny_video.SIZE
        return {"num_frames": tiny_video.FRAMES, "max_area": side ** 2, "height": side, "width": side,
                "text_length": 16}
    if data.kind == "video_features" and read_cache:
        cached = _cached_shape(data.path)
        if cached:
            return cached
    height, width = largest_frame(data.max_area)
    return {"num_frames": data.num_frames, "max_area": data.max_area, "height": height, "width": width,
            "text_length": data.text_max_length}


def largest_frame(max_area: int) -> Tuple[int, int]:
    """(height, width) of the aspect bucket of ``max_area`` with the most pixels (the training data's
    buckets, `_Source`): 480 x 720 for 345,600 pixels (a square would be 576 x 576)."""
    from mm_data.video import AspectBuckets

    buckets = AspectBuckets(max_area=max_area, stride=BUCKET_STRIDE)
    return max((buckets.size(ratio) for ratio in buckets.ratios), key=lambda size: size[0] * size[1])


def _cached_shape(folder: str):
    """The largest clip of a feature cache's index (VAE latents (C, F, H, W): 4 x temporal and 8 x
    spatial compression), or None without an index."""
    from mm_data.feature_cache import FeatureDataset

    try:
        entries = FeatureDataset(folder or "").entries  # reads the index only
    except ValueError:  # no index (the preflight names the missing cache)
        return None
    frames = text = 0
    frame = (0, 0)
    for entry in entries:
        shapes = entry["features"]
        _, f, h, w = shapes["latents"]
        frames, frame = max(frames, (f - 1) * 4 + 1), max(frame, (8 * h, 8 * w), key=lambda hw: hw[0] * hw[1])
        text = max(text, shapes.get("prompt_embeds", [0])[0])
    return {"num_frames": frames, "max_area": frame[0] * frame[1], "height": frame[0], "width": frame[1],
            "text_length": text}


class _Source:
    """Where a recipe's clips come from and how they are read and encoded (``family``: the data
    class, whose `tiny_encoders` / `folder_encoders` build the feature encoders)."""

    def __init__(self, recipe: Recipe, topo, i2v: bool, family=None):
        from mm_data.video import AspectBuckets, FrameBuckets

        data = recipe.data
        self.i2v, self.data, self.family = i2v, data, family
        shape = clip_shape(data)
        self.frames = FrameBuckets(num_frames=shape["num_frames"])
        self.buckets = AspectBuckets(max_area=shape["max_area"], stride=BUCKET_STRIDE)
        self.text_length = shape["text_length"]
        self.pairs = recipe.train.objective == "dpo"
        if data.kind == "tiny_video":
            source = data.path or tiny_video.default_folder()
            once_on_rank_zero(topo, lambda: tiny_video.generate(source, data.samples))
            annotations = tiny_video.PAIRS if self.pairs else "data.json"
            self.annotations, self.tokenizer = os.path.join(source, annotations), tiny_video.tokenizer(source)
            image = ("i2v" if family.clip else "i2v-latents") if i2v else "t2v"  # i2v-latents: no CLIP (I2V-A14B)
            kind = image + ("-pairs" if self.pairs else "")
            self.cache = data.features_dir or os.path.join(source, f"features-{family.cache_name}-{kind}"
                                                           if family.cache_name else f"features-{kind}")
            self.fps = tiny_video.FPS
        else:
            self.folders = encoder_sources(data, topo, family.cache_name or "wan", recipe.model.path)
            self.annotations = data.path
            self.tokenizer = load_tokenizer(self.folders["tokenizer"], pad_token="<pad>", eos_token="</s>")
            self.cache = data.features_dir or os.path.join(recipe.output_dir, "features")
            self.fps = data.fps

    def dataset(self, random_crop: bool, caption_dropout: float = 0.0, seed: int = 0):
        from mm_data.video import VideoTextDataset

        return VideoTextDataset.from_annotations(
            self.annotations, max_bad_fraction=self.data.max_bad_fraction, frames=self.frames, buckets=self.buckets,
            fps=self.fps, tokenizer=self.tokenizer, max_text_length=self.text_length, random_crop=random_crop,
            caption_dropout=caption_dropout, seed=seed, pairs=self.pairs, data_format=self.data.format)

    def encoders(self):
        """{feature name: numpy-in numpy-out encoder}: the tiny set's random ones or the recipe's."""
        if self.data.kind == "tiny_video":
            return self.family.tiny_encoders(self.i2v)
        return self.family.folder_encoders(self.folders, self.i2v)


class WanTrainData:
    """See the module docstring. A family's data class derives from it and changes what is its
    own: `tiny_encoders` / `folder_encoders` (the feature encoders), `make_schedule` and
    `flow_inputs` (features to the model's keywords), ``cache_name`` (the tiny set's cache folder)."""

    cache_name = ""  # Wan's tiny caches keep their names: features-t2v / features-i2v (TI2V: wan2_2-...)
    shared_inputs: Tuple[str, ...] = ()  # forward keywords the same for every row (not per clip)
    splits_vae_frames = True  # whether data.vae_context_parallel > 1 is supported (a context-parallel VAE)
    i2v_features = ("image_embeds", "condition")  # what an I2V model's cache must hold

    @property
    def wan2_2_vae(self) -> bool:
        """The tiny set encodes a TI2V model's clips with Wan2.2's VAE layout (the real TI2V-5B's own)."""
        return self.pipeline is not None and self.pipeline.expand_timesteps

    def tiny_encoders(self, i2v: bool):
        vae, text, image, processor = tiny_video.encoders(image=self.clip, wan2_2=self.wan2_2_vae)
        return wan_feature_encoders(vae, text, image, processor, condition=i2v, frame_group=self.frame_group)

    def folder_encoders(self, folders, i2v: bool):
        return wan_folder_encoders(folders, i2v, self.clip, self.frame_group)

    def make_schedule(self):
        from mm_models_video.flow_matching import FlowMatchingSchedule

        d = self.recipe.section("diffusion")
        return FlowMatchingSchedule(d.num_train_timesteps, d.shift)

    def __init__(self, recipe: Recipe, topo, i2v: bool, clip: Optional[bool] = None, pipeline=None,
                 patch=(1, 2, 2)):
        from mm_data import BucketBatchSampler, FeatureDataset, FeaturePairs

        self.recipe, self.topo = recipe, topo
        data, train = recipe.data, recipe.train
        self.i2v = i2v  # an I2V DiT: the image's latents and a mask beside the noise
        self.clip = i2v if clip is None else clip  # its CLIP image features too (Wan2.1 I2V; not I2V-A14B)
        # Wan2.2 (mm_train.families.video.wan_pipeline.WanPipelineSettings): TI2V, experts; and the patches
        self.pipeline, self.patch = pipeline, tuple(patch)
        if self.wan2_2_vae:
            self.cache_name = "wan2_2"
        self.online = data.online and data.kind != "video_features"
        self.pairs = train.objective == "dpo"
        if self.pairs and self.online:
            raise ValueError(objective_problems(recipe)[0])
        self.cache_folder, self.cache_skips = None, []
        self.frame_group = self._vae_group(data, topo)
        # who writes the cache's shared files: rank 0, or each node's first rank on node-local disks
        self.cache_disks = node_disks.find(topo, cache_nodes.shared_fs(recipe))
        if self.online:  # clips decoded and encoded every step (random crops and clip starts)
            source = _Source(recipe, topo, self.i2v, self)
            self.annotations = source.annotations
            self.dataset = source.dataset(random_crop=True, caption_dropout=data.caption_dropout, seed=train.seed)
            self.encoders, self.null_embeds = source.encoders(), None
        else:
            folder = data.path if data.kind == "video_features" else self._encode(_Source(recipe, topo, self.i2v, self),
                                                                                  topo)
            features, self.cache_folder = FeatureDataset(folder), folder
            self.dataset = FeaturePairs(folder, features, data.max_bad_fraction) if self.pairs else features
            wanted = [n for n in self.i2v_features if n != "image_embeds" or self.clip] if self.i2v else []
            missing = [n for n in wanted if n not in features.entries[0]["features"]]
            if missing:
                raise ValueError(f"the feature cache {folder} has no I2V features ({', '.join(missing)}); build it "
                                 "for an I2V model")
            null = os.path.join(folder, NULL_CAPTION)
            self.null_embeds = load_file(null)["prompt_embeds"] if os.path.exists(null) else None
            if data.caption_dropout and self.null_embeds is None:
                raise ValueError(f"data.caption_dropout needs the empty caption's embedding {null}; "
                                 "rebuild the cache with mm-train (it writes one)")
        # eval.fraction: held out for validation (mm_train.evaluation), never trained on
        indices, self.held_out = training_split(recipe, len(self.dataset))
        self.sampler = BucketBatchSampler(len(self.dataset), train.global_batch_size, topo.dp.rank, topo.dp.size,
                                          keys=self.dataset.keys, seed=train.seed, indices=indices,
                                          blocks=getattr(self.dataset, "block_sizes", None))
        if self.cache_folder is not None and not self.cache_disks.shared:
            held_out = () if self.held_out is None else self.held_out
            reads = cache_nodes.samples_read(self.sampler, train.steps, held_out,
                                             self.dataset.pairs if self.pairs else None)
            cache_nodes.require_node_part(features, reads, self.cache_disks, topo)
        self.schedule = self.make_schedule()

    def for_recipe(self, recipe):
        """The data of another recipe of this family (the validation split at eval.path)."""
        return type(self)(recipe, self.topo, self.i2v, self.clip, self.pipeline, self.patch)

    def _vae_group(self, data, topo):
        """The ranks this one encodes each clip with (data.vae_context_parallel consecutive ranks), or None."""
        n = data.vae_context_parallel
        if n == 1:
            return None
        if not self.splits_vae_frames:
            raise ValueError("data.vae_context_parallel splits a VAE's frames over ranks; this family's VAE encodes "
                             "whole clips on each rank: leave it 1")
        if self.online or data.kind == "video_features":
            raise ValueError("data.vae_context_parallel applies while the feature cache is built (data.kind video or "
                             "tiny_video, data.online false)")
        if topo.world_size % n:
            raise ValueError(f"data.vae_context_parallel={n} must divide the {topo.world_size} ranks")
        from mm_parallel.topology import Group

        first = topo.rank - topo.rank % n
        return Group(tuple(range(first, first + n)), topo.rank % n, "vae_context_parallel")

    def files(self):
        """(annotation files, media files) of what is trained on: the clips, or the feature cache."""
        if self.cache_folder is None and self.dataset.shards is not None:  # shards: the manifest, the files by size
            shards = self.dataset.shards
            return [shards.manifest] if shards.manifest else [], [shard.path for shard in shards.shards]
        if self.cache_folder is None:
            return [self.annotations], [record.path for record in self.dataset.records]
        names = sorted(os.listdir(self.cache_folder))
        return ([os.path.join(self.cache_folder, n) for n in names if n.endswith(".jsonl")],
                [os.path.join(self.cache_folder, n) for n in names if n.endswith(".safetensors")])

    def _encode(self, source: _Source, topo) -> str:
        """Build (or finish) the feature cache, every rank its share; returns its folder. The clips
        this rank skipped while encoding are kept in ``cache_skips`` (source, reason)."""
        from mm_data import build_feature_cache
        from mm_data.feature_cache import cached_indices
        from mm_parallel import comm

        folder, encoders, clips = source.cache, source.encoders(), source.dataset(random_crop=False)
        disks = self.cache_disks
        group, done = self.frame_group, None
        if group is not None:  # a group encodes each clip together, its first rank writes
            done = cached_indices(folder)
            comm.barrier(topo.world)  # every rank has read the index before any writes
        n = 1 if group is None else group.size
        writer = group is None or group.rank == 0
        build_feature_cache(clips, encoders, folder, batch_size=1, rank=topo.rank // n,
                            world_size=topo.world_size // n, done=done, write=writer)
        if not disks.shared:
            comm.barrier(topo.world)  # every node's part is written before the indexes are exchanged
            cache_nodes.exchange_indexes(folder, disks, topo)
        if source.pairs and disks.folder_writer:  # which clips make a pair (mm_data.FeaturePairs reads it)
            from mm_data.video.pairs import write_pair_list

            write_pair_list(folder, clips.clip_pairs)
        self.cache_skips = list(clips.bad_input.skipped) if writer else []
        if disks.folder_writer and not os.path.exists(os.path.join(folder, NULL_CAPTION)):
            empty = source.tokenizer("", padding="max_length", max_length=source.text_length, return_tensors="np")
            null = encoders["prompt_embeds"]({k: v.astype(np.int64) for k, v in empty.items()})[0]
            save_file({"prompt_embeds": np.ascontiguousarray(null, np.float32)}, os.path.join(folder, NULL_CAPTION))
        if topo.world_size > 1:
            comm.barrier(topo.world)  # every rank's shards are written
        return folder

    def caption_dropout(self, step: int) -> float:
        """The share of captions flow_inputs drops at ``step``: none when the data set already
        dropped them (online) or for validation."""
        return 0.0 if self.online or step == VALIDATION_STEP else self.recipe.data.caption_dropout

    def flow_inputs(self, step: int, batch: Dict) -> Dict[str, np.ndarray]:
        """The model's keywords for a micro-batch of features at ``step`` (cached, or just encoded:
        then the data set already dropped captions); a Wan2.2 model's experts and TI2V as
        mm_train.families.video.wan_pipeline says."""
        d, seed, settings = self.recipe.section("diffusion"), self.recipe.train.seed, self.pipeline
        dropout = self.caption_dropout(step)
        u_range = None if settings is None else \
            settings.micro_batch_range(self.schedule, d.density, seed, step, int(batch["index"][0]))
        ti2v = settings is not None and settings.expand_timesteps
        share = settings.image_to_video_share(self.recipe.data) if ti2v else 0.0
        rows, texts, first_frames = [], [], []
        for row, index in enumerate(batch["index"]):
            rng = np.random.default_rng([seed, step, int(index)])
            x0 = batch["latents"][row:row + 1]
            rows.append(self.schedule.training_batch(x0, rng, d.density, d.weighting, u_range=u_range))
            dropped = dropout and rng.random() < dropout
            texts.append(self.null_embeds if dropped else batch["prompt_embeds"][row])
            if ti2v:
                first_frames.append(bool(rng.random() < share))
                if first_frames[-1]:
                    first_frame_clean(rows[-1], x0)
        out = {key: np.concatenate([r[key] for r in rows]) for key in ("hidden_states", "timestep", "target")}
        out["encoder_hidden_states"] = np.stack(texts).astype(np.float32)
        if ti2v:
            out["timestep"] = token_timesteps(out["timestep"], out["hidden_states"].shape, self.patch, first_frames)
        if self.i2v:  # [noisy latents | mask: the first latent frame is given | the image's latents]
            condition = batch["condition"]
            mask = np.zeros((len(condition), 4) + condition.shape[2:], np.float32)
            mask[:, :, 0] = 1.0
            out["hidden_states"] = np.concatenate([out["hidden_states"], mask, condition], 1)
        if self.clip:
            out["encoder_hidden_states_image"] = batch["image_embeds"].astype(np.float32)
        if d.weighting != "none":
            out["loss_weights"] = np.concatenate([r["loss_weights"] for r in rows])
        return out

    def prepare(self, step: int, batches):
        """A step's micro-batches of features (of clips, encoded now when training online) as
        flow-matching forward keywords."""
        if self.online:  # data.encoder_dp: the tp x cp ranks encode different micro-batches and gather
            group = encoder_dp.encoder_group(self.topo) if self.recipe.data.encoder_dp else None
            features = encoder_dp.encode_shared(
                batches, lambda b: {name: encode(b) for name, encode in self.encoders.items()}, group)
            batches = [{"index": b["index"], **encoded} for b, encoded in zip(batches, features)]
        if self.pairs:
            return [self.pair_inputs(step, batch) for batch in batches]
        return [self.flow_inputs(step, batch) for batch in batches]

    def pair_inputs(self, step: int, batch: Dict) -> Dict:
        """A micro-batch of P clip pairs as 2P rows, the chosen clips first, each half made by
        `flow_inputs` from the same per-sample generators (the pair's index): one noise draw and
        timestep per pair; ``clip_pairs`` = P (mm_train.preference_step)."""
        chosen = {k: v for k, v in batch.items() if not k.startswith(REJECTED)}
        rejected = {**chosen, **{k[len(REJECTED):]: v for k, v in batch.items() if k.startswith(REJECTED)}}
        first, second = self.flow_inputs(step, chosen), self.flow_inputs(step, rejected)
        out = {k: first[k] if k in self.shared_inputs else np.concatenate([first[k], second[k]]) for k in first}
        out["clip_pairs"] = np.int64(len(batch["index"]))
        return out


def objective_problems(recipe) -> List[str]:
    """What a video recipe's train.objective dpo cannot mean, before launch: Diffusion-DPO is the
    sigmoid form on denoising errors, from the feature cache."""
    if recipe.train.objective != "dpo":
        return []
    dpo, problems = recipe.dpo, []
    if recipe.data.online and recipe.data.kind != "video_features":
        problems.append("train.objective dpo trains from the feature cache (a pair's clips share one noise draw): set "
                        "data.online false")
    if dpo.reference == "cached":
        problems.append("dpo.reference cached is for answers: a clip's reference error depends on the noise and "
                        "timestep, drawn anew every step; use dpo.reference copy")
    if dpo.method != "sigmoid" or dpo.label_smoothing or dpo.sft_weight:
        problems.append(f"Diffusion-DPO is the sigmoid form alone: set dpo.method sigmoid (not {dpo.method}), "
                        "dpo.label_smoothing 0 and dpo.sft_weight 0")
    return problems


def latent_tokens(batch: Dict, patch_size) -> int:
    _, _, frames, height, width = batch["hidden_states"].shape
    pt, ph, pw = patch_size
    return len(batch["hidden_states"]) * (frames // pt) * (height // ph) * (width // pw)
