"""Wan2.1 T2V pre-training with `mm-train run`: the tiny recipe gives the same losses on one process
and under DP2, TP2+SP, PP2 and CP2 (ring); a PP2 checkpoint resumes on one process; the user's own
annotations with the VAE and text encoder in their diffusers / transformers folders build the
feature cache (a broken video counted and skipped), and a ready cache trains directly."""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers.media import write_picture, write_user_clips
from helpers.mm_train_cli import losses, sample_pixels, val_losses
from helpers.train_runs import train

from mm_train.recipe import load_recipe

pytestmark = pytest.mark.distributed

RECIPES = Path(__file__).resolve().parents[4] / "packages/mm-train/src/mm_train/recipes"
RECIPE = str(RECIPES / "wan2_1_t2v_tiny.yaml")


def run(run_distributed, out, *extra, data, recipe=RECIPE, nproc=1, variables=None):
    """(the losses, what rank 0 printed) of the recipe trained into ``out`` (train_runs.train)."""
    printed = train(run_distributed, recipe, "--set", f"data.path={data}", "--set", f"output_dir={out}",
                    "--no-progress", *extra, nproc=nproc, data=out.parent / "unused", variables=variables)
    return losses(out), printed


# a held-out eighth validated every 2 steps, and at step 4 a sample (2 Euler steps with guidance)
EVAL = ["--set", "eval.every=2", "--set", "eval.fraction=0.125", "--set", "eval.sample_every=4", "--set",
        "eval.prompts=[a red square moving left on blue]", "--set", "eval.steps=2"]


