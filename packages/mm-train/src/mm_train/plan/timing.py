"""Time per step of a training run: compute, launch time, communication and the pipeline bubble.

With F the forward FLOPs of one sample (the family's count), G the global batch, m the
micro-batches per data-parallel rank and step, and E_c, E_n the compute and link efficiencies
(devices.yaml):

    compute     passes F G / (dp tp cp pp) / (peak E_c) per rank, passes = 3 (forward, backward
                = 2 forwards) + the share of layers recomputed (full: 1, block N of L: N / L;
                under pp a stage's backward always recomputes its forward, mm_parallel.pipeline);
                a frozen tower's FLOPs count one forward (two under pp); a stack that runs whole
                (the VL towers) is not divided by tp, cp or pp: the first stage runs all of it
    bubble      compute (pp - 1) / (m vpp)  (1F1B; interleaving divides the idle ticks by vpp)
    encode      online encoding: the encoders' FLOPs of each of the rank's G / dp samples over
                (peak E_e), not divided by tp, cp or pp (every rank of a group encodes its sample);
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

from typing import Dict

from mm_train.plan.batches import reference_passes
from mm_train.plan.memory import stage_layers


def group_spans_servers(topo, kind: str, devices_per_node: int) -> bool:
    """Whether ``topo``'s ``kind`` group holds ranks of more than one server (ranks fill servers in order)."""
    return len({r // devices_per_node for r in topo.groups[kind].ranks}) > 1


def _link_bytes_per_s(topo, kind: str, device: dict, cluster: dict, efficiency: float) -> float:
    inter = group_spans_servers(topo, kind, cluster["devices_per_node"])
    return (device["inter_gbps"] if inter else device["intra_gbps"]) * 1e9 * efficiency


def step_flops(workload, passes: float, pp: int) -> float:
    """FLOPs of one sample in a step: ``passes`` forwards of the trained stacks; the frozen ones
    run forward once (twice under pp, whose stages recompute their forward in the backward)."""
    frozen = workload.frozen_flops
    return passes * (workload.flops_per_sample - frozen) + (2 if pp > 1 else 1) * frozen


def rank_step_flops(workload, passes: float, topo) -> float:
    """FLOPs of one sample in a step on ``topo``'s rank: the split part over tp cp pp, plus on the
    first stage the stacks that run whole (module docstring)."""
    p = topo.pp.size
    trained, frozen = workload.whole_flops(True), workload.whole_flops(False)
    whole = passes * trained + (2 if p > 1 else 1) * frozen
    split = step_flops(workload, passes, p) - whole
    return split / (topo.tp.size * topo.cp.size * p) + (whole if topo.is_first_stage else 0.0)


def _recomputed_share(recipe, workload, pp: int) -> float:
    """The share of the layers whose forward runs again in the backward."""
    mode = recipe.model.recompute
    if mode == "full" or pp > 1:
        return 1.0
    if mode == "block":
        layers = workload.pipelined.layers
        return min(recipe.model.recompute_num_layers or 0, layers) / layers
    return 0.0


def step_time(workload, recipe, topo, device: dict, cluster: dict, efficiency: dict, grads_numel: int,
              micro_batches: int, sharded_numel: int = 0, offload_bytes: int = 0) -> Dict[str, float]:
    """{compute_s, bubble_s, encode_s, launch_s, tp_s, cp_s, pp_s, dp_s, offload_s, step_time_s} of one
    rank (module docstring); ``offload_bytes``: the optimizer state it keeps in host memory."""
    par = topo.config
    dp, t, c, p = topo.dp.size, topo.tp.size, topo.cp.size, topo.pp.size
    size = 2 if recipe.train.precision in ("bf16", "fp16") else 4
    recomputed = recipe.model.recompute in ("full", "block") or p > 1
    passes = 3 + _recomputed_share(recipe, workload, p)
    samples_per_rank = recipe.train.global_batch_size / dp
    peak = device["peak_tflops"] * 1e12 * efficiency["compute"]
    reference = reference_passes(recipe)
    compute = (rank_step_flops(workload, passes, topo) + reference * rank_step_flops(workload, 1, topo)) * \
        samples_per_rank / peak
    bubble = compute * (p - 1) / (micro_batches * par.vpp) if p > 1 else 0.0
    comm_eff = efficiency["communication"]
    b = recipe.train.micro_batch_size
    encode_peak = device["peak_tflops"] * 1e12 * efficiency.get("encode", efficiency["compute"])
    encode = workload.encoder_flops * samples_per_rank / encode_peak
    times = {"compute_s": compute, "bubble_s": bubble, "encode_s": encode, "launch_s": 0.0, "tp_s": 0.0,
             "cp_s": 0.0, "pp_s": 0.0, "dp_s": 0.0,
             # optim.offload: the state in and out, the master weights in once more
             "offload_s": 7 / 3 * offload_bytes / (device.get("host_gbps") or 1) / 1e9 if offload_bytes else 0.0}
    per_layer_pass = efficiency.get("layer_pass_ms", 0.0) / 1e3
    for stack in workload.stacks:
        if not stack.pipelined and not topo.is_first_stage:
            continue
        layers = stage_layers(stack.layers, topo) if stack.pipelined else stack.layers
        layer_passes = layers * ((passes if stack.trained else (2 if p > 1 else 1)) + reference)
        times["launch_s"] += micro_batches * layer_passes * per_layer_pass
        if stack.runs_whole:  # no tp / cp collectives
            continue
        activation = stack.tokens / c * b * stack.hidden * size  # bytes of one layer's s b h values
        if t > 1:
            per_layer = (6 if recomputed else 4) * 2 * (t - 1) / t * activation
            times["tp_s"] += micro_batches * layers * per_layer / _link_bytes_per_s(topo, "tp", device, cluster,
                                                                                    comm_eff)
        if c > 1:
            if par.cp_algo == "ring":
                per_layer = 6 * (c - 1) * activation  # k, v forward; k, v and their gradients backward
            else:
                per_layer = 8 * (c - 1) / c * activation
            times["cp_s"] += micro_batches * layers * per_layer / _link_bytes_per_s(topo, "cp", device, cluster,
                                                                                    comm_eff)
    if p > 1:
        stage_input = workload.pipelined.tokens / c * b * workload.boundary_hidden * size
        times["pp_s"] = micro_batches * par.vpp * 2 * stage_input / _link_bytes_per_s(topo, "pp", device, cluster,
                                                                                      comm_eff)
    if dp * c > 1:
        d = topo.dp_cp.size
        volume = 2 * (d - 1) / d * grads_numel * 4
        if par.zero_stage > 0:
            volume += (d - 1) / d * grads_numel * 4
        times["dp_s"] = volume / _link_bytes_per_s(topo, "dp_cp", device, cluster, comm_eff)
        if sharded_numel:  # ZeRO-3: per micro-batch, gathers and the gradients' reduce-scatter
            gathers = micro_batches * (2 + _recomputed_share(recipe, workload, p))
            if not par.reshard_after_forward:  # the step's first gather kept for every later use
                gathers = 1
            s, r = topo.dp_cp_shard.size, topo.dp_cp_replica.size  # hybrid sharding: r nodes of s
            volume = (s - 1) / s * sharded_numel * (gathers * size + micro_batches * 4)
            times["dp_s"] += volume / _link_bytes_per_s(topo, "dp_cp_shard", device, cluster, comm_eff)
            if r > 1:  # each slice's gradient all-reduced across the nodes
                volume = micro_batches * 2 * (r - 1) / r * sharded_numel / s * 4
                times["dp_s"] += volume / _link_bytes_per_s(topo, "dp_cp_replica", device, cluster, comm_eff)
    times["step_time_s"] = sum(times.values())
    return times


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
