"""WanTransformer3DModel: the MindSpore twin of diffusers' class of the same name.

Same config (config.json of a diffusers folder), same parameter names, same forward keywords
(``hidden_states`` (B, C, F, H, W), ``timestep`` (B,) or, Wan2.2 TI2V, one per token (B, S),
``encoder_hidden_states`` (B, T, text_dim),
``encoder_hidden_states_image`` (B, I, image_dim) for I2V) and output (``sample``). One keyword
more: ``target`` (B, C_out, F, H, W), the flow-matching velocity; with it the output holds
``loss`` = mean((sample - target)^2) (per-sample ``loss_weights`` optional, see
mm_models_video.flow_matching), computed token by token so that it stays exact when the tokens
are split over context-parallel ranks.

Layout of the tokens on a rank: context parallelism cuts the video tokens as
`mm_parallel.split_sequence` does (RoPE tables cut the same way); sequence parallelism then cuts
each rank's tokens over tp between the blocks and gathers them before the output norm.

Per-token timesteps (diffusers' expand_timesteps) take a few distinct values (the first frame's
0 and the step's t), so each distinct value is embedded once, (N, 6, D), and every token holds an
index into them, cut with the tokens: diffusers' (B, S, 6, D) modulation is 1.9 GiB per TI2V-5B
sample (121 frames of 704 x 1280: 27,280 tokens at width 3072) in float32; the indices are 0.1 MiB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mm_models_video.wan.config import WanTransformerConfig
from mm_models_video.wan.transformer import (
    WanTimeTextImageEmbedding,
    WanTransformerBlock,
    _modulate,
    _sequence_parallel,
    per_token,
)
from mm_parallel import mappings
from mm_parallel.blocks import LayerNorm, Linear, PatchConv, patchify
from mm_parallel.context_parallel import gather_sequence, split_sequence
from mm_parallel.model_base import ParallelModel
from mm_parallel.ops.device import host_array as host
from mm_parallel.ops.low_precision import compute_weight
from mm_parallel.tensor_parallel import new_parameter
from mm_parallel.topology import Topology


@dataclass
class Transformer3DOutput:
    sample: Optional[Tensor] = None
    loss: Optional[Tensor] = None


def rope_tables(grid, head_dim: int, max_seq_len: int = 1024, theta: float = 10000.0):
    """(cos, sin), each (F*H*W, head_dim) float32, of diffusers' WanRotaryPosEmbed for a token grid
    (F, H, W): the head's dims split into time / height / width parts (t = d - 2 * 2(d // 6)),
    each rotated by its axis position with interleaved pairs, frequencies in float64."""
    f, h, w = grid
    if max(grid) > max_seq_len:
        raise ValueError(f"token grid {tuple(grid)} exceeds rope_max_seq_len={max_seq_len}")
    hw_dim = 2 * (head_dim // 6)
    cos, sin = [], []
    for dim, length, shape in ((head_dim - 2 * hw_dim, f, (f, 1, 1)), (hw_dim, h, (1, h, 1)), (hw_dim, w, (1, 1, w))):
        freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64)[: dim // 2] / dim)
        angles = np.outer(np.arange(length, dtype=np.float64), freqs)
        for out, fn in ((cos, np.cos), (sin, np.sin)):
            table = np.repeat(fn(angles), 2, axis=1).astype(np.float32)  # each frequency twice, interleaved
            out.append(np.broadcast_to(table.reshape(shape + (dim,)), (f, h, w, dim)))
    return (np.concatenate(cos, -1).reshape(f * h * w, head_dim),
            np.concatenate(sin, -1).reshape(f * h * w, head_dim))


def video_tokens(x, patch):
    """(B, C, F, H, W) -> (B, S, pt*ph*pw*C) in the order proj_out writes (pt, ph, pw, C)."""
    b, c, f, h, w = x.shape
    pt, ph, pw = patch
    x = x.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw).transpose(0, 2, 4, 6, 3, 5, 7, 1)
    return x.reshape(b, (f // pt) * (h // ph) * (w // pw), -1)


def unpatchify(tokens, grid, patch):
    """Inverse of `video_tokens`: (B, S, pt*ph*pw*C) -> (B, C, F, H, W)."""
    (f, h, w), (pt, ph, pw) = grid, patch
    b = tokens.shape[0]
    x = tokens.reshape(b, f, h, w, pt, ph, pw, -1).transpose(0, 7, 1, 4, 2, 5, 3, 6)
    return x.reshape(b, x.shape[1], f * pt, h * ph, w * pw)


class WanTransformer3DModel(ParallelModel):
    """Wan2.1 / Wan2.2 DiT; see the module docstring. Under pipeline parallelism the object holds one
    virtual stage (mm_parallel.model_base): the first holds the patch and condition embeddings,
    the last the output norm and projection."""

    layer_prefix = "blocks."
    weights_name = "diffusion_pytorch_model.safetensors"
    # diffusers' list: these stay fp32 in a bf16 / fp16 run (mm_parallel.precision)
    _keep_in_fp32_modules = ["rope", "time_embedder", "scale_shift_table", "norm1", "norm2", "norm3"]

    def __init__(self, config, topology: Optional[Topology] = None, chunk: int = 0, pipeline_num_layers=None):
        super().__init__()
        self.config = config = WanTransformerConfig.load(config)
        layers = self.build_stage(topology, chunk, config.num_layers, pipeline_num_layers)
        dim = config.inner_dim
        self.patch_embedding = self.condition_embedder = None
        if self.is_first:
            self.patch_embedding = PatchConv(config.in_channels, dim, config.patch_size)
            self.condition_embedder = WanTimeTextImageEmbedding(config)
        self.blocks = nn.CellList([WanTransformerBlock(config, self.topology) for _ in layers])
        self.norm_out = self.proj_out = self.scale_shift_table = None
        if self.is_last:
            self.norm_out = LayerNorm(dim, config.eps, elementwise_affine=False)
            self.proj_out = Linear(dim, config.out_channels * int(np.prod(config.patch_size)))
            self.scale_shift_table = new_parameter((1, 2, dim), "scale_shift_table", dim ** -0.5, None)

    # -- Hugging Face folders (mm_parallel.model_base): config.json + diffusion_pytorch_model[.index].safetensors

    @classmethod
    def load_config(cls, config, overrides=None) -> WanTransformerConfig:
        config = WanTransformerConfig.load(config)
        return WanTransformerConfig.from_dict({**config.to_dict(), **overrides}) if overrides else config

    def write_config(self, path, dtype: str = "float32") -> None:
        self.config.save(path)  # diffusers records no dtype: the weights carry it

    def flops(self, batch: dict) -> float:
        """Forward FLOPs per sample of a micro-batch (mm_models_video.wan.flops)."""
        from mm_models_video.wan.flops import batch_flops

        return batch_flops(self.config, batch)

    # -- host side ---------------------------------------------------------------------------

    def grid(self, shape):
        """Token grid (F/pt, H/ph, W/pw) of latents of ``shape`` (B, C, F, H, W)."""
        if len(shape) != 5:
            raise ValueError(f"hidden_states must be (batch, channels, frames, height, width), got {tuple(shape)}")
        if any(n % p for n, p in zip(shape[2:], self.config.patch_size)):
            raise ValueError(f"latents {tuple(shape)} cannot be cut into patches {self.config.patch_size}")
        return tuple(n // p for n, p in zip(shape[2:], self.config.patch_size))

    def rotary(self, grid):
        """This rank's RoPE tables (its context-parallel part of the tokens)."""
        cos, sin = rope_tables(grid, self.config.attention_head_dim, self.config.rope_max_seq_len)
        cos, sin = Tensor(cos), Tensor(sin)
        if self.topology.cp.size > 1:
            cos, sin = split_sequence(cos, 0, self.topology), split_sequence(sin, 0, self.topology)
        return cos, sin

    # -- forward pieces ----------------------------------------------------------------------

    def token_steps(self, timestep, grid, batch: int):
        """(the distinct timesteps to embed, and each token's index into them for the blocks (this
        rank's tokens) and for the head (its context-parallel part)), or (the per-sample
        timesteps, None, None)."""
        steps = host(timestep, np.float32)
        if steps.ndim < 2:
            return np.broadcast_to(steps.reshape(-1), (batch,)), None, None
        tokens = int(np.prod(grid))
        if steps.shape != (batch, tokens):
            raise ValueError(f"per-token timestep must be (batch, tokens) = {(batch, tokens)}, got {steps.shape}")
        values, index = np.unique(steps, return_inverse=True)
        index = index.reshape(batch, tokens).astype(np.int32)
        return (values, Tensor(index[:, self.local_positions(tokens)]),
                Tensor(index[:, self.local_positions(tokens, sequence_parallel=False)]))

    def embed(self, hidden_states, steps, encoder_hidden_states, encoder_hidden_states_image=None):
        """(tokens of this rank, text, image tokens or None, timestep_proj, temb); ``steps``: the
        timesteps `token_steps` says to embed."""
        cfg = self.config
        latents = ms.Tensor(host(hidden_states, np.float32))
        if latents.shape[1] != cfg.in_channels:
            raise ValueError(f"hidden_states has {latents.shape[1]} channels, the model takes {cfg.in_channels}")
        if (encoder_hidden_states_image is None) != (cfg.image_dim is None):
            raise ValueError("an I2V model (image_dim set) needs encoder_hidden_states_image, a T2V model takes none")
        tokens = self.patch_embedding(patchify(latents, cfg.patch_size))
        tokens = tokens.reshape(tokens.shape[0], -1, tokens.shape[-1])
        temb, timestep_proj, text, image = self.condition_embedder(
            steps, ms.Tensor(host(encoder_hidden_states, np.float32)),
            None if encoder_hidden_states_image is None else ms.Tensor(host(encoder_hidden_states_image, np.float32)))
        return self.enter_sequence(tokens, 1), text, image, timestep_proj, temb

    def run_blocks(self, x, text, image, timestep_proj, cos, sin, token_steps=None):
        if _sequence_parallel(self.topology):
            # modulation acts on a sequence shard: sum its gradient over tp (identity forward)
            timestep_proj = mappings.copy_to_region(timestep_proj, self.topology.tp)
        for block in self.blocks:
            x = block(x, text, image, timestep_proj, cos, sin, token_steps)
        return x

    def head(self, x, temb, token_steps=None):
        """Output norm, modulation and projection: (B, S_local, pt*ph*pw*C_out) tokens."""
        if _sequence_parallel(self.topology):  # the head is replicated over tp: its gradient stays whole
            x = mappings.gather_from_sequence(x, self.topology.tp, 1, grad_reduce_scatter=False)
        table = tiled_to_batch(compute_weight(self.scale_shift_table), temb.shape[0])
        shift, scale = (per_token(v, token_steps) for v in ops.split(table + temb[:, None, :], 1, 1))
        return self.proj_out(_modulate(self.norm_out(x), scale, shift))

    def loss(self, tokens, target_tokens, total: int, weights=None, preference=None):
        """mean((pred - target)^2) over all ``total`` elements, or with per-sample ``weights`` (B,)
        mean_b(w_b mean((pred_b - target_b)^2)) (all samples have one size). Under cp each rank adds
        its part (ParallelModel.reduce_loss_over_cp). With ``preference`` (an
        mm_parallel.preference.DiffusionPairs) the pairs' Diffusion-DPO loss on each sample's
        mean squared error instead."""
        diff = tokens - target_tokens
        squares = diff * diff
        if preference is not None:
            per_sample = squares.reshape(tokens.shape[0], -1).sum(1) * (tokens.shape[0] / total)
            return preference.loss(self.reduce_loss_over_cp(per_sample))
        if weights is None:
            loss = squares.sum() * (1.0 / total)
        else:
            weights = ms.Tensor(host(weights, np.float32).reshape(-1))
            if weights.shape[0] != tokens.shape[0]:
                raise ValueError(f"loss_weights has {weights.shape[0]} entries for {tokens.shape[0]} samples")
            loss = (squares.reshape(tokens.shape[0], -1).sum(1) * weights).sum() * (1.0 / total)
        return self.reduce_loss_over_cp(loss)

    def target_tokens(self, target, grid):
        tokens = video_tokens(ms.Tensor(host(target, np.float32)), self.config.patch_size)
        if tuple(tokens.shape[1:2]) != (int(np.prod(grid)),):
            raise ValueError(f"target {tuple(target.shape)} does not match the latents' token grid {grid}")
        return split_sequence(tokens, 1, self.topology) if self.topology.cp.size > 1 else tokens

    def whole_sample(self, tokens, grid):
        """The whole (B, C_out, F, H, W) prediction from this rank's output tokens (gathered over cp)."""
        full = gather_sequence(tokens, 1, self.topology) if self.topology.cp.size > 1 else tokens
        return unpatchify(full, grid, self.config.patch_size)

    # -- forward -----------------------------------------------------------------------------

    def construct(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None,
                  target=None, loss_weights=None, return_dict: bool = True, attention_kwargs=None, preference=None):
        if attention_kwargs:
            raise ValueError("attention_kwargs (LoRA scale) is not supported; apply LoRA with the parallel plan")
        self.require_whole_model()
        grid = self.grid(tuple(hidden_states.shape))
        cos, sin = self.rotary(grid)
        steps, block_steps, head_steps = self.token_steps(timestep, grid, hidden_states.shape[0])
        x, text, image, timestep_proj, temb = self.embed(hidden_states, steps, encoder_hidden_states,
                                                         encoder_hidden_states_image)
        tokens = self.head(self.run_blocks(x, text, image, timestep_proj, cos, sin, block_steps), temb, head_steps)
        loss = None
        if target is not None:
            loss = self.loss(tokens, self.target_tokens(target, grid), int(np.prod(target.shape)), loss_weights,
                             preference)
        sample = self.whole_sample(tokens, grid)
        out = Transformer3DOutput(sample=sample, loss=loss)
        return out if return_dict else (sample,)

    # -- pipeline ----------------------------------------------------------------------------
    # Between stages a dict travels (mm_parallel.stage_io): the video tokens and the conditions
    # (text, image tokens, timestep_proj, temb), so the later stages get the conditions and send
    # their gradients back to the embeddings on the first stage.

    def pipeline_stage(self, x, batch: dict):
        """This virtual stage's forward for mm_parallel.pipeline (``with_batch=True``): ``batch``
        holds the forward keywords of a micro-batch, ``x`` the previous stage's dict. Returns the
        dict for the next stage, or on the last stage the output tokens."""
        shape = tuple(batch["hidden_states"].shape)
        grid = self.grid(shape)
        steps, block_steps, head_steps = self.token_steps(batch["timestep"], grid, shape[0])
        if self.is_first:
            tokens, text, image, timestep_proj, temb = self.embed(
                batch["hidden_states"], steps, batch["encoder_hidden_states"], batch.get("encoder_hidden_states_image"))
        else:
            tokens, text, image, timestep_proj, temb = (x["tokens"], x["text"], x.get("image"), x["timestep_proj"],
                                                        x["temb"])
        cos, sin = self.rotary(grid)
        tokens = self.run_blocks(tokens, text, image, timestep_proj, cos, sin, block_steps)
        if self.is_last:
            return self.head(tokens, temb, head_steps)
        out = {"tokens": tokens, "text": text, "timestep_proj": timestep_proj, "temb": temb}
        return out if image is None else {**out, "image": image}

    def pipeline_sample(self, tokens, batch: dict):
        """The last stage's output tokens as the whole prediction (sampling under pp)."""
        return self.whole_sample(tokens, self.grid(tuple(batch["hidden_states"].shape)))

    def pipeline_loss(self, tokens, batch: dict):
        target = batch["target"]
        return self.loss(tokens, self.target_tokens(target, self.grid(tuple(batch["hidden_states"].shape))),
                         int(np.prod(target.shape)), batch.get("loss_weights"), batch.get("preference"))


def tiled_to_batch(table, batch: int):
    """(1, n, D) -> (batch, n, D)."""
    return ops.tile(table, (batch, 1, 1))
