"""Peak activation memory of one CogVideoX VAE encode and decode per rank: the whole clip on one
process against its frames split over 2 and 4 ranks (mm_models_video.cogvideox.vae_context_parallel),
side by side, with diffusers' default frame batches on one process beside them.

    python benchmarks/vae_memory.py [--frames 65] [--size 64] [--channels 32]

A CogVideoX-shaped VAE (4 blocks: 8 x spatial, 4 x temporal; block widths c, 2c, 2c, 4c, 3
resnets per block, random weights) encodes one clip of ``frames`` frames of size x size and
decodes its latents. In a fresh launch per case (MindSpore's CPU pool keeps what was freed), each
rank's peak RSS during the call (VmHWM, reset just before it) above the RSS before it is its
activation memory; the worst rank is printed, and its ratio to the one process on the whole clip
(the goal: 1 / n).
"""

from __future__ import annotations

import argparse


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(frames: int, size: int, channels: int, whole: bool = True) -> dict:
    """Runs on every rank: {"encode_bytes", "decode_bytes"} of this rank's share of the clip."""
    import numpy as np

    import mm_parallel
    from mm_models_video.cogvideox import vae_context_parallel as cp
    from mm_models_video.cogvideox.vae import AutoencoderKLCogVideoX

    topo = mm_parallel.initialize(mm_parallel.ParallelConfig())
    group, n = topo.world, topo.world_size
    c = channels
    vae = AutoencoderKLCogVideoX(block_out_channels=[c, 2 * c, 2 * c, 4 * c], norm_num_groups=8)
    if whole:
        vae.num_sample_frames_batch_size = vae.num_latent_frames_batch_size = 10 ** 6
    video = np.random.default_rng(0).uniform(-1, 1, (1, 3, frames, size, size)).astype(np.float32)
    start, end = cp.encode_shards(frames, n)[group.rank] if n > 1 else (0, frames)
    part = video[:, :, start:end]
    latent_frames = (frames - 1) // 4 + 1
    latents = np.random.default_rng(1).standard_normal((1, 16, latent_frames, size // 8, size // 8))
    first, last = cp.decode_shards(latent_frames, n)[group.rank] if n > 1 else (0, latent_frames)
    latents = latents[:, :, first:last].astype(np.float32)
    out = {}
    for name, run in (("encode", lambda: (cp.encode(vae, part, group) if n > 1 else vae.encode(part)).mean),
                      ("decode", lambda: cp.decode(vae, latents, group) if n > 1 else vae.decode(latents))):
        _reset_peak_rss()
        before = _status_kib("VmRSS")
        run().asnumpy()
        out[f"{name}_bytes"] = (_status_kib("VmHWM") - before) * 1024
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=65)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    from mm_parallel.launch import run_distributed

    shape = dict(frames=args.frames, size=args.size, channels=args.channels)
    print(f"one clip of {args.frames} frames of {args.size} x {args.size}, VAE widths {args.channels} .. "
          f"{4 * args.channels}; peak MiB above the start, worst rank")
    chunked = run_distributed(measure, nproc=1, timeout=1800, whole=False, **shape)[0]
    print(f"{'layout':<34} {'encode MiB':>10} {'ratio':>6} {'decode MiB':>10} {'ratio':>6}")
    base = None
    for n in args.ranks:
        results = run_distributed(measure, nproc=n, timeout=1800, **shape)
        worst = {k: max(r[k] for r in results) for k in ("encode_bytes", "decode_bytes")}
        base = base or worst
        label = "one process, the clip whole" if n == 1 else f"{n} ranks, frames split (goal 1/{n})"
        print(f"{label:<34} {worst['encode_bytes'] / 2 ** 20:>10.1f} "
              f"{worst['encode_bytes'] / base['encode_bytes']:>6.2f} {worst['decode_bytes'] / 2 ** 20:>10.1f} "
              f"{worst['decode_bytes'] / base['decode_bytes']:>6.2f}")
    print(f"{'one process, diffusers batches':<34} {chunked['encode_bytes'] / 2 ** 20:>10.1f} "
          f"{chunked['encode_bytes'] / base['encode_bytes']:>6.2f} {chunked['decode_bytes'] / 2 ** 20:>10.1f} "
          f"{chunked['decode_bytes'] / base['decode_bytes']:>6.2f}  (8 / 2 frames a batch: another function)")


if __name__ == "__main__":
    main()
