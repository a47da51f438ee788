"""CogVideoXTransformer3DModel: the MindSpore twin of diffusers' class of the same name (1.0, 1.5).

    latents (B, F, C, H, W) -> patches -> video tokens (B, S, D)
        1.0: a p x p patch of each frame (patch_embed.proj a Conv2d), S = F h w
        1.5: a p_t x p x p patch (patch_embed.proj a Linear), S = F / p_t h w
    text (B, T, text_embed_dim) -> text_proj -> (B, T, D);  x = [text ; video]
        (+ the sincos / learned position table over the joint rows where the config uses one)
    temb = time_embedding(sinusoid(timestep))  (+ ofs_embedding(sinusoid(ofs)), 1.5 I2V)
    blocks (mm_models_video.cogvideox.transformer), then on the video rows
    out = proj_out(AdaLN(norm_final(x_video), temb)) -> unpatchify (B, F, C_out, H, W)

Same config (config.json of a diffusers folder), parameter names (``transformer_blocks.3.attn1.to_q.weight``,
``patch_embed.proj.weight`` ...), forward keywords (``hidden_states``, ``encoder_hidden_states``,
``timestep``, ``timestep_cond``, ``ofs``, ``image_rotary_emb`` as a (cos, sin) pair over the video
tokens, which `rotary_tables` computes as the pipelines do, ``return_dict``) and output
(``sample``). One keyword more, as the Wan twin: ``target`` (B, F, C_out, H, W) with optional
per-sample ``loss_weights``; the output then holds ``loss`` = mean((sample - target)^2) (weighted
per sample). With the velocity as target this is the v-prediction objective of diffusers' CogVideoX
training scripts: they compare x0_pred = sqrt(a) x_t - sqrt(1 - a) out with x0 weighted by
1 / (1 - a), and since x_t = sqrt(a) x0 + sqrt(1 - a) eps,

    (x0_pred - x0)^2 / (1 - a) = (out - v)^2,    v = sqrt(a) eps - sqrt(1 - a) x0.

Under a layout that cuts the joint rows (sp, cp) into parts that do not divide them, zero rows
pad the end to the next multiple: attention masks them as keys (``key_length``), the loss and the
sample drop them; every real row computes what it computes on one process.

The 1.0 I2V checkpoint's learned table ``patch_embed.pos_embedding`` is a frozen parameter here
(diffusers: a persistent buffer), used when the latents have the sample size, as diffusers does.
"""

from __future__ import annotations

from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mm_models_video.cogvideox.config import CogVideoXTransformerConfig
from mm_models_video.cogvideox.positions import joint_position_table
from mm_models_video.cogvideox.transformer import CogVideoXBlock
from mm_models_video.embeddings import TwoLayerMLP, timestep_sinusoid
from mm_models_video.wan.modeling import Transformer3DOutput
from mm_parallel import mappings
from mm_parallel.blocks import LayerNorm, Linear, PatchConv, patchify
from mm_parallel.context_parallel import gather_sequence
from mm_parallel.model_base import ParallelModel
from mm_parallel.ops.device import host_array as host
from mm_parallel.ops.device import tiled_to
from mm_parallel.topology import Topology


