"""The Ascend stand-ins refuse what MindSpore 2.7.2's pages forbid, one case per restriction.

Each case breaks one documented restriction of one kernel and names the line of the page it
breaks, word for word; the stand-in must refuse it with the error type the page names, quoting
that line. A separate test finds every quoted line in the installed MindSpore 2.7.2 docstrings
(the text of the API pages), so a quote cannot drift from the documentation. Results the pages
leave undefined come back NaN (a query with no retained key).
"""

import inspect
import re

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor
from mindspore.ops.auto_generate import gen_ops_prim
from mindspore.ops.operations.manually_defined import ops_def

from mm_parallel.testing import ascend_kernels as ak
from mm_parallel.testing import flash_attention_contract as contract
from mm_parallel.testing.flash_attention import FlashAttentionScore, FlashAttentionScoreGrad

RNG = np.random.default_rng(0)
TRIANGLE = Tensor(np.triu(np.ones((2048, 2048), np.uint8), 1))


def _t(*shape, dtype=ms.float16):
    return Tensor(RNG.standard_normal(shape).astype(np.float32), dtype)


def _fa(q=(1, 4, 2, 16), k=None, layout="BSND", **kwargs):
    """flash_attention_score on random tensors; only what ``kwargs`` changes breaks the page."""
    k = q if k is None else k
    dtype = kwargs.pop("dtype", ms.float16)
    args = dict(head_num=q[2] if layout == "BSND" else q[1] if layout in ("BNSD", "TND") else kwargs.pop("heads", 1),
                input_layout=layout, scalar_value=0.25)
    args.update(kwargs)
    return ak.flash_attention_score(_t(*q, dtype=dtype), _t(*k, dtype=dtype), _t(*k, dtype=dtype), **args)


def _tnd(lens_q=(2, 3), lens_k=None, **kwargs):
    lens_k = lens_q if lens_k is None else lens_k
    args = dict(actual_seq_qlen=np.cumsum(lens_q).tolist(), actual_seq_kvlen=np.cumsum(lens_k).tolist(),
                attn_mask=TRIANGLE, sparse_mode=3, next_tokens=0, pre_tokens=contract.INT_MAX)
    args.update(kwargs)
    return _fa(q=(sum(lens_q), 2, 16), k=(sum(lens_k), 2, 16), layout="TND", **args)


