"""MoE layouts against one process (run inside one msrun launch of 4 workers): three optimizer
steps under each layout (loss per step, first-step gradients gathered, final parameters), the
expert layouts on disk read slice by slice, and an ep2 run resumed under ep1 and ep4."""

from __future__ import annotations

import os
import traceback

import numpy as np
from helpers.moe_model import E, batch, spec

CAPACITY = {"capacity_factor": 0.75}
CASES = {
    "ep2": {"layout": {"ep": 2}},
    "ep4": {"layout": {"ep": 4}},
    "ep2_tp2_etp2": {"layout": {"tp": 2, "ep": 2}},
    "ep2_tp2_etp1": {"layout": {"tp": 2, "ep": 2, "expert_tp": 1}},
    "ep2_tp2_sp_etp2": {"layout": {"tp": 2, "ep": 2, "sequence_parallel": True}},
    "ep2_tp2_sp_etp1": {"layout": {"tp": 2, "ep": 2, "expert_tp": 1, "sequence_parallel": True}},
    "ep2_pp2": {"layout": {"pp": 2, "ep": 2}},
    "ep2_zero1": {"layout": {"ep": 2, "zero_stage": 1}},
    "ep2_zero2": {"layout": {"ep": 2, "zero_stage": 2}},
    "ep2_cp2": {"layout": {"cp": 2, "ep": 2}},
    "allgather_ep2": {"layout": {"ep": 2}, "moe": {"dispatcher": "allgather"}},
    "allgather_ep4_tp1": {"layout": {"ep": 4}, "moe": {"dispatcher": "allgather"}},
    "capacity_ep2": {"layout": {"ep": 2}, "moe": CAPACITY},
    "capacity_position_padded_ep4": {"layout": {"ep": 4},
                                     "moe": {**CAPACITY, "drop_policy": "position", "pad_to_capacity": True}},
    "capacity_allgather_ep2": {"layout": {"ep": 2}, "moe": {**CAPACITY, "dispatcher": "allgather"}},
    "skewed_ep4": {"layout": {"ep": 4}, "checkpoint": "skewed"},
    "skewed_allgather_ep4": {"layout": {"ep": 4}, "checkpoint": "skewed", "moe": {"dispatcher": "allgather"}},
    "skewed_top1_ep4": {"layout": {"ep": 4}, "checkpoint": "skewed", "moe": {"top_k": 1}},  # all to expert 0
    "expert_bias_ep2": {"layout": {"ep": 2}, "moe": {"expert_bias": True, "bias_update_rate": 0.05}},
    "topk_softmax_shared_ep2_tp2_sp": {"layout": {"tp": 2, "ep": 2, "sequence_parallel": True}, "checkpoint": "shared"},
    "topk_softmax_shared_ep2_tp2_sp_etp1": {"layout": {"tp": 2, "ep": 2, "expert_tp": 1, "sequence_parallel": True},
                                            "checkpoint": "shared"},
}


def reference_key(case):
    return (repr(sorted(case.get("moe", {}).items())),)


def run_layout_cases(root, names=None):
    """-> {case: [problems], ...} of this rank (mm_parallel.testing.equivalence.run_cases)."""
    from mm_parallel.testing.equivalence import run_cases

    cases = {n: {"checkpoint": "base", **c} for n, c in CASES.items() if names is None or n in names}
    return run_cases(spec(), root, cases, batch(), reference_key=reference_key, steps=3)


def check_loaded_layouts(root):
    """Each rank's experts read from the transposed and per-expert folders equal its slice of base."""
    from helpers.moe_model import toy_class

    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.hf_checkpoint import SafetensorsFolder
    from mm_parallel.sharding import sharding_of

    problems = []
    topo = mm_parallel.initialize(ParallelConfig(tp=2, ep=2))
    base = SafetensorsFolder(os.path.join(root, "base"))
    for layout in ("transposed", "per_expert"):
        model = toy_class().from_pretrained(os.path.join(root, layout), topo)
        for name, param in model.parameters_and_names():
            full = base.read(name)
            want = sharding_of(param).local(full, topo)
            if not np.array_equal(param.asnumpy(), want):
                problems.append(f"{layout}: {name} is not this rank's slice")
        experts = model.layers[0].mlp.experts
        if experts.checkpoint_layout != {"transposed": "fused_transposed"}.get(layout, layout):
            problems.append(f"{layout}: read as {experts.checkpoint_layout}")
        out = os.path.join(root, f"saved_{layout}")
        model.save_pretrained(out)  # written back in the layout read
        saved = SafetensorsFolder(out)
        source = SafetensorsFolder(os.path.join(root, layout))
        if sorted(saved.names()) != sorted(source.names()):
            problems.append(f"{layout}: saved names differ from the source's")
        elif topo.rank == 0:
            for name in source.names():
                if not np.array_equal(saved.read(name), source.read(name)):
                    problems.append(f"{layout}: saved {name} differs")
    return problems


def check_resume(root):
    """Two steps under ep2 with ZeRO-1 over expert-dp, saved; the third step resumed under ep1 and
    under ep4 equals the third step of one process."""
    import mindspore as ms

    import mm_parallel
    from mm_parallel import ParallelConfig, comm
    from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig
    from mm_parallel.testing.equivalence import OPTIM, dp_part, full_arrays, train

    model_spec, data, problems = spec(), batch(), []
    folder, saved = os.path.join(root, "base"), os.path.join(root, "resume")
    solo = mm_parallel.topology.Topology.build(ParallelConfig(), 1, 0)
    want = train(model_spec, folder, solo, {}, data, steps=3)

    def steps(topo, source, count, opt_state=None):
        (model,) = model_spec.build(source, topo, {})
        opt = DistributedOptimizer(model, OptimizerConfig(**OPTIM), topo)
        if opt_state:
            opt.load(opt_state)
        local, params, losses = dp_part(model_spec, data, topo), model.trainable_params(), []
        for _ in range(count):
            loss, grads = ms.value_and_grad(lambda: model_spec.loss(model, local), None, params)()
            losses.append(float((comm.all_reduce(loss, topo.dp) / topo.dp.size).asnumpy()))
            opt.step(grads)
        return model, opt, losses

    topo = mm_parallel.initialize(ParallelConfig(ep=2, zero_stage=1))
    model, opt, first = steps(topo, folder, 2)
    model.save_pretrained(saved)
    opt.save(saved)
    if not np.allclose(first, want[0][:2], rtol=1e-5):
        problems.append(f"ep2 losses {first} != {want[0][:2]}")
    for ep in (1, 4):
        topo = mm_parallel.initialize(ParallelConfig(ep=ep))
        model, _, last = steps(topo, saved, 1, opt_state=saved)
        if not np.allclose(last, want[0][2:], rtol=1e-5):
            problems.append(f"resumed ep{ep}: loss {last} != {want[0][2:]}")
        for name, value in full_arrays(model_spec, [model], topo, model.trainable_params()).items():
            error = np.abs(value - want[2][name]).max() / max(np.abs(want[2][name]).max(), 1e-30)
            if error > 1e-4:
                problems.append(f"resumed ep{ep}: {name} rel err {error:.2e}")
    return problems


def run_moe_cases(root):
    """Everything above in one launch -> {name: [problems]}."""
    results = {}
    try:
        results.update(run_layout_cases(root))
    except Exception:
        results["layouts"] = [traceback.format_exc()]
    for name, check in (("loaded_layouts", check_loaded_layouts), ("resume", check_resume)):
        try:
            results[name] = check(root)
        except Exception:
            results[name] = [traceback.format_exc()]
    return results


__all__ = ["CASES", "E", "run_moe_cases"]