class CogVideoXPatchEmbed(nn.Cell):
    """Text projection and video patches, joined as [text ; video] (diffusers' CogVideoXPatchEmbed)."""

    def __init__(self, config: CogVideoXTransformerConfig):
        super().__init__()
        self.config, dim, p = config, config.inner_dim, config.patch_size
        if config.patch_size_t is None:
            self.proj = PatchConv(config.in_channels, dim, (p, p), bias=config.patch_bias)
        else:  # (diffusers gives this linear a bias whatever patch_bias says)
            self.proj = Linear(config.in_channels * config.patch_volume, dim)
        self.text_proj = Linear(config.text_embed_dim, dim)
        self.pos_embedding = None
        if config.use_learned_positional_embeddings:  # in the checkpoint, never trained
            table = joint_position_table(config, config.sample_height, config.sample_width, config.sample_frames)
            self.pos_embedding = Parameter(Tensor(table), name="pos_embedding", requires_grad=False)
        self._tables = {}

    def video_tokens(self, latents):
        """(B, F, C, H, W) -> (B, S, D)."""
        cfg, (b, f, c, h, w) = self.config, latents.shape
        p, p_t = cfg.patch_size, cfg.patch_size_t
        if p_t is None:
            tokens = self.proj(patchify(latents.reshape(b * f, c, h, w), (p, p)))
        else:  # (C, p_t, p, p) patches, in the order of diffusers' linear
            tokens = self.proj(patchify(latents.transpose(0, 2, 1, 3, 4), (p_t, p, p)))
        return tokens.reshape(b, -1, tokens.shape[-1])

    def position_table(self, frames: int, height: int, width: int):
        """The joint table for latents of this size, or None where the config adds none."""
        cfg = self.config
        if not cfg.uses_positional_table:
            return None
        pixel_frames = (frames - 1) * cfg.temporal_compression_ratio + 1
        if cfg.use_learned_positional_embeddings:
            if (height, width) != (cfg.sample_height, cfg.sample_width):
                raise ValueError(f"learned positions (the 1.0 I2V model) need latents of the sample size "
                                 f"{cfg.sample_height} x {cfg.sample_width}, got {height} x {width}")
            if pixel_frames == cfg.sample_frames:
                return self.pos_embedding
        key = (pixel_frames, height, width)
        if key not in self._tables:  # diffusers recomputes the sincos table for any other size
            self._tables[key] = Tensor(joint_position_table(cfg, height, width, pixel_frames))
        return self._tables[key]

    def construct(self, text, latents):
        joint = ops.concat([self.text_proj(text), self.video_tokens(latents)], 1)
        table = self.position_table(latents.shape[1], latents.shape[3], latents.shape[4])
        if table is None:
            return joint
        if table.shape[1] != joint.shape[1]:
            raise ValueError(f"the position table covers {table.shape[1]} tokens, the input has {joint.shape[1]}: "
                             f"with positions added the text must have max_text_seq_length="
                             f"{self.config.max_text_seq_length} tokens, got {text.shape[1]}")
        return joint + tiled_to(ops.stop_gradient(table), joint.shape)


