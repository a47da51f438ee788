"""The Ascend path on CPU: the stand-ins do what MindSpore 2.7's pages say (their own examples, an
independent numpy attention, the errors the pages name), and every fused branch of mm's kernels
equals the reference path, forward and backward (fp32). Whole models and the native backend's
collectives on 2 and 4 processes: test_collectives.py, test_qwen2_5_vl_parallel.py,
test_wan_parallel.py."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mm_parallel import ops as kernels
from mm_parallel.testing import ascend_kernels as ak
from mm_parallel.testing.device_path import ascend_stand_ins

RNG = np.random.default_rng(0)


def _t(*shape, dtype=ms.float32):
    return Tensor(RNG.standard_normal(shape).astype(np.float32), dtype)


# -- the stand-ins against the pages' own examples -----------------------------------------------

def test_the_documented_examples():
    q = Tensor(np.ones([2, 4, 64]), dtype=ms.float16)
    assert ak.flash_attention_score(q, q, q, 4).shape == (2, 4, 64)
    y, rstd = ak.rms_norm(Tensor(np.array([[1, 2, 3], [1, 2, 3]]), ms.float32), Tensor(np.ones([3]), ms.float32))
    np.testing.assert_allclose(y.asnumpy(), [[0.46290997, 0.92581993, 1.3887299]] * 2, rtol=1e-6)
    np.testing.assert_allclose(rstd.asnumpy(), [[0.46290997]] * 2, rtol=1e-6)
    out = ak.swiglu(Tensor([[-0.12, 0.123, 31.122], [2.1223, 4.1212121217, 0.3123]], dtype=ms.float32), 0)
    np.testing.assert_allclose(out.asnumpy(), [[-0.11970687, 0.2690224, 9.7194]], rtol=1e-5)
    x = Tensor(np.random.uniform(-2, 2, (4, 64, 4, 32)), ms.float32)
    cos = Tensor(np.random.uniform(-1, 1, (1, 64, 1, 32)), ms.float32)
    assert ak.rotary_position_embedding(x, cos, cos, 0).shape == (4, 64, 4, 32)
    rows = Tensor(np.array([[0] * 4, [1] * 4, [2] * 4, [2] * 4, [1] * 4, [1] * 4]), ms.float16)
    gmm = ak.grouped_matmul([rows], [Tensor(np.arange(32).reshape((4, 4, 2)), ms.float16)],
                            group_list=Tensor([1, 3, 4, 6], ms.int64), split_item=3, group_type=0)
    np.testing.assert_array_equal(gmm[0].asnumpy(), [[0, 0], [44, 48], [88, 96], [152, 160], [108, 112],
                                                     [108, 112]])


# -- flash_attention_score against numpy -----------------------------------------------------------

def _numpy_attention(q, k, v, dropped, scale):
    """q (B, N1, S1, D), k / v (B, N2, S2, D), dropped broadcastable to (B, N1, S1, S2)."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, 1), np.repeat(v, group, 1)
    s = np.einsum("bnqd,bnkd->bnqk", q, k) * scale
    s = np.where(dropped, -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bnqk,bnkd->bnqd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("sparse_mode, pre, nxt", [(0, 1, 0), (2, 0, 0), (3, 0, 0), (4, 2, 1)])
@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH", "SBH"])
def test_flash_attention_layouts_and_sparse_modes(layout, sparse_mode, pre, nxt):
    b, n1, n2, s1, s2, d = 2, 4, 2, 5, 7, 16
    q, k, v = (RNG.standard_normal(shape).astype(np.float32) for shape in
               [(b, n1, s1, d), (b, n2, s2, d), (b, n2, s2, d)])
    i, j = np.arange(s1)[:, None], np.arange(s2)[None, :]
    user = RNG.random((b, 1, s1, s2)) < 0.2
    user[..., np.arange(s1), np.arange(s1)] = False  # every row keeps a key inside each band
    if sparse_mode == 0:
        dropped, mask = user | (j - i > nxt) | (j - i < -pre), Tensor(user.astype(np.uint8))
    else:
        shift = 0 if sparse_mode == 2 else s2 - s1
        dropped = (j - i - shift > nxt) | (j - i - shift < -pre) if sparse_mode == 4 else (j > i + shift)
        mask = Tensor(np.triu(np.ones((2048, 2048), np.uint8), 1))
    want = _numpy_attention(q, k, v, dropped, 0.3)
    into = {"BNSD": lambda a: a, "BSND": lambda a: a.transpose(0, 2, 1, 3),
            "BSH": lambda a: a.transpose(0, 2, 1, 3).reshape(a.shape[0], a.shape[2], -1),
            "SBH": lambda a: a.transpose(2, 0, 1, 3).reshape(a.shape[2], a.shape[0], -1)}[layout]
    out = ak.flash_attention_score(*(Tensor(into(a), ms.float16) for a in (q, k, v)), n1, attn_mask=mask,
                                   scalar_value=0.3, pre_tokens=pre, next_tokens=nxt, input_layout=layout,
                                   sparse_mode=sparse_mode)
    np.testing.assert_allclose(out.astype(ms.float32).asnumpy(), into(want), atol=5e-3)


def test_flash_attention_packed_tnd_and_dropout():
    n, d, lens = 2, 16, [3, 5, 2]
    q, k, v = (RNG.standard_normal((sum(lens), n, d)).astype(np.float32) for _ in range(3))
    ends = np.cumsum(lens).tolist()
    out = ak.flash_attention_score(*(Tensor(a, ms.float16) for a in (q, k, v)), n, actual_seq_qlen=ends,
                                   actual_seq_kvlen=ends, scalar_value=0.25, input_layout="TND", next_tokens=0,
                                   attn_mask=Tensor(np.triu(np.ones((2048, 2048), np.uint8), 1)), sparse_mode=3)
    start = 0
    for length in lens:
        part = slice(start, start + length)
        causal = np.arange(length)[None, :] > np.arange(length)[:, None]
        want = _numpy_attention(*(a[part].transpose(1, 0, 2)[None] for a in (q, k, v)), causal, 0.25)
        np.testing.assert_allclose(out[part].astype(ms.float32).asnumpy(), want[0].transpose(1, 0, 2), atol=5e-3)
        start += length
    # dropout from a given mask: bit k of byte m keeps pair 8 m + k, kept probabilities scaled by 1 / keep_prob
    qb, kb, vb = (RNG.standard_normal(shape).astype(np.float32) for shape in [(1, 1, 2, 16), (1, 1, 8, 16),
                                                                                (1, 1, 8, 16)])
    bits = RNG.random((1, 1, 2, 8)) < 0.5
    packed = np.packbits(bits, axis=-1, bitorder="little")
    got = ak.flash_attention_score(*(Tensor(a, ms.float16) for a in (qb, kb, vb)), 1, drop_mask=Tensor(packed),
                                   keep_prob=0.5, input_layout="BNSD")
    s = np.einsum("bnqd,bnkd->bnqk", qb, kb)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bnqk,bnkd->bnqd", p / p.sum(-1, keepdims=True) * bits / 0.5, vb)
    np.testing.assert_allclose(got.astype(ms.float32).asnumpy(), want, atol=5e-3)


# -- mm's fused branches against the reference path -----------------------------------------------

def _value_and_grads(fn, inputs):
    return ms.value_and_grad(lambda *xs: (fn(*xs) * _WEIGHTS[tuple(fn(*xs).shape)]).sum(),
                             tuple(range(len(inputs))))(*inputs)


_WEIGHTS = {}


def _both_paths(fn, inputs, expect_calls):
    """fn's weighted sum and input gradients on the reference path and on the stand-ins."""
    out_shape = tuple(fn(*inputs).shape)
    _WEIGHTS[out_shape] = Tensor(RNG.standard_normal(out_shape).astype(np.float32))
    want = _value_and_grads(fn, inputs)
    with ascend_stand_ins() as calls:
        got = _value_and_grads(fn, inputs)
        assert set(expect_calls) <= set(calls), calls
    for a, b in zip([got[0]] + list(got[1]), [want[0]] + list(want[1])):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-5)