FLASH = [  # (id, call, error, the line of the flash_attention_score page it enforces)
    ("dtype", lambda: _fa(dtype=ms.float32), TypeError, "The supported dtype is float16 and bfloat16."),
    ("same_dtype", lambda: ak.flash_attention_score(_t(1, 4, 2, 16), _t(1, 4, 2, 16, dtype=ms.bfloat16),
                                                     _t(1, 4, 2, 16), 2, input_layout="BSND"), TypeError,
     "TypeError: `query`, `key` and `value` don't have the same dtype."),
    ("value_shape", lambda: ak.flash_attention_score(_t(1, 4, 2, 16), _t(1, 4, 2, 16), _t(1, 5, 2, 16), 2,
                                                      input_layout="BSND"), RuntimeError,
     "value (Tensor): The value tensor with the same dtype and shape as `key`."),
    ("batch", lambda: _fa(q=(2049, 1, 1, 16)), RuntimeError, "B: Batch size. Value range 1 to 2k."),
    ("s1", lambda: _fa(q=(1, 0, 1, 16), k=(1, 4, 1, 16)), RuntimeError,
     "S1: Sequence length of `query`. Value range 1 to 512k."),
    ("s2", lambda: _fa(q=(1, 4, 1, 16), k=(1, 0, 1, 16)), RuntimeError,
     "S2: Sequence length of `key` and `value`. Value range 1 to 512k."),
    ("n1", lambda: _fa(q=(1, 1, 257, 16), k=(1, 1, 1, 16)), RuntimeError,
     "N1: Num heads of `query`. Value range 1 to 256."),
    ("n2", lambda: _fa(q=(1, 2, 4, 16), k=(1, 2, 3, 16)), RuntimeError,
     "N2: Num heads of `key` and `value`, and N2 must be a factor of N1."),
    ("d_multiple_of_16", lambda: _fa(q=(1, 4, 2, 72)), RuntimeError,
     "D: Head size. The value ranges ... a multiple of 16, with the max value of 512."),
    ("d_at_most_512", lambda: _fa(q=(1, 2, 1, 528)), RuntimeError,
     "D: Head size. The value ranges ... a multiple of 16, with the max value of 512."),
    ("d_same", lambda: _fa(q=(1, 4, 2, 16), k=(1, 4, 2, 32)), RuntimeError,
     "RuntimeError: D-axis of `query`, `key` and `value` is not the same."),
    ("h1", lambda: _fa(q=(1, 4, 40), layout="BSH", heads=3), RuntimeError,
     "H1: Hidden size of `query`, which equals ... N1 * D."),
    ("head_num", lambda: _fa(head_num=3), RuntimeError, "head_num (int): The head num of `query`, equal to N1."),
    ("head_num_positive", lambda: _fa(head_num=0), RuntimeError, "RuntimeError: `head_num` is not greater than 0."),
    ("layout_value", lambda: _fa(input_layout="BHS"), ValueError,
     "ValueError: `input_layout` is a string but not valid."),
    ("layout_type", lambda: _fa(input_layout=4), TypeError, "TypeError: `input_layout` is not a string."),
    ("sparse_type", lambda: _fa(sparse_mode=3.0), TypeError, "TypeError: `sparse_mode` is not an int."),
    ("sparse_value", lambda: _fa(sparse_mode=9), RuntimeError,
     "RuntimeError: The specified value of `sparse_mode` is invalid."),
    ("double", lambda: _fa(scalar_value=1), TypeError,
     "TypeError: `scalar_value` or `keep_prob` is not a double number."),
    ("mask_dtype", lambda: _fa(attn_mask=Tensor(np.zeros((4, 4), np.float32))), TypeError,
     "TypeError: Dtype of `attn_mask` is not bool or uint8."),
    ("mask_compressed", lambda: _fa(sparse_mode=3, attn_mask=Tensor(np.ones((4, 4), bool))), RuntimeError,
     "In compression scenario, `sparse_mode` is 2, 3, or 4, `attn_mask` must be (2048, 2048)."),
    ("mask_full", lambda: _fa(attn_mask=Tensor(np.zeros((1, 1, 1, 4), bool))), RuntimeError,
     "When `sparse_mode` is 0 and 1, `attn_mask` should be (B, N1, S1, S2), (B, 1, S1, S2), (S1, S2)."),
    ("mask_all", lambda: _fa(sparse_mode=1), RuntimeError,
     "1: Represents allMask, that is, passing in the complete `attn_mask` matrix."),
    ("band", lambda: _fa(sparse_mode=4, attn_mask=TRIANGLE, pre_tokens=-1, next_tokens=-1), RuntimeError,
     "It must ensure that the band is not empty."),
    ("keep_range", lambda: _fa(keep_prob=0.0), RuntimeError,
     "keep_prob (double, optional): The keep probability of dropout. Value range is (0.0, 1.0]."),
    ("keep_one", lambda: _fa(drop_mask=Tensor(np.zeros((1, 2, 4, 1), np.uint8))), RuntimeError,
     "When `keep_prob` is 1.0, `drop_mask` should be None."),
    ("drop_s2", lambda: _fa(q=(1, 4, 2, 16), keep_prob=0.5, drop_mask=Tensor(np.zeros((1, 2, 4, 1), np.uint8))),
     RuntimeError, "`S2` is a multiple of 8 when not None."),
    ("padding_mask", lambda: _fa(padding_mask=Tensor(np.zeros(1, np.uint8))), RuntimeError,
     "padding_mask (Tensor, optional): Reserved parameter. Not implemented yet."),
    ("shift_dtype", lambda: _fa(real_shift=_t(1, 2, 4, 4, dtype=ms.float32)), TypeError,
     "TypeError: Dtype of `real_shift` has a different dtype as `query`."),
    ("shift_shape", lambda: _fa(real_shift=_t(1, 2, 4, 3)), RuntimeError,
     "Non-ALiBi scenario: `real_shift` is (B, N1, S1, S2), (1, N1, S1, S2)."),
    ("tnd_given", lambda: _tnd(actual_seq_kvlen=None), RuntimeError,
     "When `input_layout` is \"TND\", `actual_seq_qlen` and `actual_seq_kvlen` must be not none. "
     "Otherwise, they are none."),
    ("tnd_lengths_elsewhere", lambda: _fa(actual_seq_qlen=[4], actual_seq_kvlen=[4]), RuntimeError,
     "When `input_layout` is \"TND\", `actual_seq_qlen` and `actual_seq_kvlen` must be not none. "
     "Otherwise, they are none."),
    ("tnd_batch", lambda: _tnd(lens_q=(1,) * 1025), RuntimeError,
     "The lengths of two lists must be the same, and size of list is batch. batch is less than or equal to 1024."),
    ("tnd_same_count", lambda: _tnd(lens_q=(2, 3), lens_k=(5,)), RuntimeError,
     "The lengths of two lists must be the same, and size of list is batch. batch is less than or equal to 1024."),
    ("tnd_cumulative", lambda: _tnd(actual_seq_qlen=[3, 2, 5], actual_seq_kvlen=[3, 3, 5]), RuntimeError,
     "The `actual_seq_qlen` and `actual_seq_kvlen` are the cumulative sum of sequence of key/value, so they must "
     "be non-decreasing."),
    ("tnd_last", lambda: _tnd(actual_seq_qlen=[2, 4], actual_seq_kvlen=[2, 4]), RuntimeError,
     "array with increasing values and the last value equal to T1."),
    ("tnd_not_causal", lambda: _tnd(attn_mask=None, sparse_mode=0, next_tokens=contract.INT_MAX), RuntimeError,
     "`attn_mask` must be a lower ... matrix, so `sparse_mode` should be 2 or 3. The shape of `attn_mask` "
     "should be (2048, 2048)."),
    ("tnd_next_tokens", lambda: _tnd(next_tokens=contract.INT_MAX), RuntimeError,
     "`next_tokens` is 0, and `pre_tokens` is not less than max_seqlen_q."),
    ("tnd_pre_tokens", lambda: _tnd(pre_tokens=2), RuntimeError,
     "`next_tokens` is 0, and `pre_tokens` is not less than max_seqlen_q."),
    ("tnd_mode_3", lambda: _tnd(lens_q=(3, 2), lens_k=(2, 3)), RuntimeError,
     "When `sparse_mode` is 3, S1 of each batch should be less than or equal to S2."),
    ("tnd_zero_keys", lambda: _tnd(lens_q=(0, 5), lens_k=(0, 5)), RuntimeError, "0 should not exist in list_seq_k."),
]

