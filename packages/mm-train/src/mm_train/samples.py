"""Samples to look at while training (``eval.sample_every``) and the pieces `mm-train generate` shares.

Every ``eval.sample_every`` steps (and at the last step) the family's task draws one sample per
prompt of ``eval.prompts`` with the weights of that step and rank 0 writes them under
``OUT/samples/step_N/``: for video families an mp4 per prompt (PyAV, H.264) and a contact sheet
PNG of its frames (mm_train.families.video.samples); for VL families a Markdown page of the greedy answers
beside their pictures. With TensorBoard on, each contact sheet is also an image event.

Every rank runs the model (its collectives need everyone): `predict` runs the whole model under
tp / cp (the models gather their output), under pp the forward passes through the stages
(`mm_parallel.pipeline.forward_only`) and the last stage broadcasts the prediction to the
others; data-parallel replicas compute the same sample. The model runs with ``set_train(False)``
(`inference`), then in the mode it was in.
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, List, Sequence

import numpy as np

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore); Pillow, PyAV
# (optional: a missing one is named when a run needs it).


@contextlib.contextmanager
def inference(chunks):
    """The model chunks in inference mode (no dropout), back in the mode each was in afterwards."""
    before = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.set_train(False)
    try:
        yield
    finally:
        for chunk, mode in zip(chunks, before):
            chunk.set_train(mode)


def predict(chunks, topo, inputs: Dict, shape: Sequence[int]) -> np.ndarray:
    """The model's whole ``sample`` output for one micro-batch of forward keywords on every rank;
    ``shape``: the output's shape (the latents'), which the other pipeline stages receive."""
    import mindspore as ms

    if topo.pp.size == 1:
        return chunks[0](**inputs).sample.asnumpy()
    from mm_parallel import comm, pipeline

    last = chunks[-1]
    outputs = pipeline.forward_only([c.pipeline_stage for c in chunks], [(inputs, inputs)],
                                    lambda y, b: last.pipeline_sample(y, b), topo, with_batch=True)
    mine = outputs[0] if outputs else ms.Tensor(np.zeros(tuple(shape), np.float32))
    return comm.broadcast(mine.astype(ms.float32), topo.pp.ranks[-1], topo.pp).asnumpy()


def write_mp4(path: str, frames: np.ndarray, fps: float) -> str:
    """Frames (F, H, W, 3) uint8 as an H.264 mp4 (even sizes: odd ones are padded by one pixel)."""
    import av

    f, h, w, _ = frames.shape
    padded = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    with av.open(path, "w") as container:
        stream = container.add_stream("libx264", rate=max(1, int(round(fps))))
        stream.width, stream.height, stream.pix_fmt = padded.shape[2], padded.shape[1], "yuv420p"
        # x264's float decisions (CRF rate control, adaptive quantisation, macroblock tree, psy) follow the
        # process's floating-point state, which other codecs change (measured: after a libopus encode in
        # the same process, equal frames encoded differently); a constant QP without them, on one
        # thread, makes equal frames the same file
        stream.options = {"qp": "18", "threads": "1", "aq-mode": "0", "mbtree": "0", "psy": "0"}
        for frame in padded:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(yuv420p(frame), format="yuv420p")))
        container.mux(stream.encode())
    return path


def yuv420p(rgb: np.ndarray) -> np.ndarray:
    """(H, W, 3) uint8 RGB (even sizes) as the (H * 3 / 2, W) planes of limited-range BT.601 4:2:0,
    in numpy: our arithmetic, whatever the process's floating-point state."""
    x = rgb.astype(np.float64)
    r, g, b = x[..., 0], x[..., 1], x[..., 2]
    y = 16 + (65.481 * r + 128.553 * g + 24.966 * b) / 255
    u = 128 + (-37.797 * r - 74.203 * g + 112.0 * b) / 255
    v = 128 + (112.0 * r - 93.786 * g - 18.214 * b) / 255
    h, w = y.shape
    quarter = lambda c: c.reshape(h // 2, 2, w // 2, 2).mean((1, 3))  # noqa: E731
    planes = [np.clip(np.round(c), 0, 255).astype(np.uint8).reshape(-1) for c in (y, quarter(u), quarter(v))]
    return np.concatenate(planes).reshape(h * 3 // 2, w)  # PyAV's layout: the three planes end to end


def contact_sheet(frames: np.ndarray, columns: int = 12, scale: int = 1) -> np.ndarray:
    """Frames (F, H, W, 3) uint8 laid out in rows of ``columns`` (H', W', 3), each ``scale`` x larger
    (tiny clips are otherwise too small to see), a 2-pixel grey gap between them."""
    frames = frames.repeat(scale, 1).repeat(scale, 2) if scale > 1 else frames
    f, h, w, _ = frames.shape
    columns = min(columns, f)
    rows = -(-f // columns)
    sheet = np.full((rows * (h + 2) - 2, columns * (w + 2) - 2, 3), 128, np.uint8)
    for i, frame in enumerate(frames):
        r, c = divmod(i, columns)
        sheet[r * (h + 2):r * (h + 2) + h, c * (w + 2):c * (w + 2) + w] = frame
    return sheet


def write_png(path: str, image: np.ndarray) -> str:
    from PIL import Image

    Image.fromarray(image).save(path)
    return path


def to_frames(video: np.ndarray) -> np.ndarray:
    """A decoded clip (C, F, H, W) in [-1, 1] as (F, H, W, 3) uint8."""
    return np.rint((np.clip(video, -1.0, 1.0).transpose(1, 2, 3, 0) + 1.0) * 127.5).astype(np.uint8)


def check(task, recipe) -> None:
    """Before the first step: the family draws samples, if the recipe asks for them."""
    if recipe.eval.sample_every and not callable(getattr(task, "write_samples", None)):
        raise ValueError(f"eval.sample_every: family {recipe.model.family} draws no samples; set it to 0")


def folder(recipe, step: int) -> str:
    return os.path.join(recipe.output_dir, "samples", f"step_{step}")


def write(task, chunks, topo, step: int, board=None) -> List[str]:
    """The samples of ``step`` (see the module docstring); returns the files rank 0 wrote,
    relative to output_dir (empty elsewhere)."""
    out = folder(task.recipe, step)
    if topo.rank == 0:
        os.makedirs(out, exist_ok=True)
    with inference(chunks):
        written = task.write_samples(chunks, out, writer=topo.rank == 0)
    if board is not None:
        for name, image in written.get("images", {}).items():
            board.add_sample_image(name, image, step)
    return [os.path.relpath(p, task.recipe.output_dir) for p in written.get("files", [])]