def test_tiny_t2v_same_losses_under_every_layout_and_resume(tmp_path, run_distributed):
    """One process, DP2, TP2+SP, PP2, CP2 ring and DP2 ZeRO-3 (the DiT's weights held as slices)
    give the same losses, validation losses and samples (rank 0 writes the clip all ranks drew); a
    PP2 checkpoint resumes on one process."""

    data, four = tmp_path / "tiny_video", ["--set", "train.steps=4", *EVAL]
    single, _ = run(run_distributed, tmp_path / "single", *four, data=data)
    validated = val_losses(tmp_path / "single")
    assert list(validated) == [2, 4] and validated[4] < validated[2]  # seeded: the same run every time
    layouts = {"dp2": [], "tp2_sp": ["--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true"],
               "pp2": ["--set", "parallel.pp=2"],
               "cp2_ring": ["--set", "parallel.cp=2", "--set", "parallel.cp_algo=ring"],
               "dp2_zero3": ["--set", "parallel.zero_stage=3", "--set", "parallel.zero3_min_numel=1024"]}
    for name, extra in layouts.items():
        got, _ = run(run_distributed, tmp_path / name, *four, *extra, data=data, nproc=2)
        assert got == pytest.approx(single, rel=1e-4), (name, got, single)
        assert val_losses(tmp_path / name) == pytest.approx(val_losses(tmp_path / "single"), rel=1e-4), name
        difference = np.abs(sample_pixels(tmp_path / name, 4) - sample_pixels(tmp_path / "single", 4))
        assert difference.max() <= 2 and difference.mean() < 0.05, (name, difference.max(), difference.mean())
    every = ["--set", "checkpoint.every=2"]
    run(run_distributed, tmp_path / "resumed", "--set", "parallel.pp=2", "--set", "train.steps=2", *every, *EVAL,
        data=data, nproc=2)
    resumed, _ = run(run_distributed, tmp_path / "resumed", *four, *every, "--resume", data=data)
    assert resumed == pytest.approx(single, rel=1e-4)
    assert val_losses(tmp_path / "resumed") == pytest.approx(val_losses(tmp_path / "single"), rel=1e-4)
    state = json.loads((tmp_path / "resumed" / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["data"] == {"epoch": 0, "position": 4, "seed": 0, "global_batch_size": 8}


def test_tiny_i2v_same_losses_under_tp_sp_pp_and_ulysses(tmp_path, run_distributed):
    """The I2V DiT (image tokens through the added key / value projections, the image's latents
    and mask beside the noise) trains, validates and samples from a first frame alike on one
    process, TP2+SP, PP2 and CP2 Ulysses."""

    first_frame = write_picture(tmp_path / "first_frame.png")
    data, recipe = tmp_path / "tiny_video", str(RECIPES / "wan2_1_i2v_tiny.yaml")
    four = ["--set", "train.steps=4", *EVAL, "--set", f"eval.images=[{first_frame}]"]
    single, _ = run(run_distributed, tmp_path / "single", *four, data=data, recipe=recipe)
    index = (data / "features-i2v" / "index-r000.jsonl").read_text().splitlines()
    assert set(json.loads(index[0])["features"]) == {"latents", "prompt_embeds", "image_embeds", "condition"}
    layouts = {"tp2_sp": ["--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true"],
               "pp2": ["--set", "parallel.pp=2"], "cp2_ulysses": ["--set", "parallel.cp=2"]}
    for name, extra in layouts.items():
        got, _ = run(run_distributed, tmp_path / name, *four, *extra, data=data, recipe=recipe, nproc=2)
        assert got == pytest.approx(single, rel=1e-4), (name, got, single)
        assert val_losses(tmp_path / name) == pytest.approx(val_losses(tmp_path / "single"), rel=1e-4), name
        difference = np.abs(sample_pixels(tmp_path / name, 4) - sample_pixels(tmp_path / "single", 4))
        assert difference.max() <= 2 and difference.mean() < 0.05, (name, difference.max(), difference.mean())


def _encoder_folders(root):
    """A tiny Wan2.1 VAE (diffusers) and UMT5 encoder (transformers) with a BPE tokenizer, saved as released."""
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    from mm_train.families.video.tiny import TEXT_CONFIG, VAE_CONFIG, generate, tokenizer

    torch.manual_seed(0)
    AutoencoderKLWan(**VAE_CONFIG).save_pretrained(root / "vae")
    UMT5EncoderModel(UMT5Config(**TEXT_CONFIG)).save_pretrained(root / "text_encoder")
    generate(str(root / "words"), samples=8)  # only for its tokenizer
    tokenizer(str(root / "words")).save_pretrained(root / "text_encoder")


def test_user_annotations_build_the_cache_and_a_ready_cache_trains(tmp_path, run_distributed):
    _encoder_folders(tmp_path)
    user = write_user_clips(tmp_path) + ["--set", f"data.vae={tmp_path / 'vae'}", "--set",
                                   f"data.text_encoder={tmp_path / 'text_encoder'}"]
    got, log = run(run_distributed, tmp_path / "user", *user, data=tmp_path / "data.jsonl")
    assert np.isfinite(got).all() and "1 bad samples skipped" in log
    assert "broken.mp4" in (tmp_path / "user" / "bad_samples.jsonl").read_text()
    cache = tmp_path / "user" / "features"
    index = [json.loads(line) for line in (cache / "index-r000.jsonl").read_text().splitlines()]
    assert len(index) == 6 and {tuple(e["features"]["latents"]) for e in index} >= {(4, 3, 4, 4)}
    ready = ["--set", "data.kind=video_features", "--set", "train.steps=2", "--set", "train.global_batch_size=2",
             "--set", "train.micro_batch_size=1", "--set", "data.caption_dropout=0"]
    again, _ = run(run_distributed, tmp_path / "ready", *ready, data=cache)
    assert again == pytest.approx(got, rel=1e-5)  # the same cache, seed and steps: the same run


def test_own_clips_train_with_the_tiny_encoders_by_name(tmp_path, run_distributed):
    """data.vae / text_encoder / image_encoder: tiny write the tiny random encoders once as real
    folders in the Wan2.1 diffusers layout — diffusers and transformers load them with our
    tensors bit for bit — and one's own clips train on them, T2V and I2V, and from WebDataset
    shards of them (data.format) under dp2 alike."""
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import AutoTokenizer, CLIPImageProcessorPil, CLIPVisionModel, UMT5EncoderModel

    from mm_train.families.video import tiny as tiny_video

    user = write_user_clips(tmp_path) + ["--set", "data.vae=tiny", "--set", "data.text_encoder=tiny"]
    home = {"MM_TRAIN_VIDEO_DATA": str(tmp_path / "home")}
    t2v, _ = run(run_distributed, tmp_path / "t2v", *user, data=tmp_path / "data.jsonl", variables=home)
    i2v, log = run(run_distributed, tmp_path / "i2v", *user, "--set", "data.image_encoder=tiny",
                   data=tmp_path / "data.jsonl", recipe=str(RECIPES / "wan2_1_i2v_tiny.yaml"), variables=home)
    assert np.isfinite(t2v + i2v).all() and "1 bad samples skipped" in log
    # the same clips as WebDataset shards (mm-data convert): the cache built by two ranks, each
    # reading its own blocks, and dp2 training give the JSONL run's losses
    from mm_data.shards.convert import convert

    convert(str(tmp_path / "data.jsonl"), str(tmp_path / "tars"), "webdataset", rows_per_shard=4, rows_per_block=2)
    sharded, _ = run(run_distributed, tmp_path / "t2v-shards", *user, "--set", "data.format=webdataset",
                     data=tmp_path / "tars", nproc=2, variables=home)
    assert sharded == pytest.approx(t2v, rel=1e-5)
    folders = tmp_path / "home" / "tiny_encoders"
    assert sorted(p.name for p in folders.iterdir() if p.is_dir()) == sorted(tiny_video.ENCODER_FIELDS)
    vae, text, clip, _ = tiny_video.encoders(image=True)
    for ours, theirs in ((vae, AutoencoderKLWan.from_pretrained(folders / "vae")),
                         (text, UMT5EncoderModel.from_pretrained(folders / "text_encoder")),
                         (clip, CLIPVisionModel.from_pretrained(folders / "image_encoder"))):
        state, names = theirs.state_dict(), 0
        for name, param in ours.parameters_and_names():
            name = name if name in state else "vision_model." + name
            assert torch.equal(state[name], torch.from_numpy(param.asnumpy())), name
            names += 1
        assert names == len(set(state) - {"encoder.embed_tokens.weight"})  # tied to shared.weight
    assert AutoTokenizer.from_pretrained(folders / "tokenizer")("a red square")["input_ids"]
    assert CLIPImageProcessorPil.from_pretrained(folders / "image_processor").crop_size["height"] == 32


def test_online_encoding_trains_alike_under_dp2_and_shared_out_under_cp2(tmp_path, run_distributed):
    """data.online: clips decoded and encoded every step (no cache written); DP2 equals one process,
    and so does CP2 with data.encoder_dp, whose two ranks encode a step's 3 micro-batches in two
    rounds (the second's spare rank encoding one again): a micro-batch's features paired with
    another's noise would change the loss."""
    data = tmp_path / "tiny_video"
    online = ["--set", "data.online=true", "--set", "train.steps=3", "--set", "train.global_batch_size=6",
              "--set", "train.micro_batch_size=2"]
    single, _ = run(run_distributed, tmp_path / "single", *online, data=data)
    dp2, _ = run(run_distributed, tmp_path / "dp2", *online, "--set", "train.micro_batch_size=1", data=data, nproc=2)
    shared = ["--set", "parallel.cp=2", "--set", "data.encoder_dp=true"]
    cp2, _ = run(run_distributed, tmp_path / "cp2_encoder_dp", *online, *shared, data=data, nproc=2)
    assert dp2 == pytest.approx(single, rel=1e-4) and np.isfinite(single).all()
    assert cp2 == pytest.approx(single, rel=1e-4)
    assert not (data / "features-t2v").exists()


def test_encoder_dp_rounds_give_every_micro_batch_one_encoder():
    from mm_train.families.video.encoder_dp import rounds

    assert [rounds(3, 2, k) for k in (0, 1)] == [[0, 2], [1, 2]]  # the spare rank of round 2 repeats its first
    assert [rounds(4, 4, k) for k in range(4)] == [[0], [1], [2], [3]]
    assert rounds(5, 1, 0) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="data.encoder_dp shares out online encoding"):
        load_recipe("wan2_1_t2v_tiny", ["data.encoder_dp=true"])


def test_a_feature_cache_on_node_local_disks_is_built_by_both_nodes_and_read_where_it_is(tmp_path, run_distributed):
    """data.features_shared_fs=false over two nodes (two launches, each its own output_dir): each
    node encodes its share into its own folder and learns the other's index; as each node's rank
    would read the other's features, the run is refused on both, naming the shards and where they
    are. Copied over (as rsync would), the rerun encodes nothing again and trains like one process."""
    import shutil

    from helpers.mm_train_cli import launch_two_nodes

    user = write_user_clips(tmp_path) + ["--set", "data.vae=tiny", "--set", "data.text_encoder=tiny"]
    home = {"MM_TRAIN_VIDEO_DATA": str(tmp_path / "home")}
    single, _ = run(run_distributed, tmp_path / "single", *user, data=tmp_path / "data.jsonl", variables=home)
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    local = [RECIPE, "--set", f"data.path={tmp_path / 'data.jsonl'}", *user, "--set", "data.features_shared_fs=false",
             "--no-progress"]
    errs = launch_two_nodes(tmp_path, *local, outs=nodes, data=tmp_path / "unused", expect_ok=False, variables=home)
    folders = [node / "features" for node in nodes]
    own = [sorted(p.name for p in folder.glob("features-r*.safetensors")) for folder in folders]
    assert own[0] and own[1] and all(name.startswith("features-r000") for name in own[0])
    assert all(name.startswith("features-r001") for name in own[1])
    assert (folders[0] / "index-node-1.jsonl").is_file() and (folders[1] / "index-node-0.jsonl").is_file()
    for err in errs:
        assert "data.features_shared_fs is false" in err and "(on node 1)" in err and "(on node 0)" in err, \
            err[-3000:]
    written = {p: p.stat().st_mtime_ns for folder in folders for p in folder.glob("features-r*.safetensors")}
    for source, target in ((folders[0], folders[1]), (folders[1], folders[0])):
        for path in source.glob("features-r*.safetensors"):
            if path.name in {name for name in own[0] + own[1]} and not (target / path.name).exists():
                shutil.copy2(path, target / path.name)
    launch_two_nodes(tmp_path, *local, outs=nodes, data=tmp_path / "unused", variables=home)
    assert losses(nodes[0]) == pytest.approx(single, rel=1e-5)
    assert all(p.stat().st_mtime_ns == mtime for p, mtime in written.items())  # nothing encoded again
