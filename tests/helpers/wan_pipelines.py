"""Tiny diffusers Wan pipeline folders of random parts, as the hub lays them out: Wan2.1's
(transformer), Wan2.2 A14B's (a pair of experts and boundary_ratio in model_index.json) and
TI2V-5B's (Wan2.2's VAE layout, expand_timesteps); each with the tiny set's UMT5 and tokenizer
and a flow-matching Euler scheduler of shift 3."""

from __future__ import annotations

import json
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[2] / "packages/mm-train/src/mm_train/recipes"
KINDS = {  # kind -> (the recipe whose DiT config it takes, model_index.json settings, experts)
    "wan2_1": ("wan2_1_t2v_tiny.yaml", {}, ("transformer",)),
    "a14b": ("wan2_2_a14b_tiny.yaml", {"boundary_ratio": 0.875, "expand_timesteps": False},
             ("transformer", "transformer_2")),
    "ti2v": ("wan2_2_ti2v_tiny.yaml", {"expand_timesteps": True}, ("transformer",)),
}


def write_pipeline(root: Path, kind: str = "wan2_1", seed: int = 3) -> Path:
    """The pipeline folder of ``kind`` under ``root``; each expert's weights from its own seed."""
    import yaml

    import mm_parallel
    from mm_models_video import WanTransformer3DModel
    from mm_train.families.video import tiny as tiny_video

    recipe, settings, experts = KINDS[kind]
    family = "wan2_2" if kind == "ti2v" else "wan"
    for name, folder in tiny_video.encoder_folders(str(root / "parts"), family=family).items():
        if name in ("vae", "text_encoder", "tokenizer"):
            Path(folder).rename(root / name)
    config = yaml.safe_load((RECIPES / recipe).read_text())["model"]["config"]
    topo = mm_parallel.initialize(mm_parallel.ParallelConfig())
    for offset, name in enumerate(experts):
        model = WanTransformer3DModel(config, topo)
        tiny_video._randomise(model, seed=seed + offset, scale=2.0)  # no zero-initialised output
        model.save_pretrained(str(root / name))
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}))
    index = {"_class_name": "WanPipeline", **settings}
    for name in ("vae", "text_encoder", "tokenizer", "scheduler", *experts):
        index[name] = ["diffusers", "x"]  # listed: which library and class does not matter to mm-train
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def diffusers_pipeline(root: Path, image: bool = False):
    """diffusers' WanPipeline (WanImageToVideoPipeline with ``image``) of a folder `write_pipeline` wrote."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanImageToVideoPipeline,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import AutoTokenizer, UMT5EncoderModel

    index = json.loads((root / "model_index.json").read_text())
    parts = dict(tokenizer=AutoTokenizer.from_pretrained(root / "tokenizer"),
                 text_encoder=UMT5EncoderModel.from_pretrained(root / "text_encoder"),
                 vae=AutoencoderKLWan.from_pretrained(root / "vae"),
                 transformer=WanTransformer3DModel.from_pretrained(root / "transformer"),
                 scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
                 expand_timesteps=bool(index.get("expand_timesteps")))
    if (root / "transformer_2").is_dir():
        parts.update(transformer_2=WanTransformer3DModel.from_pretrained(root / "transformer_2"),
                     boundary_ratio=index["boundary_ratio"])
    return WanImageToVideoPipeline(**parts) if image else WanPipeline(**parts)
