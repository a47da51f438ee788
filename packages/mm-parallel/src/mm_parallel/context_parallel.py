"""Context parallel attention: the sequence is split over the cp group, attention still sees all of it.

One entry, `attention(q, k, v, causal=...)`, with q, k, v as (batch, local_seq, heads, head_dim),
runs the configured algorithm over cp = ulysses x ring ranks:

  Ulysses  all-to-all inside the Ulysses group trades the sequence split for a head split, plain
           attention runs on the full (ring-local) sequence with heads / u heads, and the inverse
           all-to-all restores the layout. Needs heads % u == 0.
  Ring     key/value blocks travel round the ring group (r - 1 shifts); each rank attends its
           queries to every block and merges the partial results by their log-sum-exp:
               lse = logaddexp(lse_a, lse_b),  out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse)
           With causal masking the sequence is cut zigzag into 2r chunks, ring rank i holding chunks
           i and 2r-1-i, so every rank does the same work; chunk pairs are full, causal (same
           chunk) or skipped (a later key chunk).
  Hybrid   Ulysses inside the ring: the all-to-all first, then the ring over the ring group.

`split_sequence` / `gather_sequence` cut a full sequence (inputs, positions, labels) into this
rank's part in that layout and restore it: zigzag over the ring ranks, then contiguous over the
Ulysses ranks. A sequence padded at its end to split evenly passes ``key_length``: every
block's keys at or past it are masked (their positions follow from the layout, no exchange).
The backward of the ring pass is automatic differentiation through the shifts
(`mappings.ring_shift`), which keeps every received block until the backward.
"""

from __future__ import annotations

from typing import List, Optional

import mindspore as ms
import numpy as np
from mindspore import ops

from mm_parallel import comm, mappings
from mm_parallel.ops import attention as local_attention
from mm_parallel.ops.attention import kernel_dtype, takes_kernel
from mm_parallel.ops.device import host_array, use_fused
from mm_parallel.ops.flash_blocks import flash_block
from mm_parallel.topology import Topology, get_topology


def _chunk_ids(ring_rank: int, ring_size: int) -> List[int]:
    """Zigzag: ring rank i holds chunks i and 2r-1-i of the 2r equal chunks."""
    return [ring_rank, 2 * ring_size - 1 - ring_rank]


def split_sequence(x, dim: int = 1, topology: Optional[Topology] = None):
    """This rank's part of the full sequence ``x`` along ``dim`` in the context-parallel layout."""
    topo = get_topology(topology)
    r, u = topo.cp_ring.size, topo.cp_ulysses.size
    if topo.cp.size == 1:
        return x
    dim %= x.ndim
    if x.shape[dim] % (2 * r * u):
        raise ValueError(
            f"sequence length {x.shape[dim]} must be a multiple of 2 x ring x ulysses = {2 * r * u} for "
            "context parallel; pad the sequence"
        )
    chunk = x.shape[dim] // (2 * r)
    ring_part = ops.concat([x.narrow(dim, c * chunk, chunk) for c in _chunk_ids(topo.cp_ring.rank, r)], dim)
    piece = ring_part.shape[dim] // u
    return ring_part.narrow(dim, topo.cp_ulysses.rank * piece, piece)


def gather_sequence(x, dim: int = 1, topology: Optional[Topology] = None):
    """The full sequence from every rank's part (inverse of `split_sequence`; not differentiable)."""
    topo = get_topology(topology)
    r = topo.cp_ring.size
    if topo.cp.size == 1:
        return x
    dim %= x.ndim
    ring_part = comm.all_gather(x, topo.cp_ulysses, dim)
    parts = comm.all_gather(ring_part, topo.cp_ring, dim)  # ring rank order: [c_i, c_{2r-1-i}] each
    chunk = ring_part.shape[dim] // 2
    ordered = [None] * (2 * r)
    for i in range(r):
        for j, c in enumerate(_chunk_ids(i, r)):
            ordered[c] = parts.narrow(dim, (2 * i + j) * chunk, chunk)
    return ops.concat(ordered, dim)


