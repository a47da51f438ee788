"""Workloads for the profiler tests: each step runs one operator no other step runs, so the
operators in a trace tell exactly which steps it captured."""

STEP_OPS = {1: "Exp", 2: "Sin", 3: "Cos", 4: "Tanh", 5: "Sigmoid"}


def run_steps(save_path: str, start: int, end: int, ranks, steps: int = 5):
    """Train-loop-shaped run under StepProfiler; returns (this rank, steps it reports captured)."""
    import numpy as np
    from mindspore import Tensor, ops

    import mm_parallel
    from mm_profiling.config import ProfileConfig
    from mm_profiling.control import StepProfiler

    topo = mm_parallel.initialize(mm_parallel.ParallelConfig())
    functions = {"Exp": ops.exp, "Sin": ops.sin, "Cos": ops.cos, "Tanh": ops.tanh, "Sigmoid": ops.sigmoid}
    profiler = StepProfiler(ProfileConfig(enable=True, start_step=start, end_step=end, ranks=list(ranks),
                                          save_path=save_path), rank=topo.rank)
    x = Tensor(np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32))
    for step in range(1, steps + 1):
        profiler.before_step(step)
        functions[STEP_OPS[step]](x).asnumpy()
        profiler.after_step(step)
    profiler.close()
    return topo.rank, profiler.captured
