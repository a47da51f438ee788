"""The kernel layer's CPU path against float64 numpy references: outputs, and gradients against
central finite differences of the same numpy reference."""

import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mm_parallel import ops as K

RNG = np.random.default_rng(0)


def rand(*shape):
    return RNG.standard_normal(shape)


def numeric_grad(f, arrays, index, cotangent, eps=1e-5):
    """d sum(f(*arrays) * cotangent) / d arrays[index], central differences in float64."""
    x = arrays[index]
    grad = np.zeros_like(x)
    for pos in np.ndindex(x.shape):
        orig = x[pos]
        x[pos] = orig + eps
        up = np.sum(f(*arrays) * cotangent)
        x[pos] = orig - eps
        down = np.sum(f(*arrays) * cotangent)
        x[pos] = orig
        grad[pos] = (up - down) / (2 * eps)
    return grad


def ms_grads(f, arrays, cotangent):
    tensors = [Tensor(a.astype(np.float32)) for a in arrays]
    c = Tensor(cotangent.astype(np.float32))
    grads = ms.grad(lambda *t: (f(*t) * c).sum(), grad_position=tuple(range(len(tensors))))(*tensors)
    return [g.asnumpy() for g in (grads if isinstance(grads, tuple) else (grads,))]


def check(ms_fn, np_fn, arrays, rtol=1e-4, atol=1e-5, grad_atol=1e-4):
    out = ms_fn(*[Tensor(a.astype(np.float32)) for a in arrays]).asnumpy()
    want = np_fn(*arrays)
    np.testing.assert_allclose(out, want, rtol=rtol, atol=atol)
    c = rand(*want.shape)
    for i, g in enumerate(ms_grads(ms_fn, arrays, c)):
        np.testing.assert_allclose(g, numeric_grad(np_fn, arrays, i, c), rtol=1e-3, atol=grad_atol, err_msg=f"grad {i}")


# ---- numpy references ----

def np_attention(q, k, v, allowed=None, scale=None):
    b, sq, h, d = q.shape
    groups = h // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * (d ** -0.5 if scale is None else scale)
    if allowed is None:
        allowed = np.ones(s.shape, bool)
    allowed = np.broadcast_to(allowed, s.shape)
    s = np.where(allowed, s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m) * allowed
    tot = e.sum(-1, keepdims=True)
    p = np.divide(e, tot, out=np.zeros_like(e), where=tot > 0)
    out = np.einsum("bhqk,bkhd->bqhd", p, v)
    lse = np.where(tot[..., 0] > 0, (m + np.log(np.maximum(tot, 1e-300)))[..., 0], -1e30)
    return out, lse


def causal_allowed(sq, sk):
    return (np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq))[None, None]


# ---- attention ----

@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_attention_full_and_gqa(heads, kv_heads):
    q, k, v = rand(2, 5, heads, 8), rand(2, 6, kv_heads, 8), rand(2, 6, kv_heads, 8)
    check(lambda a, b, c: K.attention(a, b, c), lambda a, b, c: np_attention(a, b, c)[0], [q, k, v])


@pytest.mark.parametrize("sq,sk", [(5, 5), (3, 7)])
def test_attention_causal_bottom_right(sq, sk):
    q, k, v = rand(1, sq, 2, 4), rand(1, sk, 2, 4), rand(1, sk, 2, 4)
    check(lambda a, b, c: K.attention(a, b, c, causal=True),
          lambda a, b, c: np_attention(a, b, c, causal_allowed(sq, sk))[0], [q, k, v])


def test_attention_key_padding_and_causal():
    q, k, v = rand(2, 6, 2, 4), rand(2, 6, 2, 4), rand(2, 6, 2, 4)
    pad = np.array([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])  # left padding in sample 1
    allowed = causal_allowed(6, 6) & pad[:, None, None, :].astype(bool)
    check(lambda a, b, c: K.attention(a, b, c, causal=True, key_padding_mask=Tensor(pad)),
          lambda a, b, c: np_attention(a, b, c, allowed)[0], [q, k, v])


