"""What MindSpore 2.7.2 lets a flash_attention_score call be: every restriction its page states.

The page (https://www.mindspore.cn/docs/en/r2.7.2/api_python/ops/mindspore.ops.flash_attention_score.html;
the docstring of the installed 2.7.2, ``mindspore/ops/operations/manually_defined/ops_def.py``, is
the same text, and the FlashAttentionScore primitive's docstring repeats it) lists the shapes, the
modes and, for the packed TND layout, a list of conditions. `check_call` refuses a call that breaks
any of them with the error type the page names and the line of the page it breaks, quoted, so a
test can say which line it enforces and a user reading the error can find it.

The stand-ins (mm_parallel.testing.flash_attention) run these checks before computing anything:
a call an NPU would refuse fails here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import mindspore as ms
import numpy as np
from mindspore import Tensor

INT_MAX = 2147483647
LAYOUTS = ("BSH", "BNSD", "SBH", "BSND", "TND")
COMPRESSED = 2048  # the optimised causal mask sparse modes 2, 3 and 4 take

# The lines of the page each check enforces (quoted in the error). " ... " marks wording that differs
# between the tested releases' pages where the rule does not (2.7.2 "ranges is", "equals to",
# "trianglar"; 2.9.0 on "ranges are", "equals", "triangular"; docs/versions.md).
B_RANGE = "B: Batch size. Value range 1 to 2k."
S1_RANGE = "S1: Sequence length of `query`. Value range 1 to 512k."
S2_RANGE = "S2: Sequence length of `key` and `value`. Value range 1 to 512k."
N1_RANGE = "N1: Num heads of `query`. Value range 1 to 256."
N2_FACTOR = "N2: Num heads of `key` and `value`, and N2 must be a factor of N1."
D_RULE = "D: Head size. The value ranges ... a multiple of 16, with the max value of 512."
H1_RULE = "H1: Hidden size of `query`, which equals ... N1 * D."
QUERY_DTYPE = "The supported dtype is float16 and bfloat16."
SAME_DTYPE = "TypeError: `query`, `key` and `value` don't have the same dtype."
VALUE_SHAPE = "value (Tensor): The value tensor with the same dtype and shape as `key`."
D_SAME = "RuntimeError: D-axis of `query`, `key` and `value` is not the same."
HEAD_NUM = "head_num (int): The head num of `query`, equal to N1."
HEAD_NUM_POSITIVE = "RuntimeError: `head_num` is not greater than 0."
LAYOUT_VALUE = "ValueError: `input_layout` is a string but not valid."
LAYOUT_TYPE = "TypeError: `input_layout` is not a string."
SPARSE_TYPE = "TypeError: `sparse_mode` is not an int."
SPARSE_VALUE = "RuntimeError: The specified value of `sparse_mode` is invalid."
SPARSE_5 = "5: Represents the prefix scenario"  # mm never uses it; the stand-in does not model prefix
DOUBLE = "TypeError: `scalar_value` or `keep_prob` is not a double number."
MASK_DTYPE = "TypeError: Dtype of `attn_mask` is not bool or uint8."
MASK_COMPRESSED = "In compression scenario, `sparse_mode` is 2, 3, or 4, `attn_mask` must be (2048, 2048)."
MASK_FULL = "When `sparse_mode` is 0 and 1, `attn_mask` should be (B, N1, S1, S2), (B, 1, S1, S2), (S1, S2)."
MASK_ALL = "1: Represents allMask, that is, passing in the complete `attn_mask` matrix."
BAND = "It must ensure that the band is not empty."
KEEP_RANGE = "keep_prob (double, optional): The keep probability of dropout. Value range is (0.0, 1.0]."
KEEP_ONE = "When `keep_prob` is 1.0, `drop_mask` should be None."
DROP_SHAPE = ("drop_mask (Tensor, optional): The dropout mask tensor of uint8. Input tensor of shape "
              "(B, N1, S1, S2 // 8)")
DROP_S2 = "`S2` is a multiple of 8 when not None."
PADDING_MASK = "padding_mask (Tensor, optional): Reserved parameter. Not implemented yet."
SHIFT_DTYPE = "TypeError: Dtype of `real_shift` has a different dtype as `query`."
SHIFT_SHAPE = "Non-ALiBi scenario: `real_shift` is (B, N1, S1, S2), (1, N1, S1, S2)."
TND_GIVEN = ("When `input_layout` is \"TND\", `actual_seq_qlen` and `actual_seq_kvlen` must be not none. "
             "Otherwise, they are none.")
TND_BATCH = "The lengths of two lists must be the same, and size of list is batch. batch is less than or equal to 1024."
TND_CUMULATIVE = ("The `actual_seq_qlen` and `actual_seq_kvlen` are the cumulative sum of sequence of key/value, so "
                  "they must be non-decreasing.")
TND_LAST = "array with increasing values and the last value equal to T1."
TND_MASK = ("`attn_mask` must be a lower ... matrix, so `sparse_mode` should be 2 or 3. The shape of "
            "`attn_mask` should be (2048, 2048).")
TND_TOKENS = "`next_tokens` is 0, and `pre_tokens` is not less than max_seqlen_q."
TND_MODE_3 = "When `sparse_mode` is 3, S1 of each batch should be less than or equal to S2."
TND_ZERO_KEYS = "0 should not exist in list_seq_k."
TND_SHIFT = "If `real_shift` is not none, list_seq_q and list_seq_k must be same."


def refuse(error, line: str, detail: str, kernel: str = "flash_attention_score"):
    """Raise ``error`` for a call that breaks ``line`` of ``kernel``'s page (every stand-in's form)."""
    raise error(f"{detail} -- {kernel} (MindSpore 2.7.2) documents: \"{line}\"")


def require(ok: bool, error, line: str, detail: str, kernel: str = "flash_attention_score") -> None:
    if not ok:
        refuse(error, line, detail, kernel)


@dataclass
class Shapes:
    """The dims the page names, read from a call's query and key."""

    batch: int
    heads: int  # N1
    kv_heads: int  # N2
    q_len: int  # S1 (TND: max_seqlen_q)
    k_len: int  # S2 (TND: max_seqlen_k)
    head_dim: int  # D
    q_lens: Optional[List[int]] = None  # TND: list_seq_q
    k_lens: Optional[List[int]] = None  # TND: list_seq_k


