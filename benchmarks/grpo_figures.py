"""What the tiny GRPO recipe learns, measured: the short SFT start, then GRPO from it, on one process and on two.

    python benchmarks/grpo_figures.py [--steps 60]

`mm-train run qwen2_5_vl_tiny_colours` (the colour question, 60 SFT steps) saves the start, then
`mm-train run qwen2_5_vl_tiny_grpo` trains from it — once on one process and once with --nproc 2
(data parallel: each rank its share of the prompts, the rollouts keyed by prompt, so the two runs
draw the same completions). Printed side by side: the mean accuracy reward (the share of sampled
answers naming the right colour) over the first and the last ten steps of each, the mean share of
step time spent generating, and the seconds. The runs are seeded: the figures repeat; the seconds
vary with the shared machine.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from _recipe_runs import mean, run
from _recipe_runs import rows as metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="GRPO steps")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="grpo_figures_"))
    try:
        data = root / "data"
        seconds = run("qwen2_5_vl_tiny_colours", root / "start", data)
        model = root / "start" / "checkpoints" / "step_60" / "model"
        print(f"qwen2_5_vl_tiny_colours: 60 SFT steps, {seconds:.0f} s")
        for nproc in (1, 2):
            out = root / f"grpo_{nproc}"
            seconds = run("qwen2_5_vl_tiny_grpo", out, data, f"model.path={model}", f"train.steps={args.steps}",
                          nproc=nproc)
            rows = metrics(out)
            first, last = rows[:10], rows[-10:]
            print(f"qwen2_5_vl_tiny_grpo on {nproc} process{'es' if nproc > 1 else ''}: accuracy reward "
                  f"{mean(first, 'reward'):.3f} (steps 1-10) -> {mean(last, 'reward'):.3f} (last 10) in {len(rows)} "
                  f"steps; generating {mean(rows, 'generation_share'):.0%} of a step; {seconds:.0f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
