"""Context-parallel attention against one process, inside msrun workers: the full q, k, v and the
cotangent are split with split_sequence, the outputs and input gradients gathered back."""

from __future__ import annotations

import traceback

import numpy as np

B, S, N, D = 2, 16, 4, 8


def run_cp_cases(layouts):
    import mindspore as ms
    from mindspore import Tensor

    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.context_parallel import attention, gather_sequence, split_sequence
    from mm_parallel.ops import attention as reference

    rng = np.random.default_rng(5)
    results = {}
    for name, layout in layouts.items():
        for kv_heads in (N, 2):
            for causal in (False, True):
                case = f"{name}/kv{kv_heads}/{'causal' if causal else 'full'}"
                try:
                    topo = mm_parallel.initialize(ParallelConfig(**layout))
                    q = rng.standard_normal((B, S, N, D)).astype(np.float32)
                    k, v = (rng.standard_normal((B, S, kv_heads, D)).astype(np.float32) for _ in range(2))
                    c = rng.standard_normal((B, S, N, D)).astype(np.float32)
                    full = [Tensor(a) for a in (q, k, v)]
                    f_ref = lambda a, b, d: (reference(a, b, d, causal=causal) * Tensor(c)).sum()
                    ref_out = reference(*full, causal=causal).asnumpy()
                    ref_grads = [g.asnumpy() for g in ms.grad(f_ref, grad_position=(0, 1, 2))(*full)]

                    local = [split_sequence(t, 1, topo) for t in full]
                    c_local = split_sequence(Tensor(c), 1, topo)
                    f = lambda a, b, d: (attention(a, b, d, causal=causal, topology=topo) * c_local).sum()
                    out = gather_sequence(attention(*local, causal=causal, topology=topo), 1, topo).asnumpy()
                    grads = [gather_sequence(g, 1, topo).asnumpy() for g in ms.grad(f, grad_position=(0, 1, 2))(*local)]
                    problems = []
                    if not np.allclose(out, ref_out, rtol=1e-4, atol=1e-5):
                        problems.append(f"output max err {np.abs(out - ref_out).max()}")
                    for label, g, want in zip("qkv", grads, ref_grads):
                        if not np.allclose(g, want, rtol=1e-4, atol=1e-5):
                            problems.append(f"grad {label} max err {np.abs(g - want).max()}")
                    results[case] = problems
                except Exception:
                    results[case] = [traceback.format_exc()]
    for name, layout in layouts.items():  # a sequence padded at its end: key_length masks the padding
        for causal in (False, True):
            case = f"{name}/padded/{'causal' if causal else 'full'}"
            try:
                results[case] = _padded_case(layout, causal, rng)
            except Exception:
                results[case] = [traceback.format_exc()]
    for name, layout in layouts.items():  # packed samples: segment ids of the whole row on every rank
        for causal in (False, True):
            case = f"{name}/packed/{'causal' if causal else 'full'}"
            try:
                results[case] = _packed_case(layout, causal, rng)
            except Exception:
                results[case] = [traceback.format_exc()]
    # the layout round trip on its own: positions survive split and gather
    for name, layout in layouts.items():
        topo = mm_parallel.initialize(ParallelConfig(**layout))
        positions = Tensor(np.arange(2 * S, dtype=np.int32)[None])
        back = gather_sequence(split_sequence(positions, 1, topo), 1, topo).asnumpy()
        results[f"{name}/round_trip"] = [] if np.array_equal(back, positions.asnumpy()) else [f"got {back}"]
    return results


def _padded_case(layout, causal, rng, pad: int = 3):
    """S - pad real rows padded to S: the real rows' outputs and q / k / v gradients equal plain
    attention over the real rows alone; the padding gets no gradient."""
    import mindspore as ms
    from mindspore import Tensor

    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.context_parallel import attention, gather_sequence, split_sequence
    from mm_parallel.ops import attention as reference

    topo = mm_parallel.initialize(ParallelConfig(**layout))
    real = S - pad
    q, k, v, c = (rng.standard_normal((B, S, N, D)).astype(np.float32) for _ in range(4))
    c[:, real:] = 0.0  # the padded queries' outputs are dropped
    f_ref = lambda a, b, d: (reference(a, b, d, causal=causal) * Tensor(c[:, :real])).sum()
    short = [Tensor(t[:, :real]) for t in (q, k, v)]
    ref_out = reference(*short, causal=causal).asnumpy()
    ref_grads = [g.asnumpy() for g in ms.grad(f_ref, grad_position=(0, 1, 2))(*short)]
    local = [split_sequence(Tensor(t), 1, topo) for t in (q, k, v)]
    c_local = split_sequence(Tensor(c), 1, topo)
    run = lambda a, b, d: attention(a, b, d, causal=causal, key_length=real, topology=topo)
    out = gather_sequence(run(*local), 1, topo).asnumpy()[:, :real]
    grads = [gather_sequence(g, 1, topo).asnumpy() for g in
             ms.grad(lambda a, b, d: (run(a, b, d) * c_local).sum(), grad_position=(0, 1, 2))(*local)]
    problems = [] if np.allclose(out, ref_out, rtol=1e-4, atol=1e-5) else [f"output {np.abs(out - ref_out).max()}"]
    for label, g, want in zip("qkv", grads, ref_grads):
        if not np.allclose(g[:, :real], want, rtol=1e-4, atol=1e-5) or np.abs(g[:, real:]).max() > 0:
            problems.append(f"grad {label}")
    return problems


def _packed_case(layout, causal, rng):
    """A batch of one holding four samples (lengths crossing every chunk boundary) and end padding
    (segment 0): outputs and q / k / v gradients equal one process's segment-masked attention."""
    import mindspore as ms
    from mindspore import Tensor

    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.context_parallel import attention, gather_sequence, split_sequence
    from mm_parallel.ops import attention as reference

    topo = mm_parallel.initialize(ParallelConfig(**layout))
    segments = np.repeat([1, 2, 3, 4, 0], [7, 12, 3, 6, 4])[None].astype(np.float32)
    length = segments.shape[1]
    q, k, v, c = (rng.standard_normal((1, length, N, D)).astype(np.float32) for _ in range(4))
    whole = [Tensor(t) for t in (q, k, v)]
    run_ref = lambda a, b, d: reference(a, b, d, causal=causal, segment_ids=Tensor(segments))  # noqa: E731
    ref_out = run_ref(*whole).asnumpy()
    ref_grads = [g.asnumpy() for g in ms.grad(lambda a, b, d: (run_ref(a, b, d) * Tensor(c)).sum(),
                                              grad_position=(0, 1, 2))(*whole)]
    local = [split_sequence(t, 1, topo) for t in whole]
    c_local = split_sequence(Tensor(c), 1, topo)
    run = lambda a, b, d: attention(a, b, d, causal=causal, segment_ids=Tensor(segments), topology=topo)  # noqa: E731
    out = gather_sequence(run(*local), 1, topo).asnumpy()
    grads = [gather_sequence(g, 1, topo).asnumpy() for g in
             ms.grad(lambda a, b, d: (run(a, b, d) * c_local).sum(), grad_position=(0, 1, 2))(*local)]
    problems = [] if np.allclose(out, ref_out, rtol=1e-4, atol=1e-5) else [f"output {np.abs(out - ref_out).max()}"]
    for label, g, want in zip("qkv", grads, ref_grads):
        if not np.allclose(g, want, rtol=1e-4, atol=1e-5):
            problems.append(f"grad {label} {np.abs(g - want).max()}")
    return problems
