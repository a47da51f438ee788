"""What the DiT families' layout tests share: building a rank's planned chunks."""

from __future__ import annotations

import os


def build_chunks(model_class, plan, path, topo, case):
    """This rank's chunks of ``model_class`` (one without virtual pipeline stages) loaded from
    ``path`` and planned by ``plan`` (a family's parallel_plan module) as ``case`` says: recompute
    (one block for "block"), LoRA r=4 with PEFT adapters read from ``path/adapters``."""
    chunks = []
    for chunk in range(topo.config.vpp):
        model = model_class.from_pretrained(path, topology=topo, chunk=chunk)
        plan.parallelize(model, recompute=case.get("recompute", "none"), recompute_num_layers=1,
                         lora=plan.LoraConfig(r=4, alpha=8.0) if case.get("lora") else None)
        if case.get("lora"):
            model.load_adapter(os.path.join(path, "adapters"))
        chunks.append(model)
    return chunks
