"""Autoregressive decoding with a key/value cache under the training layout (rollouts, samples, `generate`).

A batch of left-padded prompts (``attention_mask`` zeros then ones; the media in the prompt's
keywords, encoded once) is run once (the prefill), each row's logits at its last token choose
its first new token (`mm_parallel.sampling`), and every later token is one step of one token
per row against the cache:

    step t:  ids (rows, 1) = the tokens chosen at t - 1
             attention_mask  (rows, s + t): the prompt's, then ones (transformers appends ones)
             position_ids    (..., rows, 1) = the previous step's + 1 on every axis
                             (transformers' _update_model_kwargs_for_generation; M-RoPE too)

A row stops at a stop token; afterwards it is fed ``pad_id`` (its tokens are not read) until
every row has stopped or ``max_new_tokens`` were made. ``copies`` > 1 (G completions per
prompt) runs the prefill once per prompt and repeats its cache and logits G times.

Under the layout. Each virtual pipeline stage keeps the cache of its own layers (`KVCache`, by
layer number): a step crosses the stages as a forward-only micro-batch
(`mm_parallel.pipeline.forward_only`), the last stage gathers the logits over the vocabulary
(tp), chooses the tokens and broadcasts them over pp. One-token steps cannot be cut along the
sequence, so under context or sequence parallelism decoding runs with the sequence whole
(`whole_sequences`): the weights are the same there (cp replicates them, sp shares tp's), only
where activations are split changes. Ranks whose forward passes talk to each other across
data-parallel rows (expert parallelism, ZeRO-3's weight gathers) stop together: the number of
running rows is summed over the world every step.

The model contract (the VL models implement it): ``prompt_positions(ids, inputs)`` the prompt's
positions on the host, ``pipeline_stage(x, batch)`` honouring ``past_key_values`` (this stage's
`KVCache`) and ``logits_to_keep`` (1: the head runs on the last position only), ``is_last``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import mindspore as ms
import numpy as np
from mindspore import ops

from mm_parallel import comm, pipeline, stage_io
from mm_parallel.ops.device import host_array
from mm_parallel.sampling import Sampling, row_uniforms
from mm_parallel.topology import Group, Topology, get_topology

# Cell attributes that split activations along the sequence (tensor_parallel's flag, MoELayer's
# token layout, its router's): turned off while the sequence is whole.
SEQUENCE_SPLIT_FLAGS = ("sequence_parallel", "gather_tokens", "tokens_split_over_tp")
CP_GROUPS = ("cp", "cp_ulysses", "cp_ring")


class KVCache:
    """Keys and values of the tokens seen so far, by layer number, each (batch, seq, kv_heads, head_dim)."""

    def __init__(self):
        self.keys: Dict[int, ms.Tensor] = {}
        self.values: Dict[int, ms.Tensor] = {}

    def length(self) -> int:
        return next(iter(self.keys.values())).shape[1] if self.keys else 0

    def update(self, layer: int, k, v):
        """The layer's keys and values with (k, v) appended along the sequence."""
        if layer in self.keys:
            k, v = ops.concat([self.keys[layer], k], 1), ops.concat([self.values[layer], v], 1)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def repeat_rows(self, copies: int) -> None:
        """Each row ``copies`` times in a row (rows r, r, ..., r + 1, ...): G completions of one prompt."""
        for store in (self.keys, self.values):
            for layer, x in store.items():
                store[layer] = ops.repeat_interleave(x, copies, 0)


@dataclass
class Completions:
    """New tokens per row (rows = prompts x copies, prompt-major), ``pad_id`` after a row's stop."""

    tokens: np.ndarray  # (rows, steps) int64
    lengths: np.ndarray  # (rows,) tokens up to and including the stop token (steps when none)
    stopped: np.ndarray  # (rows,) bool: ended on a stop token


def end_tokens(config) -> List[int]:
    """The ids a model's turn ends at: its config's ``eos_token_id`` (a text config's first, as the
    VL models keep it), one id or several; none when unset."""
    eos = getattr(getattr(config, "text_config", None), "eos_token_id", None) or getattr(config, "eos_token_id", None)
    return [] if eos is None else np.atleast_1d(eos).astype(int).tolist()


