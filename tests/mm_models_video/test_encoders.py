"""The encoders the video DiTs condition on equal transformers' on the same weights:
UMT5EncoderModel (Wan) and T5EncoderModel (CogVideoX) on a padded batch (last hidden state rel-err
<= 1e-5), and CLIPVisionModel (the penultimate hidden state Wan I2V takes, last hidden state and
pooled output)."""

import numpy as np
import pytest
import torch
from helpers.torch_reference import assert_same_state, rel_err


def randomise(model, seed: int = 0):
    """Spread weights wider than the default init so attention and norms matter."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / max(p[0].numel(), 1) ** 0.5 if p.ndim > 1 else 0.1))
    return model


def test_relative_position_buckets_equal_transformers():
    from transformers import UMT5Config
    from transformers.models.umt5.modeling_umt5 import UMT5Attention

    from mm_models_video.encoders.t5 import relative_position_buckets

    for buckets, distance in ((32, 128), (16, 20)):
        attention = UMT5Attention(UMT5Config(relative_attention_num_buckets=buckets,
                                             relative_attention_max_distance=distance, is_decoder=False), True)
        relative = torch.arange(600)[None, :] - torch.arange(600)[:, None]
        expected = attention._relative_position_bucket(relative).numpy()
        np.testing.assert_array_equal(relative_position_buckets(600, 600, buckets, distance), expected)


@pytest.mark.parametrize("proj", ["gated-gelu", "relu"])
def test_t5_encoder_flops_equal_torch_flop_counter(proj):
    """t5_encoder_flops (the planner's charge for encoding captions online) against FlopCounterMode
    over transformers' T5EncoderModel (attention through the math backend)."""
    import transformers
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from mm_models_video.encoders.t5 import t5_encoder_flops

    fields = dict(vocab_size=300, d_model=32, d_kv=8, d_ff=48, num_layers=3, num_heads=6, feed_forward_proj=proj)
    reference = transformers.T5EncoderModel(transformers.T5Config(**fields)).eval()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        reference(input_ids=torch.zeros((1, 37), dtype=torch.int64))
    assert t5_encoder_flops(fields, 37) == counter.get_total_flops()


@pytest.mark.parametrize("kind", ["UMT5", "T5"])
def test_t5_style_encoders_equal_transformers(tmp_path, kind):
    """UMT5 (a bias table per layer, Wan) and T5 v1.1 (the first layer's table shared, CogVideoX)."""
    import transformers

    import mm_models_video.encoders as ours_module

    config = getattr(transformers, f"{kind}Config")(
        vocab_size=300, d_model=32, d_kv=8, d_ff=48, num_layers=3, num_heads=4, relative_attention_num_buckets=16,
        relative_attention_max_distance=20, feed_forward_proj="gated-gelu", dropout_rate=0.0)
    reference = randomise(getattr(transformers, f"{kind}EncoderModel")(config)).eval()
    tables = [n for n in reference.state_dict() if "relative_attention_bias" in n]
    assert len(tables) == (3 if kind == "UMT5" else 1)
    reference.save_pretrained(tmp_path)
    ours = getattr(ours_module, f"{kind}EncoderModel").from_pretrained(tmp_path)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 300, (2, 40))
    mask = np.ones((2, 40), np.int64)
    mask[1, 25:] = 0  # a padded sample
    with torch.no_grad():
        want = reference(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state
    got = ours(ids, attention_mask=mask).last_hidden_state.asnumpy()
    keep = mask.astype(bool)  # padded positions are computed but meaningless
    assert rel_err(got[keep], want.numpy()[keep]) <= 1e-5
    ours.save_pretrained(tmp_path / "saved")  # and back: transformers loads what we write
    back = getattr(transformers, f"{kind}EncoderModel").from_pretrained(tmp_path / "saved")
    assert_same_state(back, reference)


@pytest.mark.parametrize("act", ["gelu", "quick_gelu"])
def test_clip_vision_equals_transformers(tmp_path, act):
    from transformers import CLIPVisionConfig
    from transformers import CLIPVisionModel as Reference

    from mm_models_video.encoders import CLIPVisionModel

    config = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=28, patch_size=7, hidden_act=act, layer_norm_eps=1e-5)
    reference = randomise(Reference(config)).eval()
    reference.save_pretrained(tmp_path)
    ours = CLIPVisionModel.from_pretrained(tmp_path)
    pixels = np.random.default_rng(1).standard_normal((2, 3, 28, 28)).astype(np.float32)
    with torch.no_grad():
        want = reference(pixel_values=torch.from_numpy(pixels), output_hidden_states=True)
    got = ours(pixels, output_hidden_states=True)
    assert len(got.hidden_states) == len(want.hidden_states) == 4
    assert rel_err(got.hidden_states[-2].asnumpy(), want.hidden_states[-2].numpy()) <= 1e-5  # what Wan I2V takes
    assert rel_err(got.last_hidden_state.asnumpy(), want.last_hidden_state.numpy()) <= 1e-5
    assert rel_err(got.pooler_output.asnumpy(), want.pooler_output.numpy()) <= 1e-5
    with pytest.raises(ValueError, match="doesn't match the model"):
        ours(pixels[..., :21, :21])
    ours.save_pretrained(tmp_path / "saved")  # and back: transformers loads what we write
    assert_same_state(Reference.from_pretrained(tmp_path / "saved"), reference)
