"""The Qwen2.5-Omni thinker equals transformers' Qwen2_5OmniThinkerForConditionalGeneration (torch
CPU, eager, float32) on the same safetensors weights: loss and logits rel-err <= 1e-5, every
parameter gradient <= 1e-5 (audio tower included), greedy generation token for token, TMRoPE
positions and the audio encoder's chunk plan exactly; both checkpoint layouts load, and
transformers loads what we save."""

import json

import numpy as np
import pytest
import torch  # noqa: F401  (the parity reference: required, see tests/conftest.py)
from helpers.omni_reference import (
    AUDIO,
    AUDIO_END,
    AUDIO_START,
    CASES,
    END,
    IMAGE,
    START,
    VIDEO,
    interleaved,
    padded_pair,
    sample,
    tiny_config,
    write_reference,
)
from helpers.qwen_vl_reference import assert_matches_reference, merged, our_forward, reference_forward, rel_err


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from mm_models_vl import Qwen2_5OmniThinkerForConditionalGeneration as Ours

    path = tmp_path_factory.mktemp("omni_thinker")
    reference = write_reference(path)
    return reference, Ours.from_pretrained(path), path


def _inputs(case: str) -> dict:
    rng = np.random.default_rng((CASES + ["padded_pair"]).index(case))
    return padded_pair(rng) if case == "padded_pair" else sample(case, rng)


@pytest.mark.parametrize("case", CASES + ["padded_pair"])
def test_forward_and_gradients_match_transformers(models, case):
    reference, ours, _ = models
    ref_grads = assert_matches_reference(reference, ours, _inputs(case), grad_rel=1e-5)
    towers = {name.split(".")[1] for name in ref_grads if name.startswith(("model.audio_tower.", "model.visual."))}
    expected = {"audio_tower"} if "audio" in case or case == "padded_pair" else set()
    expected |= {"visual"} if case not in ("text", "audio") else set()
    assert towers == expected


@pytest.mark.parametrize("case", ["text", "audio", "audio_in_video"])
def test_greedy_generation_matches_transformers(models, case):
    reference, ours, _ = models
    inputs = sample(case, np.random.default_rng(20 + len(case)))
    inputs.pop("labels")
    torch_inputs = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    expected = reference.generate(**torch_inputs, max_new_tokens=8, do_sample=False).numpy()
    np.testing.assert_array_equal(ours.generate(**inputs, max_new_tokens=8), expected)


