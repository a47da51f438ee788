"""The Wan VAEs' encoder and decoder: Wan2.1's plain stacks of residual blocks and resamplers, or
Wan2.2's (``is_residual``) blocks whose downsampling / upsampling has a parameter-free shortcut
(AvgDown3D / DupUp3D) around it. Every layer takes the frame stream of mm_models_video.wan.vae_layers."""

from __future__ import annotations

from typing import Optional

from mindspore import nn, ops

from mm_models_video.wan.vae_layers import (
    AttentionBlock,
    AvgDown3D,
    CausalConv3d,
    DupUp3D,
    MidBlock,
    Resample,
    ResidualBlock,
    RMSNormChannels,
)


class ResidualDownBlock(nn.Cell):
    """Wan2.2: residual blocks, then the downsampler, plus AvgDown3D of the block's input."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, temporal: bool, down: bool):
        super().__init__()
        self.avg_shortcut = AvgDown3D(in_dim, out_dim, 2 if temporal else 1, 2 if down else 1)
        self.resnets = nn.CellList([ResidualBlock(in_dim if i == 0 else out_dim, out_dim)
                                    for i in range(num_res_blocks)])
        self.downsampler = Resample(out_dim, "downsample3d" if temporal else "downsample2d") if down else None

    def construct(self, x, stream):
        shortcut = self.avg_shortcut(x)
        for resnet in self.resnets:
            x = resnet(x, stream)
        if self.downsampler is not None:
            x = self.downsampler(x, stream)
        return x + shortcut


class Encoder3d(nn.Cell):
    def __init__(self, in_channels, dim, z_dim, dim_mult, num_res_blocks, attn_scales, temperal_downsample,
                 is_residual: bool = False):
        super().__init__()
        dims = [dim * u for u in [1] + list(dim_mult)]
        self.conv_in = CausalConv3d(in_channels, dims[0], 3, padding=1)
        blocks, scale, last = [], 1.0, len(dim_mult) - 1
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            if is_residual:
                blocks.append(ResidualDownBlock(in_dim, out_dim, num_res_blocks,
                                                temporal=bool(temperal_downsample[i]) if i != last else False,
                                                down=i != last))
                continue
            for _ in range(num_res_blocks):
                blocks.append(ResidualBlock(in_dim, out_dim))
                if scale in attn_scales:
                    blocks.append(AttentionBlock(out_dim))
                in_dim = out_dim
            if i != last:
                blocks.append(Resample(out_dim, "downsample3d" if temperal_downsample[i] else "downsample2d"))
                scale /= 2.0
        self.down_blocks = nn.CellList(blocks)
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNormChannels(dims[-1], images=False)
        self.conv_out = CausalConv3d(dims[-1], z_dim, 3, padding=1)

    def construct(self, x, stream):
        x = self.conv_in(x, stream)
        for block in self.down_blocks:
            x = block(x, stream)
        x = self.mid_block(x, stream)
        return self.conv_out(ops.silu(self.norm_out(x)), stream)


class UpBlock(nn.Cell):
    """Wan2.1: residual blocks, then the upsampler (which halves the channels)."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, upsample_mode: Optional[str]):
        super().__init__()
        self.resnets = nn.CellList([ResidualBlock(in_dim if i == 0 else out_dim, out_dim)
                                    for i in range(num_res_blocks + 1)])
        self.upsamplers = None if upsample_mode is None else nn.CellList([Resample(out_dim, upsample_mode)])

    def construct(self, x, stream):
        for resnet in self.resnets:
            x = resnet(x, stream)
        return x if self.upsamplers is None else self.upsamplers[0](x, stream)


class ResidualUpBlock(nn.Cell):
    """Wan2.2: residual blocks, then the upsampler (channels kept), plus DupUp3D of the block's input."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, temporal: bool, up: bool):
        super().__init__()
        self.avg_shortcut = DupUp3D(in_dim, out_dim, 2 if temporal else 1, 2) if up else None
        self.resnets = nn.CellList([ResidualBlock(in_dim if i == 0 else out_dim, out_dim)
                                    for i in range(num_res_blocks + 1)])
        self.upsampler = None
        if up:
            self.upsampler = Resample(out_dim, "upsample3d" if temporal else "upsample2d", out_dim=out_dim)

    def construct(self, x, stream):
        shortcut = None if self.avg_shortcut is None else self.avg_shortcut(x, stream.first)
        for resnet in self.resnets:
            x = resnet(x, stream)
        if self.upsampler is not None:
            x = self.upsampler(x, stream)
        return x if shortcut is None else x + shortcut


class Decoder3d(nn.Cell):
    def __init__(self, dim, z_dim, dim_mult, num_res_blocks, temperal_upsample, out_channels,
                 is_residual: bool = False):
        super().__init__()
        dims = [dim * u for u in [dim_mult[-1]] + list(dim_mult)[::-1]]
        self.conv_in = CausalConv3d(z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        blocks, last = [], len(dim_mult) - 1
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            up = i != last
            if is_residual:
                blocks.append(ResidualUpBlock(in_dim, out_dim, num_res_blocks,
                                              temporal=bool(temperal_upsample[i]) if up else False, up=up))
                continue
            in_dim = in_dim // 2 if i > 0 else in_dim  # the previous upsampler halved the channels
            mode = ("upsample3d" if temperal_upsample[i] else "upsample2d") if up else None
            blocks.append(UpBlock(in_dim, out_dim, num_res_blocks, mode))
        self.up_blocks = nn.CellList(blocks)
        self.norm_out = RMSNormChannels(dims[-1], images=False)
        self.conv_out = CausalConv3d(dims[-1], out_channels, 3, padding=1)

    def construct(self, x, stream):
        x = self.mid_block(self.conv_in(x, stream), stream)
        for block in self.up_blocks:
            x = block(x, stream)
        return self.conv_out(ops.silu(self.norm_out(x)), stream)
