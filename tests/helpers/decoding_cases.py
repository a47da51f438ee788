"""Decoding (mm_parallel.decoding) under a layout vs one process, inside one msrun launch.

Four left-padded prompts, each with its own picture of its own size; a data-parallel rank
decodes its share of them (rank d of D: prompts d, d + D, ...), greedily and sampled (two copies
per prompt, each row's stream keyed by its prompt's number in the whole batch). Tokens must equal
the one-process decoding of the same prompts exactly: the cache on each pipeline stage, logits
gathered over tp, the sequence made whole under cp / sp, ranks that gather ZeRO-3 weights or
exchange experts stopping together (each dp rank's rows stop at different steps).
"""

from __future__ import annotations

import contextlib
import traceback

import numpy as np

GRIDS = [(1, 4, 4), (1, 8, 4), (1, 4, 8), (1, 8, 8)]
STEPS = 8
SAMPLED = dict(do_sample=True, temperature=1.3, top_k=40, top_p=0.95)


def prompts(family: str = "qwen2_5_vl", seed: int = 0):
    """The four prompts (text, the picture, text of different lengths), left-padded, with
    ``mm_token_type_ids``, in the family's layout (its tests/helpers reference module)."""
    import importlib

    modules = {"qwen2_5_vl": "qwen_vl_reference", "qwen2_5_omni": "omni_reference", "qwen3_vl": "qwen3_vl_reference"}
    reference = importlib.import_module("helpers." + modules[family])
    image, patch_dim = reference.IMAGE, reference.PATCH_DIM
    rng = np.random.default_rng(seed)
    rows = [rng.integers(3, 240, 2 + i).tolist() + [reference.START] + [image] * reference.merged(g) + [reference.END]
            + rng.integers(3, 240, 5 - i).tolist() for i, g in enumerate(GRIDS)]
    length = max(map(len, rows))
    ids, mask = np.zeros((len(rows), length), np.int64), np.zeros((len(rows), length), np.int64)
    for i, row in enumerate(rows):
        ids[i, length - len(row):], mask[i, length - len(row):] = row, 1
    return {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": (ids == image).astype(np.int64),
            "pixel_values": rng.standard_normal((sum(int(np.prod(g)) for g in GRIDS), patch_dim)).astype(np.float32),
            "image_grid_thw": np.array(GRIDS, np.int64)}


def prompt_rows(inputs: dict, rows) -> dict:
    """The prompts ``rows`` (indices) with their pictures."""
    sizes = np.prod(inputs["image_grid_thw"], 1)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    out = {k: inputs[k][rows] for k in ("input_ids", "attention_mask", "mm_token_type_ids")}
    out["pixel_values"] = np.concatenate([inputs["pixel_values"][starts[r]:starts[r + 1]] for r in rows])
    out["image_grid_thw"] = inputs["image_grid_thw"][rows]
    return out


def decode_all(chunks, topo, inputs: dict, rows, stop_tokens):
    """{"greedy": tokens, "sampled": tokens} of the prompts ``rows`` (their numbers key the draws)."""
    from mm_parallel.decoding import decode
    from mm_parallel.sampling import Sampling

    part = prompt_rows(inputs, rows)
    greedy = decode(chunks, part, STEPS, Sampling(), stop_tokens, pad_id=0, topology=topo)
    sampled = decode(chunks, part, STEPS, Sampling(**SAMPLED), stop_tokens, pad_id=0, copies=2, seed=11,
                     keys=[(r, c) for r in rows for c in range(2)], topology=topo)
    return {"greedy": _steps(greedy.tokens), "sampled": _steps(sampled.tokens)}


def _steps(tokens):
    """STEPS columns: rows that all stopped early end in pads (pad_id 0), as decoding longer would give."""
    return np.pad(tokens, ((0, 0), (0, STEPS - tokens.shape[1]))).tolist()