class CogVideoXTransformer3DModel(ParallelModel):
    """CogVideoX 1.0 / 1.5 DiT; see the module docstring. Under pipeline parallelism the object
    holds one virtual stage (mm_parallel.model_base): the first holds the patch and time
    embeddings, the last the output norms and projection."""

    layer_prefix = "transformer_blocks."
    weights_name = "diffusion_pytorch_model.safetensors"
    _keep_in_fp32_modules = None  # diffusers' class lists none

    def __init__(self, config, topology: Optional[Topology] = None, chunk: int = 0, pipeline_num_layers=None):
        super().__init__()
        self.config = config = CogVideoXTransformerConfig.load(config)
        layers = self.build_stage(topology, chunk, config.num_layers, pipeline_num_layers)
        dim = config.inner_dim
        self.patch_embed = self.time_embedding = self.ofs_embedding = None
        if self.is_first:
            self.patch_embed = CogVideoXPatchEmbed(config)
            self.time_embedding = TwoLayerMLP(dim, config.time_embed_dim, "silu")
            if config.ofs_embed_dim:
                self.ofs_embedding = TwoLayerMLP(config.ofs_embed_dim, config.ofs_embed_dim, "silu")
        self.transformer_blocks = nn.CellList([CogVideoXBlock(config, self.topology) for _ in layers])
        self.norm_final = self.norm_out = self.proj_out = None
        if self.is_last:
            self.norm_final = LayerNorm(dim, config.norm_eps, config.norm_elementwise_affine)
            self.norm_out = _AdaLayerNorm(config)
            self.proj_out = Linear(dim, config.out_channels * config.patch_volume)

    # -- Hugging Face folders (mm_parallel.model_base) --------------------------------------------

    @classmethod
    def load_config(cls, config, overrides=None) -> CogVideoXTransformerConfig:
        config = CogVideoXTransformerConfig.load(config)
        return CogVideoXTransformerConfig.from_dict({**config.to_dict(), **overrides}) if overrides else config

    def write_config(self, path, dtype: str = "float32") -> None:
        self.config.save(path)

    def flops(self, batch: dict) -> float:
        """Forward FLOPs per sample of a micro-batch (mm_models_video.cogvideox.flops)."""
        from mm_models_video.cogvideox.flops import batch_flops

        return batch_flops(self.config, batch)

    # -- forward pieces ----------------------------------------------------------------------

    def check_latents(self, shape):
        cfg = self.config
        if len(shape) != 5:
            raise ValueError(f"hidden_states must be (batch, frames, channels, height, width), got {tuple(shape)}")
        if shape[2] != cfg.in_channels:
            raise ValueError(f"hidden_states has {shape[2]} channels (dim 2 of (B, F, C, H, W)), the model takes "
                             f"{cfg.in_channels}")
        if shape[3] % cfg.patch_size or shape[4] % cfg.patch_size or shape[1] % (cfg.patch_size_t or 1):
            raise ValueError(f"latents {tuple(shape)} cannot be cut into patches of {cfg.patch_size_t or 1} frames x "
                             f"{cfg.patch_size} x {cfg.patch_size} (CogVideoX 1.5's pipeline pads the frames)")

    def time_embed(self, timestep, batch: int, timestep_cond=None, ofs=None):
        cfg = self.config
        if timestep_cond is not None:
            raise ValueError("timestep_cond needs a time embedding with cond_proj, which no CogVideoX model has")
        steps = np.broadcast_to(host(timestep, np.float32).reshape(-1), (batch,))
        emb = self.time_embedding(Tensor(timestep_sinusoid(steps, cfg.inner_dim, cfg.flip_sin_to_cos, cfg.freq_shift)))
        if self.ofs_embedding is not None:
            if ofs is None:
                raise ValueError("this model (ofs_embed_dim set: CogVideoX 1.5 I2V) needs ofs "
                                 "(the pipeline passes 2.0)")
            offsets = np.broadcast_to(host(ofs, np.float32).reshape(-1), (batch,))
            sinusoid = timestep_sinusoid(offsets, cfg.ofs_embed_dim, cfg.flip_sin_to_cos, cfg.freq_shift)
            emb = emb + self.ofs_embedding(Tensor(sinusoid))
        return emb

    def joint_rotary(self, image_rotary_emb, text_rows: int, video_rows: int):
        """(cos, sin) over this rank's context-parallel part of the joint rows: identity (1, 0) on
        the text rows (None without rotary positions)."""
        cfg = self.config
        if image_rotary_emb is None:
            if cfg.use_rotary_positional_embeddings:
                raise ValueError("this model uses rotary positions: pass image_rotary_emb=(cos, sin), e.g. "
                                 "mm_models_video.cogvideox.rotary_tables(config, frames, height, width)")
            return None, None
        cos, sin = (np.asarray(host(t, np.float32)) for t in image_rotary_emb)
        if cos.shape != (video_rows, cfg.attention_head_dim) or sin.shape != cos.shape:
            raise ValueError(f"image_rotary_emb tables {cos.shape} / {sin.shape}: each must be (video tokens, "
                             f"head_dim) = ({video_rows}, {cfg.attention_head_dim})")
        width, joint = cos.shape[1], text_rows + video_rows
        padding = self.padded_length(joint) - joint
        rows = self.local_positions(joint + padding, sequence_parallel=False)
        cos = np.concatenate([np.ones((text_rows, width), np.float32), cos, np.ones((padding, width), np.float32)])
        sin = np.concatenate([np.zeros((text_rows, width), np.float32), sin, np.zeros((padding, width), np.float32)])
        return Tensor(cos[rows]), Tensor(sin[rows])

    def streams(self, text_rows: int, video_rows: int, sequence_parallel: bool = True):
        """(rows,) int32 of this rank's joint rows: 1 text, 0 video (and the padding)."""
        joint = self.padded_length(text_rows + video_rows)
        return (self.local_positions(joint, sequence_parallel) < text_rows).astype(np.int32)

    def padded_length(self, joint: int) -> int:
        """The joint length rounded up to whole parts of the layout (2 x ring x ulysses x
        sequence-parallel tp): the rows past ``joint`` are padding, masked as keys and dropped."""
        topo = self.topology
        parts = (2 * topo.cp_ring.size * topo.cp_ulysses.size if topo.cp.size > 1 else 1) * (
            topo.tp.size if topo.config.sequence_parallel else 1)
        return -(-joint // parts) * parts

    def key_length(self, text_rows: int, video_rows: int):
        """What the attention masks from: the real joint length when the layout pads it, else None."""
        joint = text_rows + video_rows
        return joint if self.padded_length(joint) > joint else None

    def embed(self, hidden_states, encoder_hidden_states, timestep, timestep_cond=None, ofs=None):
        """(this rank's joint rows (B, rows, D), temb (B, time_embed_dim))."""
        shape = tuple(hidden_states.shape)
        self.check_latents(shape)
        text = ms.Tensor(host(encoder_hidden_states, np.float32))
        temb = self.time_embed(timestep, shape[0], timestep_cond, ofs)
        x = self.patch_embed(text, ms.Tensor(host(hidden_states, np.float32)))
        padding = self.padded_length(x.shape[1]) - x.shape[1]
        if padding:  # zero rows to split evenly (module docstring)
            x = ops.concat([x, ops.zeros((x.shape[0], padding, x.shape[2]), x.dtype)], 1)
        return self.enter_sequence(x, 1), temb

    def run_blocks(self, x, temb, text_rows: int, video_rows: int, image_rotary_emb=None):
        if self.topology.config.sequence_parallel and self.topology.tp.size > 1:
            # the modulations act on a sequence shard: sum temb's gradient over tp (identity forward)
            temb = mappings.copy_to_region(temb, self.topology.tp)
        streams = Tensor(self.streams(text_rows, video_rows))
        cos, sin = self.joint_rotary(image_rotary_emb, text_rows, video_rows)
        key_length = self.key_length(text_rows, video_rows)
        for block in self.transformer_blocks:
            x = block(x, temb, streams, cos, sin, key_length)
        return x

    def head(self, x, temb):
        """Output norms and projection of this rank's context-parallel rows (text rows included,
        dropped by the loss and the sample): (B, rows, C_out * patch)."""
        if self.topology.config.sequence_parallel and self.topology.tp.size > 1:  # the head is replicated
            x = mappings.gather_from_sequence(x, self.topology.tp, 1, grad_reduce_scatter=False)
        return self.proj_out(self.norm_out(self.norm_final(x), temb))

    def target_rows(self, target, text_rows: int):
        """The target (B, F, C, H, W) as this rank's joint rows of tokens (zeros on text and padding rows)."""
        cfg = self.config
        p, p_t = cfg.patch_size, cfg.patch_size_t or 1
        b, f, c, h, w = target.shape
        tokens = target.reshape(b, f // p_t, p_t, c, h // p, p, w // p, p).transpose(0, 1, 4, 6, 3, 2, 5, 7)
        tokens = tokens.reshape(b, -1, c * p_t * p * p)
        padding = self.padded_length(text_rows + tokens.shape[1]) - text_rows - tokens.shape[1]
        tokens = np.concatenate([np.zeros((b, text_rows, tokens.shape[2]), np.float32), tokens,
                                 np.zeros((b, padding, tokens.shape[2]), np.float32)], 1)
        return tokens[:, self.local_positions(tokens.shape[1], sequence_parallel=False)]

    def loss(self, tokens, target, text_rows: int, weights=None, preference=None):
        """mean((sample - target)^2) over the video values, or with per-sample ``weights`` (B,)
        mean_b(w_b mean(...)); each cp rank adds its rows' part (reduce_loss_over_cp). With
        ``preference`` (an mm_parallel.preference.DiffusionPairs) the pairs' Diffusion-DPO loss
        on each sample's mean squared error instead."""
        target = host(target, np.float32)
        if target.shape[2] != self.config.out_channels or target.ndim != 5:
            raise ValueError(f"target {target.shape} must be (batch, frames, {self.config.out_channels}, height, "
                             "width) like the sample")
        video_rows = self.video_token_count(target.shape)
        rows = self.local_positions(self.padded_length(text_rows + video_rows), sequence_parallel=False)
        video = Tensor(((rows >= text_rows) & (rows < text_rows + video_rows)).astype(np.float32))
        diff = tokens - Tensor(self.target_rows(target, text_rows))
        squares = diff * diff * video[None, :, None]
        total = 1.0 / target.size
        if preference is not None:
            per_sample = squares.reshape(tokens.shape[0], -1).sum(1) * (total * tokens.shape[0])
            return preference.loss(self.reduce_loss_over_cp(per_sample))
        if weights is None:
            return self.reduce_loss_over_cp(squares.sum() * total)
        weights = ms.Tensor(host(weights, np.float32).reshape(-1))
        if weights.shape[0] != tokens.shape[0]:
            raise ValueError(f"loss_weights has {weights.shape[0]} entries for {tokens.shape[0]} samples")
        return self.reduce_loss_over_cp((squares.reshape(tokens.shape[0], -1).sum(1) * weights).sum() * total)

    def sample(self, tokens, shape, text_rows: int):
        """The whole (B, F, C_out, H, W) from this rank's rows of output tokens."""
        full = gather_sequence(tokens, 1, self.topology) if self.topology.cp.size > 1 else tokens
        return self.unpatchify(full[:, text_rows:text_rows + self.video_token_count(shape)], shape)

    def unpatchify(self, tokens, shape):
        """(B, S, C_out * patch) in (C, [p_t,] p, p) order -> (B, F, C_out, H, W)."""
        cfg, (b, f, _, h, w) = self.config, shape
        p, p_t = cfg.patch_size, cfg.patch_size_t or 1
        x = tokens.reshape(b, f // p_t, h // p, w // p, -1, p_t, p, p).transpose(0, 1, 5, 4, 2, 6, 3, 7)
        return x.reshape(b, f, x.shape[3], h, w)

    # -- forward -----------------------------------------------------------------------------

    def construct(self, hidden_states, encoder_hidden_states, timestep, timestep_cond=None, ofs=None,
                  image_rotary_emb=None, attention_kwargs=None, return_dict: bool = True, target=None,
                  loss_weights=None, preference=None):
        if attention_kwargs:
            raise ValueError("attention_kwargs (LoRA scale) is not supported; apply LoRA with the parallel plan")
        self.require_whole_model()
        shape, text_rows = tuple(hidden_states.shape), encoder_hidden_states.shape[1]
        x, temb = self.embed(hidden_states, encoder_hidden_states, timestep, timestep_cond, ofs)
        video_rows = self.video_token_count(shape)
        tokens = self.head(self.run_blocks(x, temb, text_rows, video_rows, image_rotary_emb), temb)
        loss = None if target is None else self.loss(tokens, target, text_rows, loss_weights, preference)
        sample = self.sample(tokens, shape, text_rows)
        out = Transformer3DOutput(sample=sample, loss=loss)
        return out if return_dict else (sample,)

    def video_token_count(self, shape) -> int:
        cfg = self.config
        return shape[1] // (cfg.patch_size_t or 1) * (shape[3] // cfg.patch_size) * (shape[4] // cfg.patch_size)

    # -- pipeline ----------------------------------------------------------------------------
    # Between stages a dict travels (mm_parallel.stage_io): the joint rows and temb, so later
    # stages send temb's gradient back to the time embedding on the first stage.

    def pipeline_stage(self, x, batch: dict):
        """This virtual stage's forward for mm_parallel.pipeline (``with_batch=True``): ``batch``
        holds the forward keywords of a micro-batch, ``x`` the previous stage's dict. Returns the
        dict for the next stage, or on the last stage the output rows."""
        shape, text_rows = tuple(batch["hidden_states"].shape), batch["encoder_hidden_states"].shape[1]
        if self.is_first:
            tokens, temb = self.embed(batch["hidden_states"], batch["encoder_hidden_states"], batch["timestep"],
                                      batch.get("timestep_cond"), batch.get("ofs"))
        else:
            tokens, temb = x["tokens"], x["temb"]
        tokens = self.run_blocks(tokens, temb, text_rows, self.video_token_count(shape),
                                 batch.get("image_rotary_emb"))
        return self.head(tokens, temb) if self.is_last else {"tokens": tokens, "temb": temb}

    def pipeline_sample(self, tokens, batch: dict):
        """The last stage's output rows as the whole (B, F, C_out, H, W) prediction (sampling under pp)."""
        return self.sample(tokens, tuple(batch["hidden_states"].shape), batch["encoder_hidden_states"].shape[1])

    def pipeline_loss(self, tokens, batch: dict):
        return self.loss(tokens, batch["target"], batch["encoder_hidden_states"].shape[1], batch.get("loss_weights"),
                         batch.get("preference"))


class _AdaLayerNorm(nn.Cell):
    """diffusers' AdaLayerNorm(chunk_dim=1) of the output: LN(x) * (1 + scale) + shift, with
    [shift, scale] = linear(silu(temb))."""

    def __init__(self, config: CogVideoXTransformerConfig):
        super().__init__()
        self.linear = Linear(config.time_embed_dim, 2 * config.inner_dim)
        self.norm = LayerNorm(config.inner_dim, config.norm_eps, config.norm_elementwise_affine)

    def construct(self, x, temb):
        shift, scale = ops.split(self.linear(ops.silu(temb))[:, None, :], x.shape[-1], 2)
        return self.norm(x) * tiled_to(scale + 1.0, x.shape) + tiled_to(shift, x.shape)
