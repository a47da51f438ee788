"""What one micro-batch asks of the model: each family's shapes for the planner (`mm-train plan`).

A family's ``workload`` function (FamilySpec.workload) turns a recipe and the model's config into
a `Workload`: the stacks of transformer layers a sample goes through (language model, vision
tower, DiT), each with its tokens per sample and the activation elements its code keeps per
token and layer for the backward, the forward FLOPs of one sample (the family's own count, the
one MFU uses in training; the frozen towers' part of it, which has no backward) and the tokens a
throughput figure counts.

Saved activations per token and layer are split the way tensor / sequence parallelism divides
them (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"):

    outside   elements outside the tp-split linears (norm inputs / outputs, residuals): divided by
              tp only under sequence parallelism
    inside    elements between a column and a row linear (q, k, v, attention output, MLP
              intermediates): divided by tp always
    scores    none with a fused attention kernel (it keeps only its log-sum-exp); the reference
              attention keeps float32 (heads x keys) tensors per query (mm_train.plan.memory)
    reference outside + inside for the reference kernels (CPU): norms, rotary embeddings and modulation
              written as element-wise ops on tiled operands keep more; measured per family by
              benchmarks/plan_activation_memory.py, split over tp like outside and inside

Context parallelism divides a stack's tokens by cp (its layers see tokens / cp each). A stack that
``runs_whole`` (the VL towers: plain linears, every rank of the first stage runs the whole tower
on its sample) is divided by none of tp, sp and cp, has no tp / cp collectives, and its forward
FLOPs (``flops``) are the first stage's alone, undivided.

Packed data (`PackedRow`): a micro-batch is one row of ``samples`` samples, ``positions`` long
(the budget, rounded up to the multiple the layout cuts rows into; what the samples leave of it is
the padding the plan assumes). `Workload.per_row` is the workload of such a row: every stack's tokens and FLOPs
``samples`` times a sample's, the language model's ``positions`` long, while its attention keys
stay one sample's — attention costs the sum of the squares of the segments, not the square of the
row.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import List, Optional


@dataclass(frozen=True)
class LayerStack:
    """``layers`` identical layers every sample goes through with ``tokens`` tokens."""

    name: str
    layers: int
    tokens: int  # per sample
    hidden: int
    outside: float  # saved elements per token and layer outside the tp-split linears
    inside: float  # ... between a column and a row linear
    heads: int  # attention heads (the scores term)
    keys: int  # keys each query attends to (window, frame or whole sequence; + cross-attention keys)
    reference: float  # saved elements per token and layer on the reference (CPU) kernels, scores aside
    reference_emulated: float = 0.0  # ... more when they emulate bf16 / fp16 (rounded copies)
    pipelined: bool = True  # its layers are cut over the pipeline stages (else: all on the first stage)
    trained: bool = True  # False: frozen, its activations are not kept for a backward
    runs_whole: bool = False  # every rank of the first stage runs it unsplit (module docstring)
    flops: float = 0.0  # forward FLOPs per sample, for a stack that runs whole (part of flops_per_sample)
    # frozen with no trainable parameter in its module: a pipeline stage keeps its output for the
    # forward its backward runs again, so it runs once per micro-batch (mm_models_vl's run_tower)
    output_kept: bool = False

    def __post_init__(self):
        if self.runs_whole and self.pipelined:
            raise ValueError(f"stack {self.name!r}: a stack that runs whole sits on the first stage (pipelined=False)")


@dataclass(frozen=True)
class AttentionForm:
    """One kind of attention call a sample makes, at the model's full widths: ``tokens`` queries
    per sample in segments of ``segment`` (windows, frames, chunks; 0: the whole ``tokens``), each
    attending to its own segment (self-attention) or to ``keys`` other tokens (cross-attention);
    heads, kv heads and head size as the config has them. ``split``: tensor and context parallelism
    divide its heads and tokens (False for the VL towers, which every rank runs whole).
    `mm-train doctor --recipe` runs the kernel at these shapes per rank."""

    name: str
    tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool = False
    segment: int = 0
    keys: int = 0  # cross-attention: the keys every query attends to (0: self-attention)
    split: bool = True


@dataclass(frozen=True)
class PackedRow:
    """A packed micro-batch (module docstring): ``samples`` samples of ``tokens`` tokens in all, in a
    row of ``positions`` (>= tokens) under a budget of ``budget`` tokens (data.max_tokens)."""

    samples: int
    tokens: int
    positions: int
    budget: int

    @property
    def padding_fraction(self) -> float:
        return 1 - self.tokens / self.positions


@dataclass(frozen=True)
class Workload:
    stacks: List[LayerStack]
    flops_per_sample: float  # forward FLOPs of one sample (a training step is 3 forwards)
    tokens_per_sample: int  # what tokens / s counts
    boundary_hidden: int  # the hidden size of what pipeline stages pass on (per token of the pipelined stack)
    logits_vocab: int = 0  # the last stage's logits (fp32, vocabulary split over tp), 0 for none
    frozen_flops: float = 0.0  # the part of flops_per_sample in frozen stacks (run forward only)
    # forward FLOPs per sample of encoders run in the step (online encoding: the VAE and text
    # encoder), which every rank of the sample's tp / cp / pp group runs whole; not model FLOPs (MFU)
    encoder_flops: float = 0.0
    notes: List[str] = field(default_factory=list)
    attention: List[AttentionForm] = field(default_factory=list)  # the attention calls of one sample
    packed: Optional[PackedRow] = None  # micro-batches are packed rows (data.packing)

    @property
    def pipelined(self) -> LayerStack:
        return next(s for s in self.stacks if s.pipelined)

    def per_row(self) -> "Workload":
        """The workload of one packed row taken as a sample (module docstring)."""
        k, row = self.packed.samples, self.packed
        stacks = [replace(s, tokens=row.positions if s.pipelined else s.tokens * k, flops=s.flops * k)
                  for s in self.stacks]
        return replace(self, stacks=stacks, flops_per_sample=self.flops_per_sample * k,
                       tokens_per_sample=row.tokens, frozen_flops=self.frozen_flops * k,
                       encoder_flops=self.encoder_flops * k, packed=None)

    def whole_flops(self, trained: bool) -> float:
        """Forward FLOPs per sample of the stacks that run whole, trained or frozen ones."""
        return sum(s.flops for s in self.stacks if s.runs_whole and s.trained == trained)