B, S, H, KV, D = 2, 6, 4, 2, 16
_KEEP = np.ones((B, S), np.int32)
_KEEP[0, :2], _KEEP[1, 4:] = 0, 0  # left padding in one sample, right in the other


@pytest.mark.parametrize("case", [
    {}, {"causal": True}, {"key_padding_mask": _KEEP}, {"key_padding_mask": _KEEP, "causal": True},
    {"segment_ids": np.array([[0, 0, 1, 1, 1, 2]] * B)},
    {"segment_ids": np.array([[0, 0, 1, 1, 1, 2]]), "causal": True},
    {"segment_ids": np.array([[0, 1, 0, 1, 1, 2]] * B)},  # not contiguous runs: the full mask
], ids=["full", "causal", "padding", "padding_causal", "packed", "packed_causal", "interleaved_segments"])
def test_fused_attention_equals_the_reference_path(case):
    case = {k: Tensor(v.astype(np.int32)) for k, v in case.items() if k != "causal"} | (
        {"causal": True} if case.get("causal") else {})
    _both_paths(lambda q, k, v: kernels.attention(q, k, v, **case), [_t(B, S, H, D), _t(B, S, KV, D), _t(B, S, KV, D)],
                ["flash_attention_score"])


@pytest.mark.parametrize("causal", [False, True])
def test_fused_attention_equals_the_reference_path_run_in_segment_blocks(causal):
    """A packed batch of one in contiguous segments: the reference path runs them as a padded
    batch of segments (ops.attention.segment_blocks); the kernel takes them as TND segments."""
    from mm_parallel.ops.attention import segment_blocks

    segments = np.repeat([0, 1, 2, 3], [5, 8, 3, 8])[None].astype(np.int32)
    assert segment_blocks(segments) is not None
    _both_paths(lambda q, k, v: kernels.attention(q, k, v, segment_ids=Tensor(segments), causal=causal),
                [_t(1, 24, H, D), _t(1, 24, KV, D), _t(1, 24, KV, D)], ["flash_attention_score"])


