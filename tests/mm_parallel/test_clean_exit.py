"""A process that used mm ends with exit status 0 (mm_parallel.clean_exit): a script comparing our
Wan with diffusers' on the same weights — torch and MindSpore in one process, 3 heads, odd latent
sizes, T2V and I2V, what a library user writes — run under AddressSanitizer (preloaded: glibc
alone caught the fault in 1-3 runs of 4, AddressSanitizer in every one). Without the release the
same script faults in MindSpore's teardown: the check can fail."""

import subprocess
import sys
from pathlib import Path

import diffusers  # noqa: F401  (the reference the script compares with: required, see tests/conftest.py)

TESTS = Path(__file__).resolve().parents[1]
SCRIPT = f"""
import atexit, sys, tempfile
from pathlib import Path

import numpy as np

import mm_parallel
from mm_parallel import clean_exit

sys.path.insert(0, {str(TESTS)!r})
from helpers.torch_reference import rel_err
from helpers.wan_reference import inputs, our_forward, reference_forward, write_reference
from mm_models_video import WanTransformer3DModel

if sys.argv[1:] == ["--without-release"]:
    atexit.unregister(clean_exit.release_last_operator)
root = Path(tempfile.mkdtemp())
for i2v in (False, True):
    reference = write_reference(root / str(i2v), i2v=i2v, num_attention_heads=3)
    batch = inputs(np.random.default_rng(1), i2v=i2v, frames=5, size=(6, 10))
    model = WanTransformer3DModel.from_pretrained(root / str(i2v))
    _, want, _ = reference_forward(reference, batch, backward=False)
    _, got, _ = our_forward(model, batch, backward=False)
    assert rel_err(got, want) <= 1e-5, rel_err(got, want)
    print("i2v" if i2v else "t2v", "equal")
"""


def _asan() -> str:
    """libasan of the g++ the native kernels need (.ci/run installs it)."""
    found = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    assert Path(found).is_file(), f"g++ has no libasan.so ({found!r}): install g++ (apt-get install g++)"
    return found


def _run(tmp_path, *args):
    script = tmp_path / "compare_wan.py"
    script.write_text(SCRIPT)
    env = {"LD_PRELOAD": _asan(), "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1", "GLOG_v": "3",
           "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600,
                          env=env, cwd=tmp_path)


def test_a_comparison_with_diffusers_exits_cleanly(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["t2v", "equal", "i2v", "equal"], done.stdout


def test_without_the_release_the_same_script_faults_at_exit(tmp_path):
    done = _run(tmp_path, "--without-release")
    assert done.stdout.split() == ["t2v", "equal", "i2v", "equal"], done.stderr[-3000:]
    assert done.returncode != 0 and "FreeTensorMem" in done.stderr and "OpRunStatus" in done.stderr, \
        done.stderr[-3000:]