OTHERS = [  # (id, call, error, the line of the kernel's own page)
    ("rms_x", lambda: ak.rms_norm(_t(2, 4, dtype=ms.int32), _t(4, dtype=ms.int32)), TypeError,
     "x (Tensor): Input data of RmsNorm. Support data type: float16, float32, bfloat16."),
    ("rms_same", lambda: ak.rms_norm(_t(2, 4, dtype=ms.float32), _t(4)), TypeError,
     "TypeError: If data type of `x` is not the same ... the data type of `gamma`."),
    ("rms_eps", lambda: ak.rms_norm(_t(2, 4), _t(4), 0.0), ValueError,
     "ValueError: If `epsilon` is not a float between 0 and 1."),
    ("rms_rank", lambda: ak.rms_norm(_t(4), _t(2, 4)), ValueError,
     "ValueError: If the rank of `gamma` is la ... ger than the rank of `x`."),
    ("rope_4d", lambda: ak.rotary_position_embedding(_t(4, 2, 8), _t(1, 4, 1, 8), _t(1, 4, 1, 8)), ValueError,
     "x (Tensor): 4D tensor, with float16, bfloat16 or float32 data type."),
    ("rope_table_dtype", lambda: ak.rotary_position_embedding(_t(1, 4, 2, 8), _t(1, 4, 1, 8, dtype=ms.float32),
                                                              _t(1, 4, 1, 8, dtype=ms.float32)), TypeError,
     "cos (Tensor): 4D constant, has the same type as `x` , in range of [-1, 1]."),
    ("rope_table_range", lambda: ak.rotary_position_embedding(_t(1, 4, 2, 8), Tensor(np.full((1, 4, 1, 8), 1.5),
                                                                                      ms.float16), _t(1, 4, 1, 8)),
     ValueError, "cos (Tensor): 4D constant, has the same type as `x` , in range of [-1, 1]."),
    ("rope_interleaved_layout", lambda: ak.rotary_position_embedding(_t(2, 4, 1, 8), _t(2, 4, 1, 8),
                                                                     _t(2, 4, 1, 8), 1), ValueError,
     "Support ... layout for different values of `x`"),
    ("rope_mode", lambda: ak.rotary_position_embedding(_t(1, 4, 2, 8), _t(1, 4, 1, 8), _t(1, 4, 1, 8), 2), TypeError,
     "TypeError: If `mode` is not an int."),
    ("rope_d", lambda: ak.rotary_position_embedding(_t(1, 4, 2, 7), _t(1, 4, 1, 7), _t(1, 4, 1, 7)), ValueError,
     "D < 896 and D is ... Even. B, N < 1000;"),
    ("rope_heads", lambda: ak.rotary_position_embedding(_t(1, 2, 1000, 8), _t(1, 2, 1, 8), _t(1, 2, 1, 8)),
     ValueError, "D < 896 and D is ... Even. B, N < 1000;"),
    ("rope_bnsd", lambda: ak.rotary_position_embedding(_t(4, 8, 2, 16), _t(1, 1, 2, 16), _t(1, 1, 2, 16)),
     ValueError, "When the layout is BNSD, B * N > 8S and D is 32-byte ... alignment, the performance is poor. "
                 "Therefore, this interface cannot be called."),
    ("swiglu_dtype", lambda: ak.swiglu(_t(2, 4, dtype=ms.int32)), TypeError,
     "TypeError: If dtype of `input` is not float16, float32 or bfloat16."),
    ("swiglu_even", lambda: ak.swiglu(_t(2, 3)), RuntimeError,
     "RuntimeError: If the dimension specified by `dim` is not divisible by 2."),
    ("gmm_modes", lambda: ak.grouped_matmul([_t(4, 8)], [_t(8, 3)], split_item=1), TypeError,
     "split_item (int): Splitting input mode. Only support 0 and 3."),
    ("gmm_pair", lambda: ak.grouped_matmul([_t(4, 8)], [_t(2, 8, 3)], group_list=Tensor([2, 4], ms.int64),
                                           split_item=3, group_type=-1), TypeError,
     "TypeError: when `split_item` is 3, `group_type` is not 0."),
    ("gmm_list", lambda: ak.grouped_matmul([_t(4, 8)], [_t(2, 8, 3)], split_item=3, group_type=0), TypeError,
     "TypeError: when `split_item` is 3, `group_list` is None."),
    ("gmm_split_0_float32", lambda: ak.grouped_matmul([_t(4, 8, dtype=ms.float32)], [_t(8, 3, dtype=ms.float32)]),
     TypeError, "Parameter limitations 2 Non-quant tyep table"),
    ("gmm_split_0_ranks", lambda: ak.grouped_matmul([_t(4, 8)], [_t(2, 8, 3)]), TypeError,
     "0 -1 None The length of x is n, tensor in x must be 2D-6D. The length of weight is n, tensor in weight "
     "must be 2D."),
    ("gmm_bfloat16", lambda: ak.grouped_matmul([_t(4, 8, dtype=ms.bfloat16)], [_t(2, 8, 3, dtype=ms.bfloat16)],
                                               group_list=Tensor([2, 4], ms.int64), split_item=3, group_type=0),
     TypeError, "Parameter limitations 3 Only in split_item=3, group_type=0"),
    ("gmm_groups", lambda: ak.grouped_matmul([_t(4, 8)], [_t(2, 8, 3)], group_list=Tensor([2, 4, 4], ms.int64),
                                             split_item=3, group_type=0), ValueError,
     "3 0 1D Tensor The length of x is 1, tensor in x must be 2D. The length of weight is 1, tensor in weight "
     "must be 3D. (group_list.shape)[0] must be equal to (weight.shape)[0]"),
    ("gmm_group_dtype", lambda: ak.grouped_matmul([_t(4, 8)], [_t(2, 8, 3)], group_list=Tensor([2, 4], ms.int32),
                                                  split_item=3, group_type=0), TypeError,
     "group_list (Tensor, optional): Grouping positions for the M-axis of input x. Supported dtypes: Int64"),
]


