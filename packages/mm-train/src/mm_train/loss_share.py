"""The loss of a whole global batch per answer token (or per sample): what each micro-batch divides by.

The loop averages a rank's micro-batch losses and the optimizer averages gradients over dp. If
micro-batch m of rank r divides its summed loss S_m by

    D_r = N / (n_r dp)        N: the counted answer tokens (or samples) of the whole global batch,
                              n_r: rank r's micro-batches (packed rows: it differs between ranks)

the step's loss and gradient are  (1/dp) sum_r (1/n_r) sum_m S_m n_r dp / N  =  sum_m S_m / N:
Megatron's per-token loss (``token``), or with ``sample`` the mean over the global batch's samples
of each sample's mean (each token weighted by one over its sample's count), the same packed or
not, under any layout. N is one all-reduce over dp per step; the model counts what it divides
(its ``loss_items``: the targets its loss counts, packed rows' boundaries dropped).
"""

from __future__ import annotations

from typing import Dict, List

import mindspore as ms
import numpy as np

from mm_parallel import comm


def with_loss_divisor(batches: List[Dict], model, mode: str, topo) -> List[Dict]:
    """``batches`` (forward keywords) with ``num_items_in_batch`` = D_r and ``loss_per_sample``."""
    per_sample = mode == "sample"
    total = float(sum(model.loss_items(batch, per_sample) for batch in batches))
    if topo.dp.size > 1:
        total = float(comm.all_reduce(ms.Tensor(np.array([total], np.float32)), topo.dp).asnumpy()[0])
    divisor = total / (len(batches) * topo.dp.size)
    return [{**batch, "num_items_in_batch": divisor, "loss_per_sample": per_sample} for batch in batches]