def _valid_keys(batch: int, chunk: int, chunks: List[int], key_length: Optional[int]):
    """(batch, keys) mask of the keys made of ``chunks`` (each ``chunk`` rows long) that sit before
    ``key_length`` in the whole sequence; None when every one does."""
    if key_length is None or (max(chunks) + 1) * chunk <= key_length:
        return None
    positions = np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunks])
    return np.broadcast_to(positions < key_length, (batch, positions.shape[0]))


def attention(q, k, v, *, causal: bool = False, scale: Optional[float] = None, key_padding_mask=None,
              key_length: Optional[int] = None, segment_ids=None, topology: Optional[Topology] = None):
    """Attention over the whole sequence of q, k, v split along dim 1 in the `split_sequence` layout.

    ``key_padding_mask`` (batch, k_len), 0 for padding, is taken without context parallelism only:
    with cp > 1 pack the samples instead of padding them. ``key_length``: the keys at positions
    >= key_length of the whole sequence are padding (a sequence padded to split evenly) and are
    attended by no query, under every layout (each block's positions follow from the layout).
    ``segment_ids`` (batch, whole length), the whole sequence's on every rank (host data): packed
    samples; a query attends only keys of its own segment. Ulysses attends the whole
    sequence after its all-to-all, so it takes them as they are; each ring block takes the ids of
    its query and key chunks (a query with no key of its segment in a block gets lse = -1e30 there,
    a zero weight in the merge: it always meets itself in its own chunk's block).
    """
    topo = get_topology(topology)
    if topo.cp.size == 1:
        valid = _valid_keys(k.shape[0], k.shape[1], [0], key_length)
        if valid is not None:
            key_padding_mask = valid if key_padding_mask is None else valid & host_array(key_padding_mask, bool)
        return local_attention(q, k, v, causal=causal, scale=scale, key_padding_mask=key_padding_mask,
                               segment_ids=segment_ids)
    segments = None if segment_ids is None else host_array(segment_ids)
    if segments is not None and segments.shape[1] != q.shape[1] * topo.cp.size:
        raise ValueError(f"segment_ids must cover the whole sequence ({q.shape[1] * topo.cp.size} positions) on every "
                         f"context-parallel rank, got {segments.shape[1]}")
    if key_padding_mask is not None:
        raise ValueError("context parallel attention takes no padding mask: pack the samples into full sequences "
                         "(or pass key_length for a padded end) when cp > 1")
    u_group, ring_group = topo.cp_ulysses, topo.cp_ring
    heads, kv_heads = q.shape[2], k.shape[2]
    if u_group.size > 1:
        if heads % u_group.size:
            raise ValueError(
                f"Ulysses context parallel splits heads over {u_group.size} ranks: {heads} heads is not a "
                f"multiple; choose ulysses_degree dividing the head count or use cp_algo='ring'"
            )
        if kv_heads % u_group.size:  # too few kv heads to split: give every query head its own copy
            k, v = (ops.repeat_interleave(t, heads // kv_heads, 2) for t in (k, v))
        q, k, v = (mappings.all_to_all(t, u_group, 2, 1) for t in (q, k, v))
    if ring_group.size > 1:
        out = _ring_attention(q, k, v, causal, scale, ring_group, key_length, segments)
    else:  # the whole sequence, in order, after the all-to-all
        out = local_attention(q, k, v, causal=causal, scale=scale, segment_ids=segments,
                              key_padding_mask=_valid_keys(k.shape[0], k.shape[1], [0], key_length))
    if u_group.size > 1:
        out = mappings.all_to_all(out, u_group, 1, 2)
    return out


def _merge(out, lse, block_out, block_lse):
    """Combine two partial attentions over disjoint key sets by their log-sum-exp (float32)."""
    if out is None:
        return block_out.astype(ms.float32), block_lse
    top = ops.maximum(lse, block_lse)
    new_lse = top + ops.log(ops.exp(lse - top) + ops.exp(block_lse - top))
    scale_old = ops.exp(lse - new_lse).transpose(0, 2, 1)[..., None]  # (b, h, s) -> (b, s, h, 1)
    scale_new = ops.exp(block_lse - new_lse).transpose(0, 2, 1)[..., None]
    return out * scale_old + block_out.astype(ms.float32) * scale_new, new_lse


def _block(q, k, v, causal: bool, scale: float, valid, q_segments=None, k_segments=None):
    """(out, lse) of q over one passing key block, or None for a block of padding alone or one
    whose queries and keys share no segment (it would add nothing: its weight in the merge is 0;
    every query still meets chunk 0, whose keys are real, and itself). On the device path the
    fused kernel's block (mm_parallel.ops.flash_blocks: its softmax statistics give the lse)
    where it takes no segments, elsewhere the reference."""
    if valid is not None and not np.asarray(valid).any():
        return None
    if q_segments is not None and not np.isin(q_segments, k_segments).any():
        return None
    if use_fused() and takes_kernel(q) and q_segments is None:
        return flash_block(q, k, v, scale, causal, valid, kernel_dtype(q))
    return local_attention(q, k, v, causal=causal, scale=scale, key_padding_mask=valid, return_lse=True,
                           segment_ids=q_segments, kv_segment_ids=k_segments)


def _chunk_segments(segments, chunk: int, c: int):
    """The segment ids of global chunk ``c`` (``chunk`` positions), or None without segments."""
    return None if segments is None else segments[:, c * chunk:(c + 1) * chunk]


def _ring_attention(q, k, v, causal, scale, group, key_length=None, segments=None):
    r, me = group.size, group.rank
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kv = ops.concat([k, v], -1)  # one shift moves both
    head_dim, half, batch = k.shape[-1], k.shape[1] // 2, k.shape[0]
    mine = _chunk_ids(me, r)
    if not causal:
        q_segments = None if segments is None else np.concatenate([_chunk_segments(segments, half, c)
                                                                    for c in mine], 1)
        out = lse = None
        for step in range(r):
            if step:
                kv = mappings.ring_shift(kv, group, 1)
            chunks = _chunk_ids((me - step) % r, r)
            valid = _valid_keys(batch, half, chunks, key_length)
            k_segments = None if segments is None else np.concatenate([_chunk_segments(segments, half, c)
                                                                        for c in chunks], 1)
            block = _block(q, kv[..., :head_dim], kv[..., head_dim:], False, scale, valid, q_segments, k_segments)
            used = block is not None
            if used:
                out, lse = _merge(out, lse, *block)
        return _depending_on(out, kv, used).astype(q.dtype)

    q_chunks = [(c, q[:, i * half:(i + 1) * half]) for i, c in enumerate(mine)]
    results = [[None, None] for _ in q_chunks]
    for step in range(r):
        if step:
            kv = mappings.ring_shift(kv, group, 1)
        source, used = (me - step) % r, False
        for j, kc in enumerate(_chunk_ids(source, r)):
            block = kv[:, j * half:(j + 1) * half]
            for i, (qc, q_part) in enumerate(q_chunks):
                if kc > qc:
                    continue  # every key of a later chunk is in the future
                part = _block(q_part, block[..., :head_dim], block[..., head_dim:], kc == qc, scale,
                              _valid_keys(batch, half, [kc], key_length), _chunk_segments(segments, half, qc),
                              _chunk_segments(segments, half, kc))
                if part is not None:
                    used = True
                    results[i] = list(_merge(results[i][0], results[i][1], *part))
    return _depending_on(ops.concat([o for o, _ in results], 1), kv, used).astype(q.dtype)


def _depending_on(out, kv, used: bool):
    """``out``, made to depend on the last shifted ``kv`` when no block used it (with a weight of
    0): every rank then runs the backward of every shift, as the ring's partners expect — a rank
    whose last blocks were all skipped (padding, other segments) would otherwise leave its
    partner waiting in the backward's exchange."""
    return out if used else out + 0.0 * kv.sum().astype(out.dtype)
