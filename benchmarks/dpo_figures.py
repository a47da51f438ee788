"""What the tiny preference recipes learn, measured: a short SFT / pre-training start, then DPO from it.

    python benchmarks/dpo_figures.py

For each pair of recipes: `mm-train run START --set train.steps=N` saves its model at step N, then
`mm-train run DPO --set model.path=<that model>` trains the preference objective from it (the
reference is the start). Printed side by side for each: the loss at the first and the last step,
the mean reward margin (rewards/margins) over the first and the last ten steps — the margin must
rise — and the share of pairs ranked right (rewards/accuracies) over the last ten steps. The runs
are seeded: the figures repeat; the seconds vary with the shared machine.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from _recipe_runs import mean, run
from _recipe_runs import rows as metrics

RUNS = (  # (start recipe, its steps, preference recipe)
    ("qwen2_5_vl_tiny", 60, "qwen2_5_vl_tiny_dpo"),
    ("wan2_1_t2v_tiny", 100, "wan2_1_t2v_tiny_dpo"),
)


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="dpo_figures_"))
    try:
        for start, steps, dpo in RUNS:
            data = root / f"data_{start}"
            seconds = run(start, root / start, data, f"train.steps={steps}", f"checkpoint.every={steps}")
            model = root / start / "checkpoints" / f"step_{steps}" / "model"
            seconds += run(dpo, root / dpo, data, f"model.path={model}", "model.config={}")
            rows = metrics(root / dpo)
            first, last = rows[:10], rows[-10:]
            print(f"{dpo} from {steps} steps of {start}: loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} in "
                  f"{len(rows)} steps; margin {mean(first, 'rewards/margins'):.3f} (steps 1-10) -> "
                  f"{mean(last, 'rewards/margins'):.3f} (last 10); accuracy {mean(last, 'rewards/accuracies'):.2f} "
                  f"(last 10); {seconds:.0f} s both runs")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