@pytest.mark.parametrize("head_dim", [72, 80])
@pytest.mark.parametrize("case", ["packed", "packed_causal", "padding_causal"])
def test_head_sizes_off_the_kernels_multiple_of_16_are_padded_exactly(head_dim, case):
    """Qwen3-VL's vision head (72) and Qwen2.5-VL's (80): zero-padded to 80 / 80 for the kernel."""
    segments = Tensor(np.repeat([0, 1, 2], [2, 3, 1])[None].astype(np.int32))
    kwargs = {"packed": {"segment_ids": segments}, "packed_causal": {"segment_ids": segments, "causal": True},
              "padding_causal": {"key_padding_mask": Tensor(_KEEP[:1]), "causal": True}}[case]
    _both_paths(lambda q, k, v: kernels.attention(q, k, v, **kwargs),
                [_t(1, S, H, head_dim), _t(1, S, KV, head_dim), _t(1, S, KV, head_dim)], ["flash_attention_score"])


def test_queries_without_a_key_are_zero_with_finite_gradients():
    """A fully padded sample and causal attention with more queries than keys: the page leaves such
    rows undefined (the stand-in returns NaN), so the kernel never sees one."""
    keep = _KEEP.copy()
    keep[1] = 0  # the second sample is all padding
    _both_paths(lambda q, k, v: kernels.attention(q, k, v, causal=True, key_padding_mask=Tensor(keep)),
                [_t(B, S, H, D), _t(B, S, KV, D), _t(B, S, KV, D)], ["flash_attention_score"])
    _both_paths(lambda q, k, v: kernels.attention(q, k, v, causal=True),
                [_t(B, S + 3, H, D), _t(B, S, KV, D), _t(B, S, KV, D)], ["flash_attention_score"])