def run_decoding_cases(path, cases, family, stop_tokens):
    """cases: {name: {"layout": ParallelConfig kwargs, "lora", "checkpoint"}} -> {name: {"rows":
    this rank's prompts, "greedy", "sampled"} or {"error": traceback}}."""
    import os

    from helpers.qwen_vl_parallel_cases import build

    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig

    results, inputs = {}, prompts(family)
    for name, case in cases.items():
        try:
            topo = mm_parallel.initialize(ParallelConfig(**case["layout"]))
            chunks = build(os.path.join(path, case.get("checkpoint", "")), topo, case)
            if topo.config.zero_stage == 3:  # the optimizer cuts the weights (mm_parallel.zero3)
                DistributedOptimizer(chunks[0] if len(chunks) == 1 else chunks, OptimizerConfig(lr=1e-3), topo)
            rows = list(range(topo.dp.rank, len(GRIDS), topo.dp.size))
            with _device(case) as calls:
                results[name] = {"rows": rows, **decode_all(chunks, topo, inputs, rows, stop_tokens)}
            if calls is not None:
                results[name]["stand_ins"] = sorted(set(calls))
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results


@contextlib.contextmanager
def _device(case):
    """The Ascend path on its CPU stand-ins for a case with "device": "ascend_stand_ins" (yields the
    calls made), else nothing (yields None)."""
    if case.get("device") != "ascend_stand_ins":
        yield None
        return
    from mm_parallel.testing.device_path import ascend_stand_ins

    with ascend_stand_ins() as calls:
        yield calls


def check_decoding(results, expected):
    """Every rank's tokens equal one process's of the same prompts (``expected``: decode_all of all rows)."""
    for rank, result in enumerate(results):
        for name, got in result.items():
            assert "error" not in got, (rank, name, got.get("error"))
            assert "stand_ins" not in got or "flash_attention_score" in got["stand_ins"], (name, got["stand_ins"])
            rows = got["rows"]
            want_greedy = np.asarray(expected["greedy"])[rows]
            want_sampled = np.asarray(expected["sampled"]).reshape(len(GRIDS), 2, -1)[rows].reshape(2 * len(rows), -1)
            np.testing.assert_array_equal(got["greedy"], want_greedy, err_msg=f"{name} rank {rank} greedy")
            np.testing.assert_array_equal(got["sampled"], want_sampled, err_msg=f"{name} rank {rank} sampled")


def one_process(folder, family: str, stop_tokens):
    """decode_all of every prompt by the checkpoint at ``folder`` in one process."""
    from helpers.qwen_vl_parallel_cases import build

    from mm_parallel import ParallelConfig
    from mm_parallel.topology import Topology

    solo = Topology.build(ParallelConfig(), 1, 0)
    return decode_all(build(str(folder), solo, {}), solo, prompts(family), list(range(len(GRIDS))), stop_tokens)


def check_layouts_decode_alike(run_distributed, nproc: int, checkpoints, cases, family: str):
    """Run ``cases`` on ``nproc`` workers and compare each checkpoint's with one process; the stop
    token is one prompt 1 makes third, so the prompts (and the dp ranks) stop at different steps."""
    folders = sorted({case.get("checkpoint", "") for case in cases.values()})
    stops = {folder: [one_process(checkpoints / folder, family, ())["greedy"][1][2]] for folder in folders}
    expected = {folder: one_process(checkpoints / folder, family, stops[folder]) for folder in folders}
    for want in expected.values():
        assert len(set(map(tuple, want["greedy"]))) == len(want["greedy"])
        assert want["sampled"][0] != want["sampled"][1]  # a prompt's two copies drew their own
    for folder in folders:
        names = {name: case for name, case in cases.items() if case.get("checkpoint", "") == folder}
        results = run_distributed(run_decoding_cases, nproc=nproc, timeout=600, path=str(checkpoints), cases=names,
                                  family=family, stop_tokens=stops[folder])
        check_decoding(results, expected[folder])
