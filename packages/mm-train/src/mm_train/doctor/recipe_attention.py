"""The doctor's attention checks at the shapes of given recipes, and probes of the forms mm avoids.

``mm-train doctor --recipe NAME`` takes each attention call a sample of the recipe makes (the
family's workload: `mm_train.plan.workload.AttentionForm`), at the recipe's per-rank shapes
(heads and kv heads divided by tp and the Ulysses degree, tokens by cp, for the forms they
split), and runs mm's attention through the fused kernel and through the reference path,
forward and backward, reporting the shapes it tried. On Ascend the kernel is the device's, in
bf16 at the full shapes; on a CPU (which has no kernel) the fused branch runs on the stand-ins
in fp32 with sequences and batches capped (CPU_TOKENS, CPU_BATCH), so this code runs where it
is tested.

The probes call ``flash_attention_score`` in forms MindSpore 2.7.2's page forbids and mm no
longer uses, to record whether this CANN takes them: packed TND without the causal mask (mm
sends non-causal segments as a padded BSND batch instead) and head size 72 (mm pads it to 80).
A probe that is accepted and agrees with the reference path says the faster form could be taken
back on this cluster; one refused says the page is enforced. Neither is a failure.
"""

from __future__ import annotations

import traceback
from typing import Dict, List, Tuple

import numpy as np

from mm_train.doctor.kernels import TOLERANCE, compare_paths, fused_path, max_rel_error, reference_path
from mm_train.plan import model_config
from mm_train.recipe import load_recipe

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore).

CPU_TOKENS, CPU_BATCH = 256, 2  # the most tried on a CPU (the reference path keeps S x S scores)


def per_rank_shape(form, parallel, on_ascend: bool) -> Dict:
    """{batch, tokens, keys, heads, kv_heads, head_dim, causal, capped} of one kernel call of
    ``form`` on one rank of the recipe's ``parallel`` layout."""
    heads, kv_heads, tokens = form.heads, form.kv_heads, form.tokens
    if form.split:  # Ulysses trades its share of the sequence for a share of the heads; the ring keeps tokens / r
        heads //= parallel.tp * parallel.ulysses_size
        kv_heads = max(1, kv_heads // (parallel.tp * parallel.ulysses_size))
        tokens = -(-tokens // parallel.ring_size)
    segment = form.segment or tokens
    batch = max(1, tokens // segment)
    keys = form.keys or segment
    capped = not on_ascend and (max(segment, keys) > CPU_TOKENS or batch > CPU_BATCH)
    if capped:
        segment, keys, batch = min(segment, CPU_TOKENS), min(keys, CPU_TOKENS), min(batch, CPU_BATCH)
    return {"batch": batch, "tokens": segment, "keys": keys, "heads": max(1, heads), "kv_heads": kv_heads,
            "head_dim": form.head_dim, "causal": form.causal, "capped": capped}


def _attention_case(shape: Dict):
    """(fn, input shapes) of mm's attention at one per-rank shape."""
    from mm_parallel import ops as kernels

    b, s, k = shape["batch"], shape["tokens"], shape["keys"]
    q_shape = (b, s, shape["heads"], shape["head_dim"])
    kv_shape = (b, k, shape["kv_heads"], shape["head_dim"])
    return (lambda q, key, v: kernels.attention(q, key, v, causal=shape["causal"])), [q_shape, kv_shape, kv_shape]


def _describe(shape: Dict) -> str:
    keys = "" if shape["keys"] == shape["tokens"] else f" x {shape['keys']} keys"
    return (f"{shape['batch']} x {shape['tokens']} tokens{keys}, {shape['heads']} heads ({shape['kv_heads']} kv) of "
            f"{shape['head_dim']}{', causal' if shape['causal'] else ''}"
            f"{f' (capped at {CPU_BATCH} x {CPU_TOKENS} on a CPU)' if shape['capped'] else ''}")


def check_recipe_attention(recipes: List[Tuple[str, List[str]]], on_ascend: bool) -> List[dict]:
    """One row per attention form of each (recipe name or path, overrides) at its per-rank shape."""
    rows = []
    for name, overrides in recipes:
        try:
            recipe = load_recipe(name, overrides)
            forms = recipe.family.workload(recipe, model_config(recipe, True)[1]).attention
        except Exception:  # noqa: BLE001 - reported per recipe
            rows.append({"check": f"attention of {name}", "status": "fail", "seconds": 0.0,
                         "detail": traceback.format_exc(limit=3)})
            continue
        for form in forms:
            shape = per_rank_shape(form, recipe.parallel, on_ascend)
            fn, shapes = _attention_case(shape)
            result = compare_paths(fn, shapes, "flash_attention_score", "bf16" if on_ascend else "fp32", on_ascend)
            rows.append({"check": f"attention of {name}: {form.name}", "status": "pass" if result["ok"] else "fail",
                         "seconds": result["seconds"], "detail": f"{_describe(shape)}: {result['detail']}"})
    return rows


def _probe(kernel_call, reference_call, on_ascend: bool) -> str:
    """What the kernel did with a form: refused, or accepted and how far from the reference path."""
    with reference_path():
        want = reference_call()
    try:
        with fused_path(on_ascend):
            got = kernel_call()
    except Exception as exc:  # noqa: BLE001 - a refusal is the finding
        return f"refused by this device's flash_attention_score: {str(exc).strip().splitlines()[0][:200]}"
    error = max_rel_error([got], [want])
    verdict = "agrees with" if error <= TOLERANCE["bf16"] else "DISAGREES with"
    return f"accepted; {verdict} the reference path (max rel error {error:.1e})"


def probe_undocumented_forms(on_ascend: bool) -> List[dict]:
    """Rows recording whether the kernel takes the forms the page forbids (module docstring)."""
    import mindspore as ms
    from mindspore import Tensor, ops

    from mm_parallel.ops.attention import attention

    rng = np.random.default_rng(0)
    dtype = ms.bfloat16 if on_ascend else ms.float16

    def tensors(*shape):
        return [Tensor(rng.standard_normal(shape).astype(np.float32)).astype(dtype) for _ in range(3)]

    def as_array(out):
        return out.astype(ms.float32).asnumpy()

    packed, ids = tensors(24, 2, 128), Tensor(np.repeat([0, 1], [10, 14])[None].astype(np.int32))
    wide = tensors(1, 16, 2, 72)
    probes = [
        ("packed TND without the causal mask",
         lambda: as_array(ops.flash_attention_score(*packed, 2, actual_seq_qlen=[10, 24], actual_seq_kvlen=[10, 24],
                                                    scalar_value=128 ** -0.5, input_layout="TND")),
         lambda: as_array(attention(*(t.astype(ms.float32)[None] for t in packed), segment_ids=ids)[0])),
        ("head size 72",
         lambda: as_array(ops.flash_attention_score(*wide, 2, scalar_value=72 ** -0.5, input_layout="BSND")),
         lambda: as_array(attention(*(t.astype(ms.float32) for t in wide)))),
    ]
    return [{"check": f"undocumented form: {name}", "status": "pass", "seconds": 0.0,
             "detail": _probe(kernel_call, reference_call, on_ascend)} for name, kernel_call, reference_call in probes]