def test_more_sequences_than_one_call_takes_are_split():
    """2,100 packed segments: the non-causal batch of segments over two calls (B <= 2048), the
    causal TND over three (at most 1,024 sequences)."""
    segments = Tensor(np.repeat(np.arange(2100), 1)[None].astype(np.int32))
    for causal, calls in ((False, 2), (True, 3)):
        with ascend_stand_ins() as made:
            out = kernels.attention(*(_t(1, 2100, 1, 16) for _ in range(3)), segment_ids=segments, causal=causal)
        assert made.count("flash_attention_score") == calls and not np.isnan(out.asnumpy()).any()


def test_heads_the_kernel_does_not_admit_take_the_reference_path():
    with ascend_stand_ins() as calls:
        kernels.attention(_t(1, 4, 1, 520), _t(1, 4, 1, 520), _t(1, 4, 1, 520))
        kernels.attention(_t(1, 2, 257, 16), _t(1, 2, 257, 16), _t(1, 2, 257, 16))
    assert "flash_attention_score" not in calls


def test_float32_attention_stays_on_the_reference_path_without_the_widening():
    q = _t(1, 4, 2, 16)
    with ascend_stand_ins(float32=False) as calls:
        kernels.attention(q, q, q, causal=True)
    assert "flash_attention_score" not in calls


@pytest.mark.parametrize("interleaved, batch_tables, rot", [(False, False, 16), (False, True, 8), (True, False, 16),
                                                             (True, True, 16)])
def test_fused_rotary_equals_the_reference_path(interleaved, batch_tables, rot):
    angles = RNG.uniform(0, 6.3, ((B,) if batch_tables else ()) + (S, rot)).astype(np.float32)
    cos, sin = Tensor(np.cos(angles)), Tensor(np.sin(angles))  # the page's range: [-1, 1]
    # the kernel takes interleaved tables shared by the batch only: per-sample ones stay on the reference path
    expect = [] if interleaved and batch_tables else ["rotary_position_embedding"]
    _both_paths(lambda x: kernels.apply_rotary(x, cos, sin, interleaved), [_t(B, S, H, D)], expect)


def test_fused_norms_and_swiglu_equal_the_reference_path():
    weight = _t(D)
    _both_paths(lambda x: kernels.rms_norm(x, weight, 1e-6), [_t(B, S, D)], ["rms_norm"])
    _both_paths(lambda g, u: kernels.swiglu(g, u), [_t(B, S, D), _t(B, S, D)], ["swiglu"])
    _both_paths(lambda gu: kernels.swiglu(gu), [_t(B, S, 2 * D)], ["swiglu"])
    _both_paths(lambda x: kernels.layer_norm(x, weight, weight, 1e-5), [_t(B, S, D)], [])


def test_a_failed_group_creation_names_the_ranks_and_backend():
    """new_group returns "" on failure (its page); the backend raises instead of caching the name."""
    from mm_parallel.comm.native import NativeBackend
    from mm_parallel.testing import hccl
    from mm_parallel.topology import Group

    class Calls:
        @staticmethod
        def new_group(ranks, backend=None):
            return ""

    with pytest.raises(RuntimeError, match=r"hccl communication group of ranks \[0, 1\] failed"):
        NativeBackend(Calls).group_name(Group((0, 1), 0, "tp"))
    assert hccl.P2POp(hccl.isend, Tensor([1.0]), 1).op == "isend"
    with pytest.raises(NotImplementedError, match="tag"):
        hccl.P2POp("irecv", Tensor([1.0]), 1, tag=3)