def test_attention_segments_equal_cu_seqlens():
    q, k, v = rand(1, 7, 2, 4), rand(1, 7, 2, 4), rand(1, 7, 2, 4)
    seg = np.array([[0, 0, 0, 1, 1, 2, 2]])
    allowed = (seg[:, None, :, None] == seg[:, None, None, :]) & causal_allowed(7, 7)
    ref = lambda a, b, c: np_attention(a, b, c, allowed)[0]
    check(lambda a, b, c: K.attention(a, b, c, causal=True, segment_ids=Tensor(seg)), ref, [q, k, v])
    by_bounds = K.attention(*[Tensor(x.astype(np.float32)) for x in (q, k, v)], causal=True, cu_seqlens=[0, 3, 5, 7])
    np.testing.assert_allclose(by_bounds.asnumpy(), ref(q, k, v), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_segments_run_as_padded_blocks(causal):
    """Contiguous segments of a packed batch of one (windows, audio chunks) run as a batch of
    segments padded to the longest: the same values and gradients as the masked N x N scores."""
    from mm_parallel.ops.attention import segment_blocks

    seg = np.repeat([3, 0, 7, 1], [5, 8, 3, 8])[None]  # ids need not be ordered, only contiguous
    groups, scatter = segment_blocks(seg)  # runs of 8 together; 5 and 3 (under 8 / sqrt 2) each alone
    assert [g.shape for g, _ in groups] == [(2, 8), (1, 5), (1, 3)]
    long_tail = np.repeat([1, 2, 3, 4], [40, 6, 5, 30])[None]  # a packed row of long-tailed samples
    groups, scatter = segment_blocks(long_tail)
    assert [g.shape for g, _ in groups] == [(2, 40), (2, 6)]  # 40 + 30 padded together, 6 + 5
    (_, valid), (gather, _) = groups
    assert valid.sum() == 70 and gather[1, 5] == 81  # padding -> the zero row
    flat = np.concatenate([g.reshape(-1) for g, _ in groups])
    assert (flat[scatter] == np.arange(81)).all()
    assert segment_blocks(np.array([[0, 0, 1, 1, 0, 0]])) is None  # segment 0 in two pieces: masked path
    assert segment_blocks(np.repeat([0, 1], [20, 4])[None]) is None  # 2 x 20^2 x 2 > 24^2: no saving
    q, k, v = rand(1, 24, 4, 4), rand(1, 24, 2, 4), rand(1, 24, 2, 4)
    allowed = seg[:, None, :, None] == seg[:, None, None, :]
    if causal:
        allowed = allowed & causal_allowed(24, 24)
    check(lambda a, b, c: K.attention(a, b, c, causal=causal, segment_ids=Tensor(seg)),
          lambda a, b, c: np_attention(a, b, c, allowed)[0], [q, k, v])


def test_attention_lse_and_fully_masked_rows():
    q, k, v = rand(1, 4, 2, 4), rand(1, 4, 2, 4), rand(1, 4, 2, 4)
    pad = np.array([[0, 0, 1, 1]])
    allowed = causal_allowed(4, 4) & pad[:, None, None, :].astype(bool)  # queries 0, 1 see no key
    out, lse = K.attention(*[Tensor(x.astype(np.float32)) for x in (q, k, v)], causal=True,
                           key_padding_mask=Tensor(pad), return_lse=True)
    want_out, want_lse = np_attention(q, k, v, allowed)
    np.testing.assert_allclose(out.asnumpy(), want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(out.asnumpy()[:, :2], 0)
    np.testing.assert_allclose(lse.asnumpy()[..., 2:], want_lse[..., 2:], rtol=1e-5)
    assert np.all(lse.asnumpy()[..., :2] <= -1e29) and np.all(np.isfinite(lse.asnumpy()))
    grads = ms_grads(lambda a, b, c: K.attention(a, b, c, causal=True, key_padding_mask=Tensor(pad)), [q, k, v],
                     rand(1, 4, 2, 4))
    assert all(np.all(np.isfinite(g)) for g in grads)


def test_attention_lse_gradient():
    q, k, v = rand(1, 3, 2, 4), rand(1, 5, 2, 4), rand(1, 5, 2, 4)
    check(lambda a, b, c: K.attention(a, b, c, return_lse=True)[1],
          lambda a, b, c: np_attention(a, b, c)[1], [q, k, v])


def test_attention_bad_shapes_say_what_to_change():
    q, k = Tensor(np.zeros((1, 2, 3, 4), np.float32)), Tensor(np.zeros((1, 2, 2, 4), np.float32))
    with pytest.raises(ValueError, match="dividing"):
        K.attention(q, k, k)
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        K.attention(k, k, k, cu_seqlens=[0, 3])


# ---- norms, rotary, activations ----

def np_layer_norm(x, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)


def test_layer_norm():
    x, w, b = rand(2, 3, 8), rand(8), rand(8)
    check(lambda x, w, b: K.layer_norm(x, w, b, 1e-5), lambda x, w, b: np_layer_norm(x, 1e-5) * w + b, [x, w, b])


def test_layer_norm_without_affine_and_its_written_backward():
    """The standardisation's backward is written out (ops.norms._Standardize): checked against
    numeric gradients, also with a large eps, where a backward that dropped eps would differ."""
    x = rand(4, 16) * 3.0
    for eps in (1e-6, 0.5):
        check(lambda x: K.layer_norm(x, None, None, eps), lambda x: np_layer_norm(x, eps), [x])


def test_rms_norm():
    x, w = rand(2, 3, 8), rand(8)
    check(lambda x, w: K.rms_norm(x, w, 1e-6),
          lambda x, w: x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6) * w, [x, w])


def rotary_tables(seq, rot, batch=None):
    inv = 1.0 / (10000 ** (np.arange(0, rot, 2) / rot))
    ang = np.arange(seq)[:, None] * inv[None, :]
    if batch:
        ang = ang[None] * (1 + np.arange(batch))[:, None, None]
    return ang


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [8, 4])
def test_rotary(interleaved, rot):
    x = rand(2, 5, 3, 8)
    ang = rotary_tables(5, rot, batch=2)
    full = np.repeat(ang, 2, -1) if interleaved else np.concatenate([ang, ang], -1)
    cos, sin = np.cos(full), np.sin(full)

    def ref(x):
        part = x[..., :rot]
        if interleaved:
            rotated = np.stack([-part[..., 1::2], part[..., 0::2]], -1).reshape(part.shape)
        else:
            rotated = np.concatenate([-part[..., rot // 2:], part[..., : rot // 2]], -1)
        out = part * cos[:, :, None] + rotated * sin[:, :, None]
        return np.concatenate([out, x[..., rot:]], -1)

    c, s = Tensor(cos.astype(np.float32)), Tensor(sin.astype(np.float32))
    check(lambda x: K.apply_rotary(x, c, s, interleaved=interleaved), ref, [x])


def test_rotary_is_a_rotation_of_each_pair():
    x = rand(1, 4, 1, 2)
    ang = rotary_tables(4, 2)
    angles = np.concatenate([ang, ang], -1)
    out = K.apply_rotary(Tensor(x.astype(np.float32)), Tensor(np.cos(angles).astype(np.float32)),
                         Tensor(np.sin(angles).astype(np.float32))).asnumpy()
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_gelu_exact_and_tanh():
    x = rand(3, 7)
    erf = np.vectorize(math.erf)
    check(lambda t: K.gelu(t), lambda t: 0.5 * t * (1 + erf(t / np.sqrt(2))), [x])
    check(lambda t: K.gelu(t, "tanh"),
          lambda t: 0.5 * t * (1 + np.tanh(np.sqrt(2 / np.pi) * (t + 0.044715 * t ** 3))), [x])


def test_silu_and_swiglu():
    x, y = rand(3, 6), rand(3, 6)
    sig = lambda t: 1 / (1 + np.exp(-t))
    check(K.silu, lambda t: t * sig(t), [x])
    check(lambda g, u: K.swiglu(g, u), lambda g, u: g * sig(g) * u, [x, y])
    check(lambda t: K.swiglu(t), lambda t: t[:, :3] * sig(t[:, :3]) * t[:, 3:], [x])