@pytest.mark.parametrize("call, error, line", [case[1:] for case in FLASH + OTHERS],
                         ids=[case[0] for case in FLASH + OTHERS])
def test_each_documented_restriction_is_refused_quoting_its_line(call, error, line):
    with pytest.raises(error) as raised:
        call()
    assert f'"{line}"' in str(raised.value), str(raised.value)


def _flat(text: str) -> str:
    """A docstring as plain words: no :math: roles, backticks, backslashes or line breaks."""
    return re.sub(r"\s+", " ", text.replace(":math:", "").replace("`", "").replace("\\", ""))


def _on_page(line: str, page: str) -> bool:
    """The quoted line on the page, its " ... " pieces in order (wording the releases differ in)."""
    at = 0
    for piece in _flat(line).split(" ... "):
        at = page.find(piece, at)
        if at < 0:
            return False
        at += len(piece)
    return True


def test_every_quoted_line_is_on_the_pages_of_the_installed_mindspore():
    from mindspore import ops
    from mindspore.ops import auto_generate

    # the lines were quoted from 2.7.2's pages; the compat environment checks the newest tested release keeps them
    pages = {"flash": _flat(inspect.getdoc(ops_def.flash_attention_score) + gen_ops_prim.FlashAttentionScore.__doc__),
             "others": _flat("".join(inspect.getdoc(f) for f in (ops.rms_norm, ops.rotary_position_embedding,
                                                                 ops.swiglu, auto_generate.grouped_matmul)))}
    for name, _, _, line in FLASH:
        assert _on_page(line, pages["flash"]), name
    for name, _, _, line in OTHERS:
        assert _on_page(line, pages["others"]), name
    assert not _on_page("D: Head size. The value ranges ... a multiple of 32", pages["flash"])


