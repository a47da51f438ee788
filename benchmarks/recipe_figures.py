"""The training figures the READMEs quote for the tiny recipes, measured, beside what they say.

    python benchmarks/recipe_figures.py            # run each recipe, print README vs measured
    python benchmarks/recipe_figures.py --write    # ... and write the measured figures into the READMEs
    python benchmarks/recipe_figures.py --check    # only find every quoted figure (no training)

Each figure is a sentence of a README ("loss 5.74 -> 0.30 in 200 steps, 62.5 s") tied to the
command that produces it: `mm-train run RECIPE --set train.steps=N` in a fresh folder, timed from
start to exit (the launch, data generation and the feature cache included, as a user sees it).
The loss figures come from the run's own final line. So the READMEs' timings are this script's
output, not typed; `--check` (run by the test suite) fails when a README no longer holds a
sentence this script knows, so the two cannot drift apart unnoticed. The machine is shared:
seconds vary by run; the losses are deterministic.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"loss (?P<first>[\d.]+) -> (?P<last>[\d.]+) in (?P<steps>\d+) steps")


@dataclass(frozen=True)
class Figure:
    readme: str  # relative to the repository
    before: str  # the text just before the figure (anchors it in the README)
    recipe: str
    steps: int

    def pattern(self) -> re.Pattern:
        return re.compile(re.escape(self.before) + r"(\s+)loss (?P<first>[\d.]+) -> (?P<last>[\d.]+) in "
                          rf"{self.steps} steps, (?P<seconds>[\d.]+) s")

    def quoted(self) -> re.Match:
        match = self.pattern().search((ROOT / self.readme).read_text())
        if match is None:
            raise SystemExit(f"{self.readme} no longer quotes the {self.recipe} figure after {self.before!r}; "
                             "update FIGURES in benchmarks/recipe_figures.py")
        return match


TRAIN = "packages/mm-train/README.md"
FIGURES = (
    Figure(TRAIN, "read back through mm-data like any user's set. Measured here:", "qwen2_5_vl_tiny", 200),
    Figure(TRAIN, "DeepStack, interleaved M-RoPE) on the default's pictures at 64 x 64:", "qwen3_vl_tiny", 60),
    Figure(TRAIN, "a tiny random Qwen3-VL-MoE (4 experts, top 2, aux loss):", "qwen3_vl_moe_tiny", 60),
    Figure(TRAIN, "Measured on the tiny T2V recipe:", "wan2_1_t2v_tiny", 100),
)


def measure(figure: Figure, folder: Path) -> dict:
    """Run the figure's recipe in ``folder`` (its data generated there too); its loss and seconds."""
    command = shutil.which("mm-train", path=os.path.dirname(sys.executable)) or "mm-train"
    env = {**os.environ, "MM_TRAIN_DATA": str(folder / "vl_data"), "MM_TRAIN_VIDEO_DATA": str(folder / "video_data")}
    start = time.perf_counter()
    result = subprocess.run([command, "run", figure.recipe, "--set", f"train.steps={figure.steps}", "--set",
                             f"output_dir={folder / figure.recipe}", "--no-progress"], env=env,
                            capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"mm-train run {figure.recipe} failed:\n{result.stderr[-2000:]}")
    line = LINE.search(result.stderr.strip().splitlines()[-1])
    return {"first": f"{float(line['first']):.2f}", "last": f"{float(line['last']):.2f}", "seconds": f"{seconds:.0f}"}


def write(figure: Figure, got: dict) -> None:
    path = ROOT / figure.readme
    text = path.read_text()
    match = figure.quoted()
    new = f"{figure.before}{match.group(1)}loss {got['first']} -> {got['last']} in {figure.steps} steps, " \
          f"{got['seconds']} s"
    path.write_text(text[:match.start()] + new + text[match.end():])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the measured figures into the READMEs")
    parser.add_argument("--check", action="store_true", help="only find every quoted figure")
    args = parser.parse_args()
    quoted = [figure.quoted() for figure in FIGURES]
    if args.check:
        print(f"{len(FIGURES)} figures found in the READMEs")
        return
    print(f"{'recipe':<20} {'steps':>5}  {'README: loss, s':<26} {'measured: loss, s':<26}")
    with tempfile.TemporaryDirectory() as folder:
        for figure, match in zip(FIGURES, quoted):
            got = measure(figure, Path(folder))
            print(f"{figure.recipe:<20} {figure.steps:>5}  "
                  f"{match['first'] + ' -> ' + match['last'] + ', ' + match['seconds']:<26} "
                  f"{got['first'] + ' -> ' + got['last'] + ', ' + got['seconds']:<26}", flush=True)
            if args.write:
                write(figure, got)


if __name__ == "__main__":
    main()