def left_padded(mask: np.ndarray) -> bool:
    """Rows of zeros then ones, ending on a real token."""
    mask = np.asarray(mask).astype(bool)
    return bool(mask[:, -1].all() and np.all(mask[:, :-1] <= mask[:, 1:]))


def decode(chunks: Sequence, prompt: Dict, max_new_tokens: int, sampling: Sampling = Sampling(),
           stop_tokens: Sequence[int] = (), pad_id: int = 0, copies: int = 1, seed: int = 0,
           keys: Optional[Sequence[Sequence[int]]] = None, topology: Optional[Topology] = None,
           suppress_tokens: Sequence[int] = ()) -> Completions:
    """Completions of the prompts in ``prompt`` (forward keywords, a left-padded batch) by this
    rank's model ``chunks`` (its virtual stages, in order); the same on every rank of a pipeline
    and tensor-parallel group. ``keys``: each row's sampling stream (prompt-major, rows =
    prompts x copies; default (prompt, copy)); ``suppress_tokens``: never chosen (their logits
    -inf, transformers' suppress_tokens). See the module docstring."""
    topo = get_topology(topology)
    ids = host_array(prompt["input_ids"], np.int64)
    mask = host_array(prompt.get("attention_mask"))
    mask = np.ones_like(ids) if mask is None else mask.astype(np.int64)
    if not left_padded(mask):
        raise ValueError("decoding takes left-padded prompts (attention_mask zeros then ones in every row): pad "
                         "prompts on the left")
    rows = ids.shape[0] * copies
    keys = [(p, c) for p in range(ids.shape[0]) for c in range(copies)] if keys is None else keys
    if len(keys) != rows:
        raise ValueError(f"{len(keys)} sampling keys for {rows} rows ({ids.shape[0]} prompts x {copies} copies)")
    uniforms = row_uniforms(seed, keys, max_new_tokens) if sampling.do_sample else np.zeros((rows, max_new_tokens))
    positions = chunks[0].prompt_positions(ids, {**prompt, "attention_mask": mask})
    caches = [KVCache() for _ in chunks]
    stops = np.asarray(sorted(set(int(t) for t in stop_tokens)), np.int64)
    tokens, done, plan = [], np.zeros(rows, bool), stage_io.TransferPlan()
    with whole_sequences(chunks, topo):
        batch = {**prompt, "input_ids": ids, "attention_mask": mask, "position_ids": positions, "logits_to_keep": 1}
        logits = _forward(chunks, caches, batch, topo)
        if copies > 1:
            logits = None if logits is None else np.repeat(logits, copies, 0)
            for cache in caches:
                cache.repeat_rows(copies)
            mask, positions = np.repeat(mask, copies, 0), np.repeat(positions, copies, -2)
        for step in range(max_new_tokens):
            if logits is not None and len(suppress_tokens):
                logits = logits.copy()
                logits[:, list(suppress_tokens)] = -np.inf
            chosen = _choose(logits, sampling, uniforms[:, step], rows, topo)
            chosen = np.where(done, pad_id, chosen)
            tokens.append(chosen)
            done |= np.isin(chosen, stops)
            if step + 1 == max_new_tokens or _all_stopped(done, topo):
                break
            mask = np.concatenate([mask, np.ones((rows, 1), mask.dtype)], 1)
            positions = positions[..., -1:] + 1
            batch = {"input_ids": chosen[:, None], "attention_mask": mask, "position_ids": positions,
                     "logits_to_keep": 1}
            logits = _forward(chunks, caches, batch, topo, plan)
    return _completions(np.stack(tokens, 1) if tokens else np.zeros((rows, 0), np.int64), stops)


def _completions(tokens: np.ndarray, stops: np.ndarray) -> Completions:
    hit = np.isin(tokens, stops)
    stopped = hit.any(1)
    lengths = np.where(stopped, hit.argmax(1) + 1, tokens.shape[1])
    return Completions(tokens, lengths.astype(np.int64), stopped)