def host_ints(values) -> List[int]:
    """A Tensor / tuple / list of ints as a Python list (reads a Tensor on the host: stand-in only)."""
    if isinstance(values, Tensor):
        values = values.asnumpy()
    return [int(v) for v in np.asarray(values).reshape(-1)]


def _dims(query, key, value, head_num, layout) -> Shapes:
    """(B, N1, N2, S1, S2, D) from the layout, checking H1 = N1 * D and value's shape."""
    require(tuple(value.shape) == tuple(key.shape), RuntimeError, VALUE_SHAPE,
            f"value {tuple(value.shape)} and key {tuple(key.shape)} differ")
    rank = {"BSH": 3, "SBH": 3, "BNSD": 4, "BSND": 4, "TND": 3}[layout]
    require(query.ndim == rank and key.ndim == rank, RuntimeError, HEAD_NUM,
            f"layout {layout} takes {rank}-D query and key, got {tuple(query.shape)}, {tuple(key.shape)}")
    if layout in ("BSH", "SBH"):
        require(query.shape[-1] % head_num == 0, RuntimeError, H1_RULE,
                f"H1 {query.shape[-1]} is not head_num {head_num} times a head size")
        d = query.shape[-1] // head_num
        require(key.shape[-1] % d == 0, RuntimeError, D_SAME, f"H2 {key.shape[-1]} is not a multiple of D {d}")
        b, s1, s2 = (query.shape[0], query.shape[1], key.shape[1]) if layout == "BSH" else \
            (query.shape[1], query.shape[0], key.shape[0])
        return Shapes(b, head_num, key.shape[-1] // d, s1, s2, d)
    require(query.shape[-1] == key.shape[-1], RuntimeError, D_SAME,
            f"query D {query.shape[-1]} and key D {key.shape[-1]} differ")
    if layout == "TND":
        return Shapes(1, query.shape[1], key.shape[1], query.shape[0], key.shape[0], query.shape[-1])
    if layout == "BNSD":
        return Shapes(query.shape[0], query.shape[1], key.shape[1], query.shape[2], key.shape[2], query.shape[3])
    return Shapes(query.shape[0], query.shape[2], key.shape[2], query.shape[1], key.shape[1], query.shape[3])


def _check_dtypes(query, key, value, attn_mask, real_shift, allowed) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        require(isinstance(t, Tensor), TypeError, QUERY_DTYPE, f"{name} is a {type(t).__name__}, not a Tensor")
    require(query.dtype in allowed, TypeError, QUERY_DTYPE, f"query has dtype {query.dtype}")
    require(key.dtype == query.dtype and value.dtype == query.dtype, TypeError, SAME_DTYPE,
            f"query {query.dtype}, key {key.dtype}, value {value.dtype}")
    if attn_mask is not None:
        require(isinstance(attn_mask, Tensor) and attn_mask.dtype in (ms.bool_, ms.uint8), TypeError, MASK_DTYPE,
                f"attn_mask is {getattr(attn_mask, 'dtype', type(attn_mask).__name__)}")
    if real_shift is not None:
        require(isinstance(real_shift, Tensor) and real_shift.dtype == query.dtype, TypeError, SHIFT_DTYPE,
                f"real_shift is {getattr(real_shift, 'dtype', type(real_shift).__name__)}, query {query.dtype}")


def _check_ranges(dims: Shapes) -> None:
    require(1 <= dims.batch <= 2048, RuntimeError, B_RANGE, f"B is {dims.batch}")
    require(1 <= dims.q_len <= 512 * 1024, RuntimeError, S1_RANGE, f"S1 is {dims.q_len}")
    require(1 <= dims.k_len <= 512 * 1024, RuntimeError, S2_RANGE, f"S2 is {dims.k_len}")
    require(1 <= dims.heads <= 256, RuntimeError, N1_RANGE, f"N1 is {dims.heads}")
    require(dims.kv_heads >= 1 and dims.heads % dims.kv_heads == 0, RuntimeError, N2_FACTOR,
            f"N2 {dims.kv_heads} does not divide N1 {dims.heads}")
    require(dims.head_dim % 16 == 0 and 16 <= dims.head_dim <= 512, RuntimeError, D_RULE, f"D is {dims.head_dim}")


def _check_band(sparse_mode, pre_tokens, next_tokens, s1, s2) -> None:
    """The three (pre_tokens, next_tokens) pairs the page forbids where they take effect (modes 0, 4)."""
    if sparse_mode not in (0, 4):
        return
    pre, nxt = pre_tokens, next_tokens
    forbidden = ((pre < 0 and nxt < 0)
                 or (pre < 0 <= nxt and (nxt < abs(pre) or abs(pre) >= s2))
                 or (nxt < 0 <= pre and (abs(nxt) > pre or abs(nxt) >= s1)))
    require(not forbidden, RuntimeError, BAND, f"pre_tokens {pre}, next_tokens {nxt} (S1 {s1}, S2 {s2})")


def check_compressed_mask(attn_mask, sparse_mode) -> None:
    require(attn_mask is not None and tuple(attn_mask.shape) == (COMPRESSED, COMPRESSED), RuntimeError,
            MASK_COMPRESSED, f"sparse_mode {sparse_mode} with attn_mask "
            f"{None if attn_mask is None else tuple(attn_mask.shape)}")
    upper = np.triu(np.ones((COMPRESSED, COMPRESSED), bool), 1)
    require(np.array_equal(attn_mask.asnumpy().astype(bool), upper), RuntimeError, MASK_COMPRESSED,
            "the (2048, 2048) attn_mask is not the lower triangle (1 = discard above the diagonal) the "
            "compression scenario uses")


def _check_mask(attn_mask, sparse_mode, dims: Shapes) -> None:
    if sparse_mode in (2, 3, 4):
        check_compressed_mask(attn_mask, sparse_mode)
        return
    if attn_mask is None:
        require(sparse_mode != 1, RuntimeError, MASK_ALL, "sparse_mode 1 without attn_mask")
        return
    b, n, s1, s2 = dims.batch, dims.heads, dims.q_len, dims.k_len
    require(tuple(attn_mask.shape) in ((b, n, s1, s2), (b, 1, s1, s2), (s1, s2)), RuntimeError, MASK_FULL,
            f"attn_mask {tuple(attn_mask.shape)} with (B, N1, S1, S2) = {(b, n, s1, s2)}")


def _check_dropout(drop_mask, keep_prob, dims: Shapes, layout) -> None:
    require(0.0 < keep_prob <= 1.0, RuntimeError, KEEP_RANGE, f"keep_prob is {keep_prob}")
    if keep_prob == 1.0:
        require(drop_mask is None, RuntimeError, KEEP_ONE, "keep_prob 1.0 with a drop_mask")
        return
    if drop_mask is None:
        return
    require(layout != "TND", NotImplementedError, DROP_SHAPE, "this stand-in takes no dropout in TND")
    require(dims.k_len % 8 == 0, RuntimeError, DROP_S2, f"S2 is {dims.k_len}")
    want = (dims.batch, dims.heads, dims.q_len, dims.k_len // 8)
    require(isinstance(drop_mask, Tensor) and drop_mask.dtype == ms.uint8 and tuple(drop_mask.shape) == want,
            RuntimeError, DROP_SHAPE, f"drop_mask {getattr(drop_mask, 'shape', None)} for {want}")


def _check_packed(actual_seq_qlen, actual_seq_kvlen, attn_mask, sparse_mode, pre_tokens, next_tokens, real_shift,
                  prefix, query, key, dims: Shapes) -> Shapes:
    """Every TND condition of the page; returns the dims with the per-sequence lengths."""
    require(actual_seq_qlen is not None and actual_seq_kvlen is not None, RuntimeError, TND_GIVEN,
            "TND without actual_seq_qlen / actual_seq_kvlen")
    q_ends, k_ends = host_ints(actual_seq_qlen), host_ints(actual_seq_kvlen)
    require(len(q_ends) == len(k_ends) and 1 <= len(q_ends) <= 1024, RuntimeError, TND_BATCH,
            f"{len(q_ends)} query and {len(k_ends)} key lengths")
    q_lens, k_lens = np.diff([0] + q_ends), np.diff([0] + k_ends)
    require(bool(np.all(q_lens >= 0) and np.all(k_lens >= 0)), RuntimeError, TND_CUMULATIVE,
            f"actual_seq_qlen {q_ends}, actual_seq_kvlen {k_ends}")
    require(q_ends[-1] == query.shape[0] and k_ends[-1] == key.shape[0], RuntimeError, TND_LAST,
            f"last lengths ({q_ends[-1]}, {k_ends[-1]}) for T1, T2 = ({query.shape[0]}, {key.shape[0]})")
    require(not np.any(k_lens == 0), RuntimeError, TND_ZERO_KEYS, f"key lengths {k_lens.tolist()}")
    require(prefix is None, RuntimeError, "`prefix` is none.", "TND with a prefix")
    require(sparse_mode in (2, 3), RuntimeError, TND_MASK, f"TND with sparse_mode {sparse_mode}")
    check_compressed_mask(attn_mask, sparse_mode)
    require(next_tokens == 0 and pre_tokens >= int(q_lens.max()), RuntimeError, TND_TOKENS,
            f"next_tokens {next_tokens}, pre_tokens {pre_tokens}, max_seqlen_q {int(q_lens.max())}")
    require(sparse_mode != 3 or bool(np.all(q_lens <= k_lens)), RuntimeError, TND_MODE_3,
            f"query lengths {q_lens.tolist()}, key lengths {k_lens.tolist()}")
    require(real_shift is None, NotImplementedError, TND_SHIFT, "this stand-in takes no real_shift in TND")
    dims.q_lens, dims.k_lens = q_lens.tolist(), k_lens.tolist()
    dims.batch, dims.q_len, dims.k_len = len(q_ends), int(q_lens.max()), int(k_lens.max())
    return dims


def check_call(query, key, value, head_num, real_shift, drop_mask, padding_mask, attn_mask, prefix,
               actual_seq_qlen, actual_seq_kvlen, keep_prob, scalar_value, pre_tokens, next_tokens, input_layout,
               sparse_mode, dtypes) -> Shapes:
    """Refuse the call if the page forbids it (``dtypes``: the query dtypes taken); its dims."""
    _check_dtypes(query, key, value, attn_mask, real_shift, dtypes)
    require(isinstance(scalar_value, float) and isinstance(keep_prob, float), TypeError, DOUBLE,
            f"scalar_value {scalar_value!r}, keep_prob {keep_prob!r}")
    require(isinstance(input_layout, str), TypeError, LAYOUT_TYPE, f"input_layout is {input_layout!r}")
    require(input_layout in LAYOUTS, ValueError, LAYOUT_VALUE, f"input_layout {input_layout!r}")
    require(isinstance(sparse_mode, int), TypeError, SPARSE_TYPE, f"sparse_mode is {sparse_mode!r}")
    require(sparse_mode in (0, 1, 2, 3, 4, 5), RuntimeError, SPARSE_VALUE, f"sparse_mode {sparse_mode}")
    require(sparse_mode != 5 and prefix is None, NotImplementedError, SPARSE_5, "this stand-in has no prefix mode")
    require(padding_mask is None, RuntimeError, PADDING_MASK, "a padding_mask was passed")
    require(isinstance(head_num, int) and head_num > 0, RuntimeError, HEAD_NUM_POSITIVE, f"head_num {head_num!r}")
    dims = _dims(query, key, value, head_num, input_layout)
    require(dims.heads == head_num, RuntimeError, HEAD_NUM, f"head_num {head_num}, query has {dims.heads} heads")
    if input_layout == "TND":
        dims = _check_packed(actual_seq_qlen, actual_seq_kvlen, attn_mask, sparse_mode, pre_tokens, next_tokens,
                             real_shift, prefix, query, key, dims)
    else:
        require(actual_seq_qlen is None and actual_seq_kvlen is None, RuntimeError, TND_GIVEN,
                f"actual_seq_qlen / actual_seq_kvlen with input_layout {input_layout}")
        _check_mask(attn_mask, sparse_mode, dims)
        _check_band(sparse_mode, pre_tokens, next_tokens, dims.q_len, dims.k_len)
        if real_shift is not None:
            require(tuple(real_shift.shape) in ((dims.batch, dims.heads, dims.q_len, dims.k_len),
                                                (1, dims.heads, dims.q_len, dims.k_len)),
                    RuntimeError, SHIFT_SHAPE, f"real_shift {tuple(real_shift.shape)}")
    _check_ranges(dims)
    _check_dropout(drop_mask, keep_prob, dims, input_layout)
    return dims