def test_host_transfers_are_counted_by_site():
    """The counter the no-host-round-trip work is measured with: reads (asnumpy, item, float) and
    uploads (tensors built from host values), each at the line that made it."""
    from mm_parallel.testing.host_transfers import host_transfers

    x = Tensor(np.ones(3, np.float32))
    with host_transfers() as seen:
        y = Tensor(np.zeros(3, np.float32)) + x  # one upload
        y.asnumpy()
        float(y.sum())
        with ascend_stand_ins():  # the stand-ins' own host work is the device's: not counted
            kernels.rms_norm(_t(2, 8), _t(8), 1e-6)
    assert (seen.reads, seen.uploads) == (2, 3), seen.sites()  # _t made two tensors inside the block
    assert any(site.startswith("test_ascend_path.py:") and site.endswith("asnumpy") for site in seen.sites())


@pytest.mark.parametrize("causal, head_dim, padded, bf16", [(False, 16, False, False), (True, 16, False, False),
                                                            (True, 72, True, False), (False, 80, True, False),
                                                            (True, 72, True, True)])
def test_the_ring_block_from_the_kernel_equals_the_reference_with_its_lse(causal, head_dim, padded, bf16):
    """Ring attention's block (mm_parallel.ops.flash_blocks): out and lse from FlashAttentionScore,
    the backward from FlashAttentionScoreGrad with the lse's gradient in a spare head column; a
    loss on both equals the reference path's, gradients included (fp32: 1e-5; with bf16 operands
    into the kernel, as on Ascend: within bf16's rounding, 2e-2)."""
    from mm_parallel.ops.attention import attention
    from mm_parallel.ops.flash_blocks import flash_block

    valid = np.ones((B, S), bool)
    if padded:
        valid[:, S - 2:] = False  # keys past the sequence's end (padded to split evenly)
    lse_weights = Tensor(RNG.standard_normal((B, H, S)).astype(np.float32))
    out_weights = Tensor(RNG.standard_normal((B, S, H, head_dim)).astype(np.float32))

    def loss_of(block):
        def loss(q, k, v):
            out, lse = block(q, k, v)
            return (out.astype(ms.float32) * out_weights).sum() + (lse * lse_weights).sum()
        return loss

    inputs = [_t(B, S, H, head_dim), _t(B, S, KV, head_dim), _t(B, S, KV, head_dim)]
    want = ms.value_and_grad(loss_of(lambda q, k, v: attention(
        q, k, v, causal=causal, key_padding_mask=valid if padded else None, return_lse=True)), (0, 1, 2))(*inputs)
    with ascend_stand_ins(float32=not bf16) as calls:
        got = ms.value_and_grad(loss_of(lambda q, k, v: flash_block(
            q, k, v, head_dim ** -0.5, causal, valid if padded else None, ms.bfloat16 if bf16 else ms.float32)),
            (0, 1, 2))(*inputs)
    assert {"FlashAttentionScore", "FlashAttentionScoreGrad"} <= set(calls), calls
    for a, b in zip([got[0]] + list(got[1]), [want[0]] + list(want[1])):
        if bf16:
            assert np.abs(a.asnumpy() - b.asnumpy()).max() <= 2e-2 * np.abs(b.asnumpy()).max()
        else:
            np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-5)


def _allowed_pairs(case, batch, length):
    """(batch, 1, length, length) bool of the pairs a case allows (every query keeps a key)."""
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    allowed = np.ones((batch, 1, length, length), bool)
    if "causal" in case:
        allowed &= j <= i
    if "padding" in case:
        allowed &= _KEEP[:batch, None, None, :].astype(bool)
        allowed[:, :, np.arange(length), np.arange(length)] = True  # left padding under causal: a key each
    if "packed" in case:
        ids = np.repeat([0, 1, 2], [2, 3, 1])
        allowed &= ids[:, None] == ids[None, :]
    return allowed


