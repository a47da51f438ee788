"""Real media files for mm-data's tests: videos written with PyAV, images with PIL, a BPE tokenizer."""

from __future__ import annotations

import json
import os
from fractions import Fraction

import numpy as np


def frame_pattern(index: int, height: int, width: int) -> np.ndarray:
    """A frame whose content identifies its index (a moving bar and a per-frame colour)."""
    image = np.zeros((height, width, 3), np.uint8)
    image[..., 0] = (index * 37) % 256
    image[..., 2] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
    bar = (index * 3) % max(height - 4, 1)
    image[bar:bar + 4, :, 1] = 255
    return image


def write_video(path: str, frames: int = 30, height: int = 48, width: int = 64, fps=24, codec: str = "libx264",
                gop: int = 10, options=None, stamps=None, format=None) -> str:
    """``stamps``: each frame's pts in frames (default 0, 1, 2, ...); ``options``: the encoder's."""
    import av

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    container = av.open(path, "w", format=format)
    rate = Fraction(fps).limit_denominator(100000)
    stream = container.add_stream(codec, rate=rate, options=options or {})
    stream.width, stream.height, stream.pix_fmt, stream.gop_size = width, height, "yuv420p", gop
    if stamps is not None:
        stream.codec_context.time_base = 1 / rate
    for i in range(frames):
        frame = av.VideoFrame.from_ndarray(frame_pattern(i, height, width), format="rgb24")
        if stamps is not None:
            frame.pts, frame.time_base = int(stamps[i]), 1 / rate
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    container.close()
    return path


def decode_all(path: str, size=None) -> np.ndarray:
    """Every frame, decoded one by one (the slow reference that clip reading must equal); like
    ``ffmpeg -i``, packets that fail before the first picture are passed over."""
    import av

    kwargs = {"format": "rgb24"} if size is None else {"format": "rgb24", "height": size[0], "width": size[1],
                                                        "interpolation": "BICUBIC"}
    pictures = []
    with av.open(path) as container:
        for packet in container.demux(video=0):
            try:
                pictures += [frame.to_ndarray(**kwargs) for frame in packet.decode()]
            except av.error.InvalidDataError:
                assert not pictures, f"{path}: a packet after the first picture failed to decode"
    return np.stack(pictures)


def cut_before_keyframe(path: str, out: str, drop: int = 3, format=None) -> str:
    """A stream copy of ``path`` without its first ``drop`` packets: the copy starts on packets
    that cannot be decoded, so its first picture comes after the stream's start_time."""
    import av

    with av.open(path) as source, av.open(out, "w", format=format) as copy:
        stream = copy.add_stream_from_template(source.streams.video[0])
        for n, packet in enumerate(source.demux(video=0)):
            if packet.dts is not None and n >= drop:
                packet.stream = stream
                copy.mux(packet)
    return out


def write_awkward_videos(root) -> dict:
    """Files every player plays whose first frame is not at the stream's start, whose timestamps
    are frame counters, reordered or missing: {name: path}."""
    root = str(root)
    no_b = {"bf": "0"}
    paths = {
        "avi_h264_pts1": write_video(f"{root}/pts1.avi", 40, 48, 64, 12, options=no_b),   # first pts 1, start 0
        "avi_h264_bframes": write_video(f"{root}/packed.avi", 40, 48, 64, 12, options={"bf": "2"}),
        "avi_mpeg4": write_video(f"{root}/counter.avi", 33, 48, 64, 25, codec="mpeg4", gop=8),
        "mkv_offset": write_video(f"{root}/offset.mkv", 30, 48, 64, 12, stamps=range(5, 35)),
        "h264_raw": write_video(f"{root}/raw.h264", 25, 48, 64, 24, format="h264", options=no_b),
    }
    for ext, codec in (("mkv", "libx264"), ("mov", "libx264"), ("webm", "libvpx-vp9")):
        source = write_video(f"{root}/whole.{ext}", 40, 48, 64, 24, codec=codec, gop=10)
        paths[f"{ext}_cut"] = cut_before_keyframe(source, f"{root}/cut.{ext}")
    return paths


def truncate(path: str, out: str, fraction: float = 0.5) -> str:
    with open(path, "rb") as f:
        data = f.read()
    with open(out, "wb") as f:
        f.write(data[: int(len(data) * fraction)])
    return out


