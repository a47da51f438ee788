"""Time per step of a training run: compute, launch time, communication and the pipeline bubble.

With F the forward FLOPs of one sample (the family's count), G the global batch, m the
micro-batches per data-parallel rank and step, and E_c, E_n the compute and link efficiencies
(devices.yaml):

    compute     passes F G / (dp tp cp pp) / (peak E_c) per rank, passes = 3 (forward, backward
                = 2 forwards: the inputs' and the weights' gradients) + the share of layers
                recomputed (full: 1, block N of L: N / L); under model.lora 2 + that share: the
                frozen weights need no gradient (MindSpore's PyNative backward skips them too:
                benchmarks/backward_passes.py, a step of 4 linear layers with adapters costs 2.3 - 2.4
                forwards with the base weights frozen, 3.4 - 3.5 with them trained, on CPU). A framework's
                pipeline decides the rest (`FRAMEWORKS`): mm's stage backward runs its stage's
                forward again (MindSpore's vjp runs the forward again for its deferred backward,
                the same benchmark counts it; PyNative has no other, 2.7.2 - 2.10), so under pp the
                share is 1 and a frozen tower runs forward twice — once when the stage keeps its
                output (no trainable parameter in it, e.g. a VL tower frozen with its merger:
                LayerStack.output_kept); Megatron on torch_npu (MindSpeed-MM) keeps the forward's graph: the recipe's
                recomputation alone, frozen towers once. A stack that runs whole (the VL towers)
                is not divided by tp, cp or pp: the first stage runs all of it
    bubble      compute (pp - 1) / (m vpp)  (1F1B; interleaving divides the idle ticks by vpp)
    encode      online encoding: the encoders' FLOPs of each of the rank's G / dp samples over
                (peak E_e), not divided by tp, cp or pp (every rank of a group encodes its sample);
                with data.encoder_dp the g = tp cp ranks encode ceil(m / g) of the m micro-batches
                each (families.video.encoder_dp; the gathered features, a few MB, not counted);
                E_e is its own efficiency (the VAE's 3-D convolutions, devices.yaml), E_c without one
    launch      m x the layer passes of the rank's stacks x layer_pass_ms: the time a layer costs
                beyond its FLOPs (kernel launches and host work), which short sequences feel
    collectives bytes on the slowest link each group spans (a group whose ranks sit on two
                servers moves at inter_gbps, else intra_gbps), times E_n; our PyNative steps do
                not overlap them with compute, so they add:
                tp / sp   per layer and micro-batch 4 all-reduces (or all-gather + reduce-scatter
                          pairs) of s b h activation values, 2 (t - 1) / t each; 6 with recompute
                cp        Ulysses: 8 all-to-alls of s b h / cp values, (c - 1) / c each; ring: keys
                          and values (at most s b h / cp values each) passed c - 1 times forward,
                          with their gradients backward: 6 (c - 1) s b h / cp
                pp        each micro-batch's stage input forward and its gradient back
                dp / ZeRO the fp32 gradient all-reduce 2 (d - 1) / d N 4 bytes, plus with ZeRO the
                          all-gather of the updated slices (d - 1) / d N 4; under ZeRO-3 the N_s
                          values of the weights it cuts instead move every micro-batch: gathered in
                          the layer's dtype (b bytes) for the forward, the backward and each
                          recomputed forward, (2 + r) (d - 1) / d N_s b (once a step without
                          reshard_after_forward), and their gradients reduce-scattered in fp32,
                          (d - 1) / d N_s 4; under hybrid sharding (r nodes of s ranks) both over
                          the s ranks of a node, plus 2 (r - 1) / r N_s / s 4 across the nodes
    offload     optim.offload optimizer: the rank's master weights and moments (S bytes in host
                memory) copied to the device and back each step, the masters once more for the
                weights: 7 S / 3 at host_gbps (devices.yaml), not overlapped
    reference   train.objective dpo: the frozen reference's forward of every sequence (a pair is
                two: plan.batches), one more pass of every stack with its launches and its bubble
                (the VL towers counted for each sequence, though a pair's run once: an upper bound);
                grpo: the reference's and the sampling policy's passes, once per generation
    generate    train.objective grpo: a generation's rollouts on the rank, over num_iterations
                steps: the prefill of its P = G / dp prompts (their prompt tokens' forward FLOPs)
                and max_completion_length one-token steps of P x num_generations rows (their
                tokens' forward FLOPs), over tp alone (cp and sp ranks decode the whole sequence;
                a token crosses the pipeline's stages in turn); each step runs every layer of the
                model once, its launches layer_pass_ms each (decoding is launch-bound: a step's
                matrix work is a few rows)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List

from mm_train.plan.batches import reference_passes
from mm_train.plan.memory import stage_layers

# whether a framework's pipeline stage runs its forward again in the backward (compute, above)
FRAMEWORKS = {"mm": True, "torch_npu": False}


@dataclass(frozen=True)
class Passes:
    """Forward-equivalents per sample of a trained stack (``trained``) and a frozen one
    (``frozen``), and the share of layers whose forward runs again (``recomputed``)."""

    trained: float
    frozen: int
    recomputed: float

    @classmethod
    def of(cls, recipe, workload, pp: int, framework: str = "mm") -> "Passes":
        pipeline_recomputes = FRAMEWORKS[framework] and pp > 1
        mode = recipe.model.recompute
        if mode == "full" or pipeline_recomputes:
            share = 1.0
        elif mode == "block":
            layers = workload.pipelined.layers
            share = min(recipe.model.recompute_num_layers or 0, layers) / layers
        else:
            share = 0.0
        return cls(forward_and_backward(recipe) + share, 2 if pipeline_recomputes else 1, share)


def forward_and_backward(recipe) -> int:
    """Forwards a trained stack's forward and backward cost per sample: 3, under LoRA 2 (the inputs'
    gradients only, no weight gradient of the frozen weights)."""
    return 2 if recipe.model.lora else 3


def group_spans_servers(topo, kind: str, devices_per_node: int) -> bool:
    """Whether ``topo``'s ``kind`` group holds ranks of more than one server (ranks fill servers in order)."""
    return len({r // devices_per_node for r in topo.groups[kind].ranks}) > 1


def _link_bytes_per_s(topo, kind: str, device: dict, cluster: dict, efficiency: float) -> float:
    inter = group_spans_servers(topo, kind, cluster["devices_per_node"])
    return (device["inter_gbps"] if inter else device["intra_gbps"]) * 1e9 * efficiency


def step_flops(workload, passes: float, frozen_passes: int = 1) -> float:
    """FLOPs of one sample in a step: ``passes`` forwards of the trained stacks, ``frozen_passes``
    of the frozen ones."""
    frozen = workload.frozen_flops
    return passes * (workload.flops_per_sample - frozen) + frozen_passes * frozen


def stack_flops(workload) -> Dict[str, float]:
    """Forward FLOPs per sample of each stack: its own for one that runs whole, the rest of the
    sample's for the pipelined one."""
    whole = {s.name: s.flops for s in workload.stacks if s.runs_whole}
    return {s.name: whole.get(s.name, workload.flops_per_sample - sum(whole.values())) for s in workload.stacks}


def stack_passes(stack, passes: Passes) -> float:
    """Forwards per sample of ``stack``: a trained one's, or a frozen one's (once when a pipeline
    stage keeps its output: LayerStack.output_kept)."""
    if stack.trained:
        return passes.trained
    return 1 if stack.output_kept else passes.frozen


def rank_stack_flops(workload, passes: Passes, topo, reference: float = 0.0) -> Dict[str, float]:
    """FLOPs of one sample in a step on ``topo``'s rank, per stack: a split stack over tp cp pp, a
    stack that runs whole on the first stage alone (module docstring); ``reference``: forward
    passes more without a backward (dpo / grpo's reference)."""
    out = {}
    for stack, flops in zip(workload.stacks, stack_flops(workload).values()):
        n = stack_passes(stack, passes) + reference
        if stack.runs_whole:
            out[stack.name] = n * flops if topo.is_first_stage else 0.0
        else:
            out[stack.name] = n * flops / (topo.tp.size * topo.cp.size * topo.pp.size)
    return out


def rank_step_flops(workload, passes: float, topo, frozen_passes: int = None) -> float:
    """FLOPs of one sample in a step on ``topo``'s rank with ``passes`` forwards of the trained
    stacks (``frozen_passes`` of the frozen ones: by default mm's, two under pp)."""
    frozen = frozen_passes if frozen_passes is not None else (2 if topo.pp.size > 1 else 1)
    return sum(rank_stack_flops(workload, Passes(passes, frozen, 0.0), topo).values())


def step_time(workload, recipe, topo, device: dict, cluster: dict, efficiency: dict, grads_numel: int,
              micro_batches: int, sharded_numel: int = 0, offload_bytes: int = 0,
              framework: str = "mm") -> Dict[str, float]:
    """{compute_s, bubble_s, encode_s, launch_s, tp_s, cp_s, pp_s, dp_s, offload_s, step_time_s} of one
    rank (module docstring), and ``terms``: [(term, seconds, what it counts)] for `mm-train plan
    --explain`; ``offload_bytes``: the optimizer state it keeps in host memory; ``framework``: whose
    pipeline (`FRAMEWORKS`)."""
    p = topo.pp.size
    passes = Passes.of(recipe, workload, p, framework)
    samples = recipe.train.global_batch_size / topo.dp.size
    peak = device["peak_tflops"] * 1e12 * efficiency["compute"]
    reference = reference_passes(recipe)
    terms: List[tuple] = []
    for name, flops in rank_stack_flops(workload, passes, topo, reference).items():
        terms.append((f"compute: {name}", flops * samples / peak,
                      f"{flops * samples / 1e12:.4g} TFLOP at {efficiency['compute']:.3g} of the peak"))
    compute = sum(t[1] for t in terms)
    times = {"compute_s": compute, "bubble_s": compute * (p - 1) / (micro_batches * topo.config.vpp) if p > 1 else 0.0,
             "encode_s": _encode_time(workload, recipe, topo, device, efficiency, samples, micro_batches),
             "launch_s": 0.0, "tp_s": 0.0, "cp_s": 0.0, "pp_s": 0.0, "dp_s": 0.0,
             # optim.offload: the state in and out, the master weights in once more
             "offload_s": 7 / 3 * offload_bytes / (device.get("host_gbps") or 1) / 1e9 if offload_bytes else 0.0}
    terms.append(("pipeline bubble", times["bubble_s"], f"compute x (pp - 1) / (micro-batches {micro_batches} x vpp)"))
    terms.append(("online encoding", times["encode_s"], "the VAE and text encoder in the step"))
    _model_parallel_times(times, terms, workload, recipe, topo, device, cluster, efficiency, micro_batches, passes,
                          reference)
    _data_parallel_times(times, terms, recipe, topo, device, cluster, efficiency["communication"], grads_numel,
                         micro_batches, sharded_numel, passes)
    terms.append(("optimizer offload", times["offload_s"], "the state to and from host memory"))
    times["step_time_s"] = sum(times.values())
    times["terms"] = [t for t in terms if t[1]]
    return times


def _encode_time(workload, recipe, topo, device, efficiency, samples: float, micro_batches: int) -> float:
    if not workload.encoder_flops:
        return 0.0
    peak = device["peak_tflops"] * 1e12 * efficiency.get("encode", efficiency["compute"])
    share = 1.0
    if getattr(recipe.data, "encoder_dp", False):  # each rank its rounds' micro-batches (module docstring)
        g = topo.tp.size * topo.cp.size
        share = math.ceil(micro_batches / g) / micro_batches
    return workload.encoder_flops * samples * share / peak


def _model_parallel_times(times, terms, workload, recipe, topo, device, cluster, efficiency, micro_batches: int,
                          passes: Passes, reference: float) -> None:
    """The launch time of the rank's layer passes and its tp / cp / pp collectives (module docstring)."""
    t, c, p = topo.tp.size, topo.cp.size, topo.pp.size
    size = 2 if recipe.train.precision in ("bf16", "fp16") else 4
    link = efficiency["communication"]
    per_layer_pass = efficiency.get("layer_pass_ms", 0.0) / 1e3
    b = recipe.train.micro_batch_size
    for stack in workload.stacks:
        if not stack.pipelined and not topo.is_first_stage:
            continue
        layers = stage_layers(stack.layers, topo) if stack.pipelined else stack.layers
        layer_passes = layers * (stack_passes(stack, passes) + reference)
        launch = micro_batches * layer_passes * per_layer_pass
        times["launch_s"] += launch
        terms.append((f"launch: {stack.name}", launch, f"{micro_batches * layer_passes:.4g} layer passes"))
        if stack.runs_whole:  # no tp / cp collectives
            continue
        activation = stack.tokens / c * b * stack.hidden * size  # bytes of one layer's s b h values
        if t > 1:
            per_layer = (6 if passes.recomputed else 4) * 2 * (t - 1) / t * activation
            seconds = micro_batches * layers * per_layer / _link_bytes_per_s(topo, "tp", device, cluster, link)
            times["tp_s"] += seconds
            terms.append((f"tp collectives: {stack.name}", seconds, f"{micro_batches * layers * per_layer / 1e9:.4g} "
                                                                    f"GB over tp={t}"))
        if c > 1:
            ring = topo.config.cp_algo == "ring"  # k, v forward; k, v and their gradients backward
            per_layer = 6 * (c - 1) * activation if ring else 8 * (c - 1) / c * activation
            seconds = micro_batches * layers * per_layer / _link_bytes_per_s(topo, "cp", device, cluster, link)
            times["cp_s"] += seconds
            terms.append((f"cp collectives: {stack.name}", seconds, f"{micro_batches * layers * per_layer / 1e9:.4g} "
                                                                    f"GB over cp={c}"))
    if p > 1:
        stage_input = workload.pipelined.tokens / c * b * workload.boundary_hidden * size
        volume = micro_batches * topo.config.vpp * 2 * stage_input
        times["pp_s"] = volume / _link_bytes_per_s(topo, "pp", device, cluster, link)
        terms.append(("pp transfers", times["pp_s"], f"{volume / 1e9:.4g} GB to the neighbouring stages"))


def _data_parallel_times(times, terms, recipe, topo, device, cluster, link: float, grads_numel: int,
                         micro_batches: int, sharded_numel: int, passes: Passes) -> None:
    """The gradient reduction (and ZeRO's gathers) over the dp x cp ranks (module docstring)."""
    par = topo.config
    if topo.dp.size * topo.cp.size == 1:
        return
    d = topo.dp_cp.size
    volume = 2 * (d - 1) / d * grads_numel * 4
    if par.zero_stage > 0:
        volume += (d - 1) / d * grads_numel * 4
    times["dp_s"] = volume / _link_bytes_per_s(topo, "dp_cp", device, cluster, link)
    terms.append(("dp gradients", times["dp_s"], f"{volume / 1e9:.4g} GB over dp x cp={d}"))
    if not sharded_numel:
        return
    size = 2 if recipe.train.precision in ("bf16", "fp16") else 4
    gathers = micro_batches * (2 + passes.recomputed)  # ZeRO-3: per micro-batch, and the reduce-scatters
    if not par.reshard_after_forward:  # the step's first gather kept for every later use
        gathers = 1
    s, r = topo.dp_cp_shard.size, topo.dp_cp_replica.size  # hybrid sharding: r nodes of s
    volume = (s - 1) / s * sharded_numel * (gathers * size + micro_batches * 4)
    seconds = volume / _link_bytes_per_s(topo, "dp_cp_shard", device, cluster, link)
    if r > 1:  # each slice's gradient all-reduced across the nodes
        across = micro_batches * 2 * (r - 1) / r * sharded_numel / s * 4
        seconds += across / _link_bytes_per_s(topo, "dp_cp_replica", device, cluster, link)
    times["dp_s"] += seconds
    terms.append(("ZeRO-3 gathers", seconds, f"{gathers:.3g} gathers of {sharded_numel:,} values"))


def generation_time(recipe, workload, topo, device: dict, efficiency: dict, prompts: int) -> float:
    """train.objective grpo: the seconds a step spends generating on ``topo``'s rank (module
    docstring); ``prompts``: the global batch's; 0 for the other objectives."""
    if recipe.train.objective != "grpo":
        return 0.0
    grpo = recipe.grpo
    per_token = workload.flops_per_sample / workload.tokens_per_sample
    prompt_tokens = max(workload.tokens_per_sample - grpo.max_completion_length, 1)
    mine = prompts / topo.dp.size
    flops = mine * per_token * (prompt_tokens + grpo.num_generations * grpo.max_completion_length)
    compute = flops / topo.tp.size / (device["peak_tflops"] * 1e12 * efficiency["compute"])
    layers = sum(stack.layers for stack in workload.stacks if stack.pipelined)
    launches = (grpo.max_completion_length + 1) * layers * efficiency.get("layer_pass_ms", 0.0) / 1e3
    return (compute + launches) / grpo.num_iterations
