"""`mm-train plan --explain`: a prediction broken into its terms and the assumptions behind them.

The step time of the plan's slowest rank is the sum of the terms `mm_train.plan.timing` counts:
compute per stack (its FLOPs over the peak times the compute efficiency), the pipeline bubble,
online encoding, the launch time of each stack's layer passes, the collectives of each group
(tp, cp, pp, the dp gradients, ZeRO-3's gathers), the optimizer's offload and GRPO's generation.
Each line gives the seconds, the share of the step and what was counted, so the term that drives
a prediction — and the assumption under it — is the one at the top.
"""

from __future__ import annotations

from typing import Dict, List


def explain(plan: Dict) -> str:
    """The table of ``plan``'s step terms (largest first) and its assumptions."""
    step = plan["step_time_s"]
    lines = [f"step {step:.4g} s on the slowest rank, term by term (largest first):",
             f"  {'term':<40} {'seconds':>9} {'share':>6}  what it counts"]
    for name, seconds, what in sorted(plan["terms"], key=lambda term: -term[1]):
        lines.append(f"  {name:<40} {seconds:>9.4g} {seconds / step:>6.1%}  {what}")
    return "\n".join(lines + assumptions(plan))


def assumptions(plan: Dict) -> List[str]:
    """What the terms rest on: the device's figures, the efficiencies and where they come from,
    the passes per sample and whose pipeline runs them."""
    a = plan["assumptions"]
    e = a["efficiency"]
    group = a["calibration"]
    source = (f"calibration group {group}, fitted on {e.get('framework', 'torch_npu')} runs: {e['figures']} "
              "(benchmarks/plan_calibration.py)") if group and "figures" in e else \
        "devices.yaml's shared efficiency (this device has no calibration group)"
    p = a["passes"]
    pipeline = "a stage's backward runs its forward again (MindSpore PyNative)" if a["framework"] == "mm" else \
        f"{a['framework']}'s pipeline keeps the forward's graph"
    return [
        "assumptions:",
        f"  efficiencies: compute {e['compute']:.3g} of the peak, {e['layer_pass_ms']:.3g} ms per layer pass, online "
        f"encoding {e['encode']:.3g}, links {e['communication']:.3g} — {source}",
        f"  passes per sample: a trained stack {p['trained']:.3g} forwards (recomputed share {p['recomputed']:.3g}; a "
        f"LoRA backward computes no weight gradient), a frozen one {p['frozen']} (1 where the stage keeps its output); "
        f"{pipeline}",
        f"  {a['micro_batches']} micro-batches per data-parallel rank and step; {plan['batch_samples']} samples a step",
        f"  throughput: {plan['samples_per_s']:.4g} samples/s and {plan['tokens_per_s']:.4g} tokens/s on the "
        f"{plan['devices']} devices, {plan['tokens_per_s_per_device']:.4g} tokens/s per device",
    ]
