"""DistributedOptimizer: AdamW with fp32 master weights, its state sharded over the data-parallel
ranks (ZeRO), global-norm clipping, dynamic loss scaling, learning-rate schedules.

Each trainable parameter is reduced over its own replicas (mm_parallel.sharding: ``grad_sync``):
dense parameters over ``dp_cp`` (data and context parallel ranks hold replicas), experts over
``edp`` (the dp_cp ranks holding the same experts). The parameters of one such group are laid end
to end and cut into flat fp32 buckets of at most ``bucket_numel`` values (mm_parallel.grad_buckets:
the last one padded to a multiple of D, the group's size under ZeRO); each step phase goes bucket
by bucket, so its transient buffers are one bucket's. A step, with g_r the gradients rank r computed:

    finalize    tp-partial gradients (sequence-parallel norms, LoRA A) summed over tp
    reduce      g = (sum over the bucket's group of g_r) / dp     cp ranks hold parts of one
                sample's loss, which add up; dp ranks hold other samples, whose mean is taken (an
                expert's gradient already gathers the tokens its ep group sent it)
                zero_stage 0, 1: all-reduce, then (stage 1) keep (a copy of) this rank's 1/D slice
                zero_stage 2:    reduce-scatter straight to the slice
                zero_stage 3:    the weights mm_parallel.zero3 cut arrive reduce-scattered by their
                                 regions (divided by dp here, updated where they lie, never
                                 gathered); the rest as stage 2
    overflow    if any rank sees inf/nan in the scaled g: skip the step, shrink the loss scale
    clip        norm = sqrt(sum g^2 over distinct values) / loss_scale, one all-reduce over the
                world: each rank counts its ZeRO slice (without ZeRO: group rank 0 counts the
                bucket), a parameter replicated over tp on tp rank 0 only, experts once per ep rank;
                g *= min(1, clip / norm) / loss_scale (bucket by bucket, just before its update)
    AdamW       on this rank's slice of master weights, exp_avg, exp_avg_sq (bias-corrected,
                decoupled weight decay, none on biases and 1-D parameters such as norms)
    gather      stages 1, 2: all-gather the updated slices; every parameter set from its bucket

On the device path (`mm_parallel.ops.device.use_fused`: Ascend, or the stand-ins) nothing of this
is read back: the norm, the clip factor, the skip and loss-scale decisions and the step count
stay (1,) tensors on the device, and the step returns them unread. A skipped step runs the same
fused AdamW with lr 0, beta1 = beta2 = 1 and a zero gradient, which leaves weights and moments
exactly as they were (m' = 1 m + 0, v' = 1 v + 0, p' = p - 0 u); the bias corrections follow
the device's count of steps taken. There the overflow check is the norm's finiteness (a sum of
squares that overflows float32 counts as an overflow too, which a halved scale fixes).

Memory per rank for the optimizer: 3 N / D fp32 values (master, exp_avg, exp_avg_sq) instead of
3 N (zero_stage 0). With stages 1 and 2 the reduced gradient kept is N / D values too (the
per-parameter gradients autodiff returns are still whole in PyNative); the step's transients are
one bucket's flat, reduced and gathered buffers (grad_buckets). On CPU, reduce-scatter is an all-reduce
and a slice (mm_parallel.comm), so stages 1 and 2 move the same bytes there. With
``offload: optimizer`` the 3 N / D values live in host memory and each bucket's are copied to the
device for its update and back (3 + 3 copies of 4 C / D bytes, plus the master once more for the
weights): the device holds one bucket's state at a time, the results are the resident run's.

State is saved in one layout-independent format (`save` / `load`): per pipeline stage one
safetensors file of whole tensors by parameter name (``<name>.master``, ``.exp_avg``,
``.exp_avg_sq``; ZeRO slices and tp / ep shards gathered) and the step counters; it loads under
any dp, tp, ep size or zero stage.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mm_parallel import comm, grad_buckets, zero3
from mm_parallel.grad_buckets import Bucket, WholeParameters
from mm_parallel.lr_schedule import LRSchedule
from mm_parallel.ops.device import use_fused
from mm_parallel.sequence_parallel import sync_sequence_parallel_grads
from mm_parallel.sharding import sharding_of
from mm_parallel.topology import Topology, get_topology

STATES = grad_buckets.STATES


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_schedule: str = "constant"  # cosine | linear | constant (see mm_parallel.lr_schedule)
    warmup_steps: int = 0
    decay_steps: int = 0
    weight_decay: float = 0.01
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0  # max global grad norm; 0 turns clipping off
    loss_scale: Optional[float] = None  # None: no scaling (fp32/bf16); a number: static; see dynamic
    dynamic_loss_scale: bool = False  # fp16: start at initial_loss_scale, halve on overflow, grow
    initial_loss_scale: float = 2.0 ** 16
    loss_scale_window: int = 1000  # steps without overflow before the scale doubles
    min_loss_scale: float = 1.0
    bucket_numel: int = grad_buckets.DEFAULT_BUCKET_NUMEL  # values per gradient bucket (0: one per group)
    # "optimizer": master weights and moments in host memory, streamed to the device bucket by
    # bucket for the update (grad_buckets.Bucket.resident); None: on the device
    offload: Optional[str] = None

    def __post_init__(self):
        if self.offload not in (None, "optimizer"):
            raise ValueError(f"optim.offload={self.offload!r} is unknown; use optimizer (master weights and "
                             "moments in host memory) or leave it unset")

    def schedule(self) -> LRSchedule:
        return LRSchedule(self.lr, self.warmup_steps, self.decay_steps, self.lr_schedule, self.min_lr)


class DistributedOptimizer:
    """See the module docstring. ``model`` (a Cell, or the list of layers a pipeline stage holds)
    gives the trainable parameters; their sharding specs say how each is reduced."""

    STATES = STATES

    def __init__(self, model, config: OptimizerConfig = OptimizerConfig(),
                 topology: Optional[Topology] = None, zero_stage: Optional[int] = None):
        self.topology = topo = get_topology(topology)
        self.config = config
        self.zero_stage = topo.config.zero_stage if zero_stage is None else zero_stage
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if not isinstance(config.bucket_numel, int) or config.bucket_numel < 0:
            raise ValueError(f"optim.bucket_numel must be a whole number of values >= 0 (0: one bucket per group), "
                             f"got {config.bucket_numel!r}")
        self.lr_at = config.schedule()
        cells = [model] if isinstance(model, nn.Cell) else list(model)
        self.params = [p for cell in cells for p in cell.trainable_params()]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        self.names = [p.name for p in self.params]
        self.buckets: Dict[str, Bucket] = {}  # "<group>.<k>": the k-th bucket of a sync group
        for name, (group, buckets) in grad_buckets.plan_buckets(self.params, topo, self.zero_stage,
                                                                config.bucket_numel).items():
            for k, pieces in enumerate(buckets):
                tag = f"{name}.{k}"
                stage = min(self.zero_stage, 2)  # stage 3's whole parameters: as stage 2 (mm_parallel.zero3)
                self.buckets[tag] = Bucket(self.params, pieces, group, stage, topo, f"optimizer.{tag}",
                                           offload=config.offload == "optimizer")
        self.numel = sum(b.numel for b in self.buckets.values())
        self.iteration = 0  # step() calls: what the learning-rate schedule follows
        # step_count (optimizer steps taken: skipped steps not counted), loss_scale, good_steps
        # (steps since the scale last changed): host numbers, or (1,) device tensors on the device path
        self._host = {"step_count": 0, "good_steps": 0,
                      "loss_scale": (config.initial_loss_scale if config.dynamic_loss_scale else config.loss_scale)
                      or 1.0}
        self._device: Optional[Dict[str, Tensor]] = None
        self._betas: Optional[Tuple[Tensor, Tensor]] = None  # (b1, b2) on the device

    # -- counters: on the host, or on the device between reads --------------------------------------

    def _counters_on_host(self) -> Dict[str, float]:
        """The counters as host numbers (one read when the device path last had them)."""
        if self._device is not None:
            keys = list(self._device)
            values = ops.concat([self._device[k] for k in keys]).asnumpy()
            self._host = {k: float(v) for k, v in zip(keys, values)}
            self._host["step_count"], self._host["good_steps"] = (int(self._host["step_count"]),
                                                                  int(self._host["good_steps"]))
            self._device = None
        return self._host

    def _counters_on_device(self) -> Dict[str, Tensor]:
        if self._device is None:
            self._device = {k: Tensor(np.array([v], np.float32)) for k, v in self._host.items()}
        return self._device

    @property
    def step_count(self) -> int:
        return self._counters_on_host()["step_count"]

    @property
    def loss_scale(self) -> float:
        """The loss scale (a read from the device on the device path)."""
        return self._counters_on_host()["loss_scale"]

    @property
    def scaling(self) -> bool:
        """Whether the loss is scaled (fp16, or a static scale other than 1)."""
        return self.config.dynamic_loss_scale or (self.config.loss_scale or 1.0) != 1.0

    # -- the step -------------------------------------------------------------------------------

    def scale_loss(self, loss):
        """The loss to differentiate: loss * loss_scale (identity without loss scaling)."""
        return loss * self._scale_like(loss) if self.scaling else loss

    def unscale_loss(self, loss):
        """loss / loss_scale: the loss a scaled one stands for (on the device path without a read)."""
        return loss / self._scale_like(loss) if self.scaling else loss

    def _scale_like(self, loss):
        """The current loss scale: a device tensor in ``loss``'s dtype on the device path (where it
        stays), else the host number."""
        if self._device is not None or use_fused():
            return self._counters_on_device()["loss_scale"].astype(loss.dtype)
        return self._host["loss_scale"]

    def step(self, grads: Sequence, finite_loss=None) -> Dict[str, float]:
        """Apply one update from this rank's gradients (same order as the model's trainable
        parameters); returns {"lr", "grad_norm", "loss_scale", "skipped", "overflow"} (overflow: skipped
        by dynamic loss scaling, whose scale was halved). On the device path every figure but lr is
        a (1,) device tensor, unread; ``finite_loss`` there (a (1,) bool tensor) skips the step
        too when false (the loop's non-finite loss, decided without a read)."""
        if len(grads) != len(self.params):
            raise ValueError(f"step got {len(grads)} gradients for {len(self.params)} trainable parameters")
        zero3.release()  # whole weights kept for the step (reshard_after_forward false): the update changes them
        topo, cfg = self.topology, self.config
        lr = self.lr_at(self.iteration)
        self.iteration += 1
        if topo.tp.size > 1:
            grads = sync_sequence_parallel_grads(self.params, grads, topo.tp)
        # bucket by bucket: each one's flat and reduced copies are gone before the next is built;
        # bf16 / fp16 gradients are reduced in fp32, a bucket's pieces cast as it is built
        flats = {name: bucket.reduce(grads, topo.dp.size) for name, bucket in self.buckets.items()}
        if use_fused():
            return self._step_on_device(flats, lr, finite_loss)
        host = self._counters_on_host()
        if self._overflow(flats):  # loss scaling's normal course: the scale shrinks, the run goes on
            self._update_scale(overflow=True)
            return {"lr": lr, "grad_norm": float("nan"), "loss_scale": self.loss_scale, "skipped": True,
                    "overflow": True}
        # unscaling and clipping are one factor applied bucket by bucket as each is updated (a
        # scaled copy of every bucket at once would double the reduced gradients' memory)
        norm = math.sqrt(float(self._sum_of_squares(flats).asnumpy()[0])) / host["loss_scale"]
        if not math.isfinite(norm):  # an inf / nan gradient anywhere (the norm is global): no update
            return {"lr": lr, "grad_norm": norm, "loss_scale": self.loss_scale, "skipped": True, "overflow": False}
        factor = 1.0 / host["loss_scale"]
        if cfg.clip_grad > 0 and norm > cfg.clip_grad:
            factor *= cfg.clip_grad / (norm + 1e-6)
        self._adamw(flats, lr, factor)
        self._write_params()
        self._update_scale(overflow=False)
        return {"lr": lr, "grad_norm": norm, "loss_scale": self.loss_scale, "skipped": False, "overflow": False}

    def _step_on_device(self, flats, lr: float, finite_loss) -> Dict[str, object]:
        """The step of the module docstring's device path: the same arithmetic, every decision a
        `where` on (1,) tensors, nothing read."""
        cfg, (b1, b2) = self.config, self.config.betas
        counters = self._counters_on_device()
        scale = counters["loss_scale"]
        norm = ops.sqrt(self._sum_of_squares(flats)) / scale
        finite_grads = ops.isfinite(norm)
        ok = finite_grads if finite_loss is None else ops.logical_and(finite_grads, finite_loss.reshape(1))
        factor = 1.0 / scale
        if cfg.clip_grad > 0:
            factor = factor * ops.where(norm > cfg.clip_grad, cfg.clip_grad / (norm + 1e-6), 1.0)
        t = counters["step_count"] + ok.astype(ms.float32)
        # the bias corrections of `_adamw` at the device's t; a skipped step: lr 0, betas 1, eps kept > 0
        if self._betas is None:  # made once: an upload per step otherwise
            self._betas = (Tensor([b1], ms.float32), Tensor([b2], ms.float32))
        root = ops.sqrt(1 - ops.pow(self._betas[1], t))
        first = 1 - ops.pow(self._betas[0], t)
        lr_t = ops.where(ok, lr * root / first, 0.0)
        eps_t = ops.where(ok, cfg.eps * root, cfg.eps)
        wd_t = ops.where(ok, cfg.weight_decay * first / root, 0.0)  # = weight_decay lr / lr_t
        beta1, beta2 = ops.where(ok, b1, 1.0), ops.where(ok, b2, 1.0)
        for name, bucket in self.buckets.items():
            g = flats.pop(name)
            bucket.adamw(ops.where(ok, g * factor, 0.0), lr_t, beta1, beta2, eps_t, wd_t,
                         decays=cfg.weight_decay > 0)
        self._write_params()
        counters["step_count"] = t
        overflow = ops.logical_not(finite_grads)
        if cfg.dynamic_loss_scale:
            good = ops.where(ok, counters["good_steps"] + 1, counters["good_steps"])
            grow = good >= cfg.loss_scale_window
            counters["loss_scale"] = ops.where(overflow, ops.maximum(scale / 2, cfg.min_loss_scale),
                                               ops.where(grow, scale * 2, scale))
            counters["good_steps"] = ops.where(ops.logical_or(overflow, grow), 0.0, good)
        return {"lr": lr, "grad_norm": norm, "loss_scale": counters["loss_scale"], "skipped": ops.logical_not(ok),
                "overflow": overflow if cfg.dynamic_loss_scale else ops.zeros_like(overflow)}

    def _overflow(self, flats) -> bool:
        if not self.scaling:
            return False
        bad = any(bool(ops.logical_not(ops.isfinite(g)).any().asnumpy()) for g in flats.values())
        flag = Tensor(np.array([int(bad)], np.int32))
        if self.topology.world_size > 1:
            flag = comm.all_reduce(flag, self.topology.world, "max")
        return bool(flag.asnumpy()[0])

    def _sum_of_squares(self, flats) -> Tensor:
        """sum g^2 over every distinct value of the model, a (1,) float32 tensor: each rank counts
        what it alone holds (see grad_buckets.Bucket), one all-reduce over the world adds them up."""
        parts = [bucket.sum_of_squares(flats[name]) for name, bucket in self.buckets.items()]
        if all(isinstance(part, float) for part in parts):  # the CPU path's host sums
            total = Tensor(np.array([sum(parts)], np.float32))
        else:  # the device path: summed there
            total = functools.reduce(lambda a, b: a + b, parts).astype(ms.float32)
        if self.topology.world_size > 1:
            total = comm.all_reduce(total, self.topology.world)
        return total

    def _adamw(self, flats, lr, factor: float):
        (b1, b2), cfg = self.config.betas, self.config
        self._host["step_count"] += 1
        t = self._host["step_count"]
        # torch's AdamW, p <- p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps), through the fused in-place
        # kernel (one pass instead of ~15 elementwise ops: 0.22 s vs 0.42 s on 45M floats, CPU), which
        # computes p <- p - lr_t (m / (sqrt(v) + eps_t) + wd_t p). The bias corrections fold into
        #   lr_t = lr sqrt(1 - b2^t) / (1 - b1^t),  eps_t = eps sqrt(1 - b2^t),  wd_t = lr wd / lr_t
        root = math.sqrt(1 - b2 ** t)
        lr_t, eps_t = lr * root / (1 - b1 ** t), cfg.eps * root
        wd_t = cfg.weight_decay * lr / lr_t if lr_t else 0.0
        for name, bucket in self.buckets.items():
            g = flats.pop(name)  # this bucket's reduced gradient goes once it is applied
            bucket.adamw(g if factor == 1.0 else g * factor, lr_t, b1, b2, eps_t, wd_t, decays=bool(wd_t))

    def _write_params(self):
        whole = WholeParameters(ops.concat)
        for bucket in self.buckets.values():
            bucket.write_params(whole)

    def _update_scale(self, overflow: bool):
        cfg, host = self.config, self._host
        if not cfg.dynamic_loss_scale:
            return
        if overflow:
            host["loss_scale"] = max(host["loss_scale"] / 2, cfg.min_loss_scale)
            host["good_steps"] = 0
            return
        host["good_steps"] += 1
        if host["good_steps"] >= cfg.loss_scale_window:
            host["loss_scale"] *= 2
            host["good_steps"] = 0

    # -- state ----------------------------------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds in device memory (master weights, exp_avg,
        exp_avg_sq; none with optim.offload between steps, one bucket's during its update)."""
        return sum(b.state_bytes() for b in self.buckets.values())

    def host_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds in host memory (optim.offload)."""
        return sum(b.host_state_bytes() for b in self.buckets.values())

    def param_states(self) -> List[Dict[str, np.ndarray]]:
        """Per trainable parameter, in order: its master weight, exp_avg and exp_avg_sq shaped like
        the parameter on this rank (its tp / ep shard). ZeRO slices are gathered over each bucket's
        group: a collective every rank of the group calls."""
        out: List[Dict[str, np.ndarray]] = [{} for _ in self.params]
        for key in STATES:
            whole = WholeParameters(np.concatenate)
            for bucket in self.buckets.values():
                for i, value in bucket.completed(bucket.host_pieces(key), whole):
                    out[i][key] = value.reshape(self.params[i].shape)
        return out

    def load_param_states(self, states: Sequence[Dict[str, np.ndarray]]):
        """Inverse of `param_states` (this rank keeps its ZeRO range); parameters are set from
        the master weights."""
        if len(states) != len(self.params):
            raise ValueError(f"{len(states)} parameter states for {len(self.params)} trainable parameters")
        for p, state in zip(self.params, states):
            for key in STATES:
                if tuple(state[key].shape) != tuple(p.shape):
                    raise ValueError(f"{p.name}: saved {key} has shape {tuple(state[key].shape)}, the parameter "
                                     f"{tuple(p.shape)}")
        for bucket in self.buckets.values():
            for key in STATES:
                flat = np.zeros(bucket.padded, np.float32)
                for piece, lo, hi in zip(bucket.pieces, bucket.offsets[:-1], bucket.offsets[1:]):
                    flat[lo:hi] = states[piece.param][key].reshape(-1)[piece.lo:piece.hi]
                bucket.set_whole(key, flat)
        self._write_params()

    def counters(self) -> Dict[str, float]:
        """Step counters and loss scale: with `param_states`, everything a resume needs."""
        host = self._counters_on_host()
        return {"step_count": host["step_count"], "iteration": self.iteration, "loss_scale": host["loss_scale"],
                "good_steps": host["good_steps"]}

    def load_counters(self, counters: Dict[str, float]):
        self.iteration, self._device = int(counters["iteration"]), None
        self._host = {"step_count": int(counters["step_count"]), "good_steps": int(counters["good_steps"]),
                      "loss_scale": float(counters["loss_scale"])}

    # -- the one state format: whole tensors by name, a file per pipeline stage ------------------

    def save(self, folder: str, names: Optional[Sequence[str]] = None) -> str:
        """Write ``folder/optimizer-stage<pp>.safetensors`` (every rank calls: the gathers are
        collectives); ``names``: each parameter's name in the whole model (default its own)."""
        from safetensors.numpy import save_file

        topo, names = self.topology, list(names or self.names)
        writer = topo.tp.rank == 0 and topo.dp_cp.rank == 0  # one writer per pipeline stage
        tensors = {}
        # one bucket's one state gathered at a time, and kept only by the writer: a rank that
        # writes nothing holds at most one bucket buffer (and the parts of a parameter cut between
        # two buckets), not the stage's whole state, thrice
        wholes = {key: WholeParameters(np.concatenate) for key in STATES}
        for bucket in self.buckets.values():
            for key in STATES:
                for i, value in bucket.completed(bucket.host_pieces(key), wholes[key]):  # a collective
                    param, spec = self.params[i], sharding_of(self.params[i])
                    value = value.reshape(param.shape)
                    if spec.sharded:  # a collective over the parameter's tp / ep (and ZeRO-3) groups
                        value = spec.gather(Tensor(value), topo).asnumpy()
                    if writer:
                        tensors[f"{names[i]}.{key}"] = np.ascontiguousarray(value)
        path = os.path.join(folder, f"optimizer-stage{topo.pp.rank:03d}.safetensors")
        if writer:
            os.makedirs(folder, exist_ok=True)
            save_file(tensors, path + ".tmp", metadata={"mm_parallel.optimizer": json.dumps(self.counters())})
            os.replace(path + ".tmp", path)  # a reader never sees half a file
        if topo.world_size > 1:
            comm.barrier(topo.world)
        return path

    def load(self, folder: str, names: Optional[Sequence[str]] = None) -> None:
        """Read what `save` wrote, under any layout: each rank cuts its shards and ZeRO range."""
        from safetensors import safe_open

        files = sorted(n for n in os.listdir(folder) if n.startswith("optimizer-stage") and n.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no optimizer-stage*.safetensors in {folder}")
        handles = [safe_open(os.path.join(folder, n), "np") for n in files]
        where = {key: h for h in handles for key in h.keys()}
        states = []
        for name, param in zip(names or self.names, self.params):
            spec, state = sharding_of(param), {}
            for key in STATES:
                tensor = f"{name}.{key}"
                if tensor not in where:
                    raise KeyError(f"{tensor} is not in {folder}: the state was saved for other trainable parameters "
                                   "(another model, LoRA or freeze setting)")
                state[key] = spec.local(where[tensor].get_tensor(tensor), self.topology)
            states.append(state)
        self.load_param_states(states)
        self.load_counters(json.loads(handles[0].metadata()["mm_parallel.optimizer"]))