def _forward(chunks, caches: List[KVCache], batch: Dict, topo: Topology,
             plan: Optional[stage_io.TransferPlan] = None) -> Optional[np.ndarray]:
    """(rows, vocab) float32 logits at the last position on the last stage's ranks (None elsewhere),
    each virtual stage reading and extending its own cache. With a ``plan``: a one-token step,
    whose transfers have the same shapes every step (their headers cross once)."""
    stages = [_stage_with_cache(chunk, cache) for chunk, cache in zip(chunks, caches)]
    keys = None if plan is None else [("decoding step", batch["input_ids"].shape)]
    out = pipeline.forward_only(stages, [(batch, batch)], lambda y, _: _whole_logits(y, topo), topo,
                                with_batch=True, plan=plan, keys=keys)
    return out[0] if out else None


def _stage_with_cache(chunk, cache: KVCache):
    return lambda x, batch: chunk.pipeline_stage(x, {**batch, "past_key_values": cache})


def _whole_logits(y, topo: Topology) -> np.ndarray:
    """The last position's logits, gathered over the vocabulary under tp."""
    logits = (y["logits"] if isinstance(y, dict) else y)[:, -1]
    if topo.tp.size > 1:
        logits = comm.all_gather(logits, topo.tp, -1)
    return logits.astype(ms.float32).asnumpy()


def _choose(logits: Optional[np.ndarray], sampling: Sampling, uniforms: np.ndarray, rows: int,
            topo: Topology) -> np.ndarray:
    """The next tokens, chosen on the last stage and broadcast over the pipeline."""
    chosen = sampling.pick(logits, uniforms) if logits is not None else np.zeros(rows, np.int64)
    if topo.pp.size > 1:
        sent = comm.broadcast(ms.Tensor(chosen.astype(np.int32)), topo.pp.ranks[-1], topo.pp)
        chosen = sent.asnumpy().astype(np.int64)
    return chosen


def _all_stopped(done: np.ndarray, topo: Topology) -> bool:
    """Whether to stop: this rank's rows, or every rank's where forward passes cross data-parallel ranks."""
    running = int((~done).sum())
    if topo.world_size > 1 and lockstep(topo):
        running = int(comm.all_reduce(ms.Tensor(np.array([running], np.int32)), topo.world).asnumpy()[0])
    return running == 0


def lockstep(topo: Topology) -> bool:
    """Whether a forward pass communicates across data-parallel ranks (expert all-to-all, ZeRO-3 gathers)."""
    return topo.config.ep > 1 or topo.config.zero_stage == 3


@contextlib.contextmanager
def whole_sequences(chunks: Sequence, topology: Optional[Topology] = None):
    """The model with its sequence whole on every rank for the block: context parallelism's groups
    made this rank alone and sequence parallelism off (module docstring); restored afterwards."""
    topo = get_topology(topology)
    split = topo.cp.size > 1 or (topo.config.sequence_parallel and topo.tp.size > 1)
    if not split:
        yield
        return
    config, groups = topo.config, dict(topo.groups)
    flipped = [(cell, flag) for chunk in chunks for _, cell in chunk.cells_and_names()
               for flag in SEQUENCE_SPLIT_FLAGS if getattr(cell, flag, None) is True]
    try:
        topo.config = dataclasses.replace(config, sequence_parallel=False)
        for kind in CP_GROUPS:
            topo.groups[kind] = Group((topo.rank,), 0, kind)
        _set_flags(flipped, False, chunks)
        yield
    finally:
        topo.config, topo.groups = config, groups
        _set_flags(flipped, True, chunks)


def _set_flags(flipped, value: bool, chunks) -> None:
    for cell, flag in flipped:
        setattr(cell, flag, value)
    for chunk in chunks:  # positions cut for the other layout (ParallelModel.local_positions)
        getattr(chunk, "_local_positions", {}).clear()