@pytest.mark.parametrize("case", ["causal", "padding", "packed", "packed_causal", "head_72"])
def test_bf16_fused_attention_is_as_close_to_fp32_as_torch_bf16_is(case):
    """The stand-ins without the float32 widening take bf16 operands, as the kernel does; the bf16
    output and gradients are no further from the fp32 result than torch's own bf16 attention is
    from its fp32 one (factor 2), on the same bf16-exact inputs."""
    import torch

    from mm_parallel.ops.low_precision import round_to_bf16, set_compute_dtype

    head_dim = 72 if case == "head_72" else D
    batch = 1 if "packed" in case else B
    allowed = _allowed_pairs(case, batch, S)
    kwargs = {"causal": "causal" in case}
    if "padding" in case:
        kwargs["key_padding_mask"] = Tensor(allowed.any(-2)[:, 0].astype(np.int32))
    if "packed" in case:
        kwargs["segment_ids"] = Tensor(np.repeat([0, 1, 2], [2, 3, 1])[None].astype(np.int32))
    inputs = [round_to_bf16(_t(batch, S, n, head_dim)) for n in (H, KV, KV)]
    weights = Tensor(RNG.standard_normal((batch, S, H, head_dim)).astype(np.float32))

    def ours(*xs):
        return (kernels.attention(*xs, **kwargs) * weights).sum()

    def run_ours():
        value, grads = ms.value_and_grad(ours, (0, 1, 2))(*inputs)
        return [kernels.attention(*inputs, **kwargs).asnumpy()] + [g.asnumpy() for g in grads]

    truth = run_ours()
    set_compute_dtype(ms.bfloat16)
    try:
        with ascend_stand_ins(float32=False) as calls:
            got = run_ours()
    finally:
        set_compute_dtype(ms.float32)
    assert "flash_attention_score" in calls

    def run_torch(dtype):
        q, k, v = (torch.tensor(x.asnumpy().transpose(0, 2, 1, 3), dtype=dtype, requires_grad=True) for x in inputs)
        mask = torch.tensor(allowed)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1), attn_mask=mask)
        out = out.transpose(1, 2)
        (out.float() * torch.tensor(weights.asnumpy())).sum().backward()
        return [t.detach().float().numpy() for t in (out, q.grad.transpose(1, 2), k.grad.transpose(1, 2),
                                                     v.grad.transpose(1, 2))]

    torch_truth, torch_bf16 = run_torch(torch.float32), run_torch(torch.bfloat16)
    for name, a, b, ta, tb in zip(("out", "dq", "dk", "dv"), got, truth, torch_bf16, torch_truth):
        ours_err = np.abs(a - b).max() / np.abs(b).max()
        torch_err = np.abs(ta - tb).max() / np.abs(tb).max()
        assert ours_err <= 2 * torch_err, (name, ours_err, torch_err)


def test_the_device_kind_chooses_the_kernels_and_the_backend(monkeypatch):
    """On a device MindSpore reports as Ascend: the fused kernels (unless MM_KERNELS=reference
    was set at start-up) and the native HCCL backend (unless MM_COMM_BACKEND says otherwise)."""
    from mm_parallel import comm
    from mm_parallel.comm.cpu import CpuBackend
    from mm_parallel.comm.native import NativeBackend
    from mm_parallel.ops import device

    real = ms.get_context
    monkeypatch.setattr(ms, "get_context", lambda key: "Ascend" if key == "device_target" else real(key))
    monkeypatch.setattr(comm, "_BACKEND", None)
    assert device.use_fused() and isinstance(comm.get_backend(), NativeBackend)
    monkeypatch.setattr(device, "_FORCE_REFERENCE", True)
    monkeypatch.setattr(comm, "_BACKEND", None)
    monkeypatch.setenv("MM_COMM_BACKEND", "cpu")
    assert not device.use_fused() and isinstance(comm.get_backend(), CpuBackend)
    monkeypatch.setattr(ms, "get_context", real)
    monkeypatch.setattr(device, "_FORCE_REFERENCE", False)
    monkeypatch.delenv("MM_COMM_BACKEND")
    monkeypatch.setattr(comm, "_BACKEND", None)
    assert not device.use_fused() and isinstance(comm.get_backend(), CpuBackend)  # this CPU