def bpe_tokenizer(folder: str, texts, vocab_size: int = 200):
    """A tiny BPE tokenizer trained with `tokenizers`, loaded as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(list(texts) * 4, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    return PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"), pad_token="<pad>",
                                   eos_token="</s>", unk_token="<unk>")


QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                "<|video_pad|>"]


OMNI_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>",
                "<|VIDEO|>", "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"]


def qwen_tokenizer(folder: str, texts, vocab_size: int = 300, special=QWEN_SPECIAL):
    """A tiny byte-level BPE tokenizer with Qwen2-VL's (or ``special``) special tokens (pad = <|endoftext|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(list(texts) * 4, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    return PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"), pad_token="<|endoftext|>",
                                   eos_token="<|im_end|>")


def write_image(path: str, height: int, width: int, seed: int = 0, mode: str = "RGB") -> str:
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode).save(path)
    return path


def write_picture(path, size=32):
    """A first frame: a yellow square on teal, as a PNG."""
    from PIL import Image

    pixels = np.zeros((size, size, 3), np.uint8)
    pixels[:] = (0, 128, 128)
    pixels[size // 4:size // 2, size // 4:size // 2] = (255, 220, 0)
    Image.fromarray(pixels).save(path)
    return path


def write_user_clips(root):
    """Six clips of other sizes and rates than the tiny set's, and a broken one, in a JSONL file;
    returns the `--set`s that train on them."""
    lines = []
    for i, (frames, height, width, fps) in enumerate([(20, 40, 56, 12), (18, 36, 36, 10), (25, 48, 40, 15)] * 2):
        write_video(str(root / "videos" / f"v{i}.mp4"), frames, height, width, fps, "libx264")
        lines.append(json.dumps({"file": f"videos/v{i}.mp4", "captions": [f"clip number {i}"]}))
    (root / "videos" / "broken.mp4").write_bytes(b"\x00" * 1000)
    lines.append(json.dumps({"file": "videos/broken.mp4", "captions": ["broken"]}))
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    return ["--set", "data.kind=video", "--set", "data.num_frames=9", "--set", "data.fps=8", "--set",
            "data.max_area=1024", "--set", "data.text_max_length=8", "--set", "data.max_bad_fraction=0.2", "--set",
            "data.caption_dropout=0", "--set", "train.steps=2", "--set", "train.global_batch_size=2", "--set",
            "train.micro_batch_size=1"]


def tone(seconds: float, rate: int, freq: float = 440.0, amplitude: float = 0.5) -> np.ndarray:
    """A sine of ``freq`` Hz, float32."""
    t = np.arange(int(round(rate * seconds))) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


_SAMPLE_SCALES = {"s16": (np.int16, 32767), "s16p": (np.int16, 32767), "s32p": (np.int32, 2 ** 31 - 1),
                  "fltp": (np.float32, 1), "flt": (np.float32, 1)}


def write_audio(path: str, wave: np.ndarray, rate: int, codec: str = "pcm_s16le", channels: int = 2,
                container_format: str = None, video_frames: int = 0) -> str:
    """``wave`` (mono, float in [-1, 1]) written with PyAV as ``codec`` in ``channels`` equal
    channels; with ``video_frames`` the file also holds a small MPEG-4 video track first."""
    import av

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with av.open(path, "w", format=container_format) as container:
        video = None
        if video_frames:
            video = container.add_stream("mpeg4", rate=10)
            video.width, video.height, video.pix_fmt = 32, 32, "yuv420p"
        stream = container.add_stream(codec, rate=rate)
        stream.layout = "stereo" if channels == 2 else "mono"
        sample_format = stream.codec_context.format.name
        dtype, scale = _SAMPLE_SCALES[sample_format]
        size, data = stream.codec_context.frame_size or 1024, np.stack([wave] * channels)
        for start in range(0, data.shape[1], size):
            chunk = (data[:, start:start + size] * scale).astype(dtype)
            if not sample_format.endswith("p"):  # packed: channels interleaved in one plane
                chunk = chunk.T.reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(chunk, format=sample_format, layout=stream.layout.name)
            frame.sample_rate, frame.pts = rate, start
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
        for i in range(video_frames):
            picture = av.VideoFrame.from_ndarray(frame_pattern(i, 32, 32), format="rgb24")
            picture.pts = i
            for packet in video.encode(picture):
                container.mux(packet)
        if video is not None:
            for packet in video.encode(None):
                container.mux(packet)
    return path
