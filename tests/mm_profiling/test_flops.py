"""The FLOPs formula helpers follow the shapes written out by hand (the models' own counts are
tested against torch's FlopCounterMode beside the models)."""


def test_decoder_flops_follow_the_shapes():
    from mm_profiling.flops import decoder_lm_flops

    # one layer, no head: q, k, v, o, QK^T, PV, gate, up, down written out by hand
    s, h, nh, nkv, i = 10, 8, 2, 1, 12
    d = h // nh
    by_hand = 2 * s * h * (nh * d) + 2 * 2 * s * h * (nkv * d) + 2 * s * (nh * d) * h + 2 * nh * 2 * s * s * d \
        + 3 * 2 * s * h * i
    assert decoder_lm_flops(s, h, 1, nh, nkv, i, vocab=50, lm_head=False) == by_hand
    assert decoder_lm_flops(s, h, 1, nh, nkv, i, vocab=50) == by_hand + 2 * s * h * 50