def _random_row(rng, config, with_audio_in_video: bool, media: dict) -> list:
    """Text with images, videos and audios (or videos carrying their audio) in random order."""
    ids = rng.integers(3, 240, rng.integers(1, 4)).tolist()
    for _ in range(rng.integers(0, 4)):
        kind = rng.choice(["image", "video", "audio"])
        if kind == "audio":
            frames = int(rng.integers(5, 90))
            media["audios"].append(frames)
            ids += [AUDIO_START] + [AUDIO] * int(((frames - 1) // 2 + 1 - 2) // 2 + 1) + [AUDIO_END]
        else:
            grid = (1 if kind == "image" else int(rng.integers(1, 5)), 2 * int(rng.integers(1, 5)),
                    2 * int(rng.integers(1, 4)))
            if kind == "image":
                media["images"].append(grid)
                ids += [START] + [IMAGE] * merged(grid) + [END]
            elif with_audio_in_video:
                seconds, frames = float(rng.choice([0.5, 1.0, 1.3, 2.0])), int(rng.integers(5, 90))
                media["videos"].append(grid), media["seconds"].append(seconds), media["audios"].append(frames)
                ids += interleaved(grid, frames, seconds, config)
            else:
                media["videos"].append(grid), media["seconds"].append(float(rng.choice([0.5, 1.0, 1.3, 2.0])))
                ids += [START] + [VIDEO] * merged(grid) + [END]
        ids += rng.integers(3, 240, 2).tolist()
    return ids


def test_rope_index_matches_transformers(models):
    """TMRoPE on random batches: images, videos (fractional seconds per grid), audios, videos with
    their audio interleaved in chunks, left and right padding."""
    from mm_models_vl.qwen2_5_omni import positions

    reference, ours, _ = models
    config = tiny_config()
    rng = np.random.default_rng(7)
    checked = 0
    for trial in range(40):
        audio_in_video = bool(trial % 2)
        media = {"images": [], "videos": [], "seconds": [], "audios": []}
        rows = [_random_row(rng, config, audio_in_video, media) for _ in range(2)]
        if not media["images"] and not media["videos"]:
            continue
        length = max(map(len, rows)) + int(rng.integers(0, 3))
        ids, mask = np.zeros((2, length), np.int64), np.zeros((2, length), np.int64)
        for i, row in enumerate(rows):
            start = length - len(row) if trial % 4 == 3 else 0  # left padding now and then
            ids[i, start:start + len(row)], mask[i, start:start + len(row)] = row, 1
        grids = {"image_grid_thw": np.array(media["images"], np.int64) if media["images"] else None,
                 "video_grid_thw": np.array(media["videos"], np.int64) if media["videos"] else None}
        seconds = np.array(media["seconds"], np.float32) if media["videos"] else None
        audio = np.array(media["audios"], np.int64) if media["audios"] else None
        torch_args = {k: torch.from_numpy(v) for k, v in grids.items() if v is not None}
        expected, expected_deltas = reference.model.get_rope_index(
            torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), use_audio_in_video=audio_in_video,
            audio_seqlens=None if audio is None else torch.from_numpy(audio),
            second_per_grids=None if seconds is None else torch.from_numpy(seconds), **torch_args)
        got, deltas = positions.rope_index(ids, mask, grids["image_grid_thw"], grids["video_grid_thw"], audio,
                                           seconds, audio_in_video, config=ours.config)
        np.testing.assert_array_equal(got, expected.numpy())
        np.testing.assert_array_equal(deltas, expected_deltas.numpy())
        checked += 1
    assert checked >= 30


def test_audio_layout_matches_transformers():
    """The encoder's host plan (chunks, valid conv outputs, pooling pairs) and its token counts equal
    transformers' helpers for audios of many lengths, one and several per batch."""
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as ref

    from mm_models_vl.qwen2_5_omni.audio import audio_layout, output_lengths

    rng = np.random.default_rng(3)
    batches = [[n] for n in range(1, 40)] + [rng.integers(3, 120, rng.integers(2, 5)).tolist() for _ in range(30)]
    for lengths in batches:
        lens = torch.tensor(lengths)
        features = torch.arange(sum(lengths), dtype=torch.float32)[None]
        padded, chunk_lengths = ref.chunk_and_pad_features(features, lens, 4)
        plan = audio_layout(lengths, 4)
        gathered = np.append(features[0].numpy(), 0.0)[plan["frame_index"]] * plan["frame_mask"][..., 0]
        np.testing.assert_array_equal(gathered, padded[:, 0].numpy())
        np.testing.assert_array_equal(plan["valid"], ref.get_valid_indices(chunk_lengths).numpy())
        np.testing.assert_array_equal(plan["pool"], ref.get_pool_indices(lens).numpy())
        segments = np.repeat(np.arange(len(chunk_lengths)), np.diff(ref.get_audio_cu_seqlens(chunk_lengths).numpy()))
        np.testing.assert_array_equal(plan["segments"][0], segments)
        from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths
        np.testing.assert_array_equal(output_lengths(lengths), _get_feat_extract_output_lengths(lens).numpy())


def test_transformers_loads_what_we_save(models, tmp_path):
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration as Reference

    _, ours, _ = models
    inputs = _inputs("image_audio_video")
    loss, logits, _ = our_forward(ours, inputs, backward=False)
    ours.save_pretrained(tmp_path / "saved")
    loaded = Reference.from_pretrained(str(tmp_path / "saved"), attn_implementation="eager").float().eval()
    ref_loss, ref_logits, _ = reference_forward(loaded, inputs, backward=False)
    assert abs(loss - ref_loss) / abs(ref_loss) <= 1e-6 and rel_err(logits, ref_logits) <= 1e-6


def _whole_omni_folder(thinker_path, path):
    """The published layout: a whole Qwen2.5-Omni (tiny talker and token2wav) holding the reference
    thinker's weights, re-sharded so the talker's and token2wav's tensors sit in their own file."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
    config = Qwen2_5OmniConfig(
        thinker_config=json.loads((thinker_path / "config.json").read_text()), enable_audio_output=True,
        talker_config=dict(vocab_size=64, embedding_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_parameters=rope),
        token2wav_config=dict(
            dit_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ff_mult=1, emb_dim=16,
                            head_dim=16, repeats=1, num_embeds=64, mel_dim=8, enc_dim=16, enc_emb_dim=8,
                            enc_channels=[16, 16, 16, 16, 32], enc_kernel_sizes=[5, 3, 3, 3, 1],
                            enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8, enc_res2net_scale=2,
                            enc_se_channels=8, look_ahead_layers=[0], look_backward_layers=[0]),
            bigvgan_config=dict(mel_dim=8, upsample_initial_channel=16, resblock_kernel_sizes=[3],
                                resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[2, 2],
                                upsample_kernel_sizes=[4, 4])))
    whole = Qwen2_5OmniForConditionalGeneration(config)
    missing, unexpected = whole.thinker.load_state_dict(_thinker_state(thinker_path), strict=False)
    whole.save_pretrained(str(path))
    tensors = load_file(str(path / "model.safetensors"))
    assert any(k.startswith("talker.") for k in tensors) and any(k.startswith("token2wav.") for k in tensors)
    thinker = {k: v for k, v in tensors.items() if k.startswith("thinker.")}
    speech = {k: v for k, v in tensors.items() if not k.startswith("thinker.")}
    (path / "model.safetensors").unlink()
    save_file(thinker, str(path / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(speech, str(path / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in thinker}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in speech})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return thinker, missing, unexpected


def _thinker_state(thinker_path):
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration as Reference

    return Reference.from_pretrained(str(thinker_path)).state_dict()


def test_whole_omni_folder_loads_the_thinker_without_reading_speech_weights(models, tmp_path):
    """A folder as published (config with thinker_config; ``thinker.*`` beside ``talker.*`` and
    ``token2wav.*``): with the speech shard deleted, the thinker still loads and equals the reference."""
    from mm_models_vl import Qwen2_5OmniThinkerForConditionalGeneration as Ours

    reference, ours, thinker_path = models
    thinker, missing, unexpected = _whole_omni_folder(thinker_path, tmp_path / "omni")
    assert not missing and not unexpected
    assert json.loads((tmp_path / "omni" / "config.json").read_text())["model_type"] == "qwen2_5_omni"
    (tmp_path / "omni" / "model-00002-of-00002.safetensors").unlink()  # never read
    loaded = Ours.from_pretrained(tmp_path / "omni")
    expected = {name: p.asnumpy() for name, p in ours.parameters_and_names()}
    got = {name: p.asnumpy() for name, p in loaded.parameters_and_names()}
    assert set(got) == set(expected) and all(np.array_equal(got[n], expected[n]) for n in expected)
    assert len(thinker) == len(expected)
    inputs = _inputs("audio_in_video")
    ref_loss, ref_logits, _ = reference_forward(reference, inputs, backward=False)
    loss, logits, _ = our_forward(loaded, inputs, backward=False)
    assert abs(loss - ref_loss) / abs(ref_loss) <= 1e-5 and rel_err(logits, ref_logits) <= 1e-5


def test_bad_inputs_are_clear_errors(models):
    _, ours, _ = models
    inputs = sample("audio", np.random.default_rng(3))
    no_mask = {k: v for k, v in inputs.items() if k != "attention_mask"}
    with pytest.raises(ValueError, match="need attention_mask"):
        ours(**no_mask)
    with pytest.raises(ValueError, match="feature_attention_mask"):
        ours(**{k: v for k, v in inputs.items() if k != "feature_attention_mask"})
    with pytest.raises(ValueError, match="no input_features"):
        ours(**{k: v for k, v in inputs.items() if k not in ("input_features", "feature_attention_mask")})
    shorter = inputs["feature_attention_mask"].copy()
    shorter[:, -8:] = 0
    with pytest.raises(ValueError, match="do not match"):
        ours(**dict(inputs, feature_attention_mask=shorter))
