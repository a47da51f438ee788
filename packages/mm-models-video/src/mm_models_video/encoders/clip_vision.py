"""CLIP vision encoder: the MindSpore twin of transformers' CLIPVisionModel.

Wan2.1 I2V conditions on the penultimate hidden state of open-clip ViT-H/14 (``hidden_states[-2]``,
257 tokens of width 1280) of the first frame.

    x = [class | patches(pixels) W_patch^T] + positions;  x = LN_pre(x)
    layer:  x += out_proj(attention(q, k, v of LN1(x)));  x += fc2(act(fc1(LN2(x))))
    last_hidden_state = x,  pooler_output = LN_post(x[:, 0])

Parameter names are transformers' module names (``embeddings.patch_embedding.weight``,
``encoder.layers.0.self_attn.q_proj.weight`` ...); checkpoints with the ``vision_model.`` prefix load
too. Replicated on every rank (frozen in Wan training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
from mindspore import Tensor, nn, ops

from mm_parallel import ops as kernels
from mm_parallel.blocks import LayerNorm, Linear, PatchConv, activation, patchify
from mm_parallel.hf_checkpoint import load_weights, save_module
from mm_parallel.tensor_parallel import new_parameter


@dataclass
class VisionOutput:
    last_hidden_state: Tensor
    pooler_output: Tensor
    hidden_states: Optional[Tuple[Tensor, ...]] = None


class _Embeddings(nn.Cell):
    def __init__(self, config):
        super().__init__()
        dim, self.patch, self.image_size = config.hidden_size, config.patch_size, config.image_size
        self.class_embedding = new_parameter((dim,), "class_embedding", 1.0, None)
        self.patch_embedding = PatchConv(config.num_channels, dim, (self.patch, self.patch), bias=False)
        self.num_positions = (config.image_size // config.patch_size) ** 2 + 1
        self.position_embedding = nn.Cell()
        self.position_embedding.weight = new_parameter((self.num_positions, dim), "weight", None, None)

    def construct(self, pixels):
        b, _, h, w = pixels.shape
        if h != self.image_size or w != self.image_size:
            size = self.image_size
            raise ValueError(f"input image size ({h}*{w}) doesn't match the model ({size}*{size}); "
                             "resize the images (position interpolation is not supported)")
        dim = self.class_embedding.shape[0]
        patches = self.patch_embedding(patchify(pixels, (self.patch, self.patch))).reshape(b, -1, dim)
        cls = ops.tile(self.class_embedding.reshape(1, 1, -1), (b, 1, 1))
        x = ops.concat([cls, patches], 1)
        return x + ops.tile(self.position_embedding.weight[None], (b, 1, 1))


class _Attention(nn.Cell):
    def __init__(self, config):
        super().__init__()
        self.heads = config.num_attention_heads
        dim = config.hidden_size
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (Linear(dim, dim) for _ in range(4))

    def construct(self, x):
        b, s = x.shape[0], x.shape[1]
        q, k, v = (p(x).reshape(b, s, self.heads, -1) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(kernels.attention(q, k, v).reshape(b, s, -1))


class _MLP(nn.Cell):
    def __init__(self, config):
        super().__init__()
        self.fc1 = Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def construct(self, x):
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Cell):
    def __init__(self, config):
        super().__init__()
        self.self_attn = _Attention(config)
        self.layer_norm1 = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.mlp = _MLP(config)
        self.layer_norm2 = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def construct(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Cell):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.CellList([CLIPEncoderLayer(config) for _ in range(config.num_hidden_layers)])


class CLIPVisionModel(nn.Cell):
    """See the module docstring. ``from_pretrained(path)`` reads a transformers folder."""

    def __init__(self, config):
        super().__init__()
        from transformers import CLIPVisionConfig

        self.config = config = config if isinstance(config, CLIPVisionConfig) else CLIPVisionConfig(**config)
        self.embeddings = _Embeddings(config)
        self.pre_layrnorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.encoder = _Encoder(config)
        self.post_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    @classmethod
    def from_pretrained(cls, path, topology=None):
        from transformers import CLIPVisionConfig

        model = cls(CLIPVisionConfig.from_pretrained(str(path)))
        load_weights(model, str(path), lambda name: (name, "vision_model." + name))
        return model

    def save_pretrained(self, path) -> None:
        """Write the transformers folder (config.json, model.safetensors under vision_model.*)
        that transformers' CLIPVisionModel loads (tested); one process writes."""
        save_module(self, path, {**self.config.to_dict(), "architectures": ["CLIPVisionModel"]},
                    lambda name: "vision_model." + name)

    def construct(self, pixel_values, output_hidden_states: bool = False) -> VisionOutput:
        pixels = pixel_values if isinstance(pixel_values, Tensor) else Tensor(np.asarray(pixel_values, np.float32))
        x = self.pre_layrnorm(self.embeddings(pixels))
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        return VisionOutput(last_hidden_state=x, pooler_output=self.post_layernorm(x[:, 0]),
                            hidden_states=tuple(states) if output_hidden_states else None)