def test_a_query_with_no_retained_key_is_nan_and_poisons_the_gradients():
    """The page defines no softmax for a row with every pair discarded: NaN, forward and backward."""
    keep = np.ones((1, 1, 4, 4), bool)
    keep[..., 1, :] = False  # query 1 retains no key
    q, k, v = (_t(1, 4, 1, 16) for _ in range(3))

    def out(q, k, v):
        return ak.flash_attention_score(q, k, v, 1, attn_mask=Tensor(~keep), input_layout="BSND", scalar_value=0.25)

    rows = np.isnan(out(q, k, v).astype(ms.float32).asnumpy()).all(-1)[0, :, 0]
    assert rows.tolist() == [False, True, False, False]
    grads = ms.grad(lambda *xs: out(*xs).astype(ms.float32)[:, 0].sum(), (0, 1, 2))(q, k, v)
    assert all(np.isnan(g.astype(ms.float32).asnumpy()).all() for g in grads)
    # the causal mode with S1 > S2: the first S1 - S2 queries see no key
    causal = ak.flash_attention_score(_t(1, 6, 1, 16), _t(1, 4, 1, 16), _t(1, 4, 1, 16), 1, attn_mask=TRIANGLE,
                                      sparse_mode=3, input_layout="BSND", scalar_value=0.25)
    assert np.isnan(causal.astype(ms.float32).asnumpy()).all(-1)[0, :, 0].tolist() == [True, True] + [False] * 4


def test_the_primitive_statistics_and_its_backward_agree_with_autodiff():
    """FlashAttentionScore's (softmax_max, softmax_sum) give the log-sum-exp of the scaled scores,
    and FlashAttentionScoreGrad from them equals the gradient of flash_attention_score."""
    q, k, v = _t(2, 5, 4, 16), _t(2, 7, 2, 16), _t(2, 7, 2, 16)
    args = dict(scale_value=0.3, input_layout="BSND", sparse_mode=3)
    row_max, row_sum, _, out = FlashAttentionScore(4, **args)(q, k, v, attn_mask=TRIANGLE)
    lse = row_max.asnumpy()[..., 0] + np.log(row_sum.asnumpy()[..., 0])
    s = np.einsum("bqnd,bknd->bnqk", q.astype(ms.float32).asnumpy(),
                  np.repeat(k.astype(ms.float32).asnumpy(), 2, 2)) * 0.3
    s = np.where(np.arange(7)[None, :] > np.arange(5)[:, None] + 2, -np.inf, s)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-5)
    dy = _t(2, 5, 4, 16)
    want = ms.grad(lambda *xs: (ak.flash_attention_score(*xs, 4, attn_mask=TRIANGLE, scalar_value=0.3,
                                                           input_layout="BSND", sparse_mode=3)
                                .astype(ms.float32) * dy.astype(ms.float32)).sum(), (0, 1, 2))(q, k, v)
    got = FlashAttentionScoreGrad(4, **args)(q, k, v, dy, atten_mask=TRIANGLE, softmax_max=row_max,
                                             softmax_sum=row_sum, attention_in=out)
    for a, b in zip(got[:3], want):
        np.testing.assert_allclose(a.astype(ms.float32).asnumpy(), b.astype(ms.float32).asnumpy(), atol=2e-2)
