"""Megatron's training flags (as MindSpeed-MM's launch scripts pass them) as recipe keys.

The world comes from the launcher's own flags (msrun --worker_num / --local_worker_num, torchrun
--nnodes / --nproc_per_node); the batch from --micro-batch-size and --global-batch-size; the
layout, recomputation, optimizer and schedule from theirs. Flags that only steer Megatron's own
machinery (fused kernels, tokenizer type, checkpoint format, ...) are listed as such; any other
unknown flag is listed as having no mm equivalent.
"""

from __future__ import annotations

import re
from typing import Dict, Optional

from mm_train.families.importing.imported import Imported
from mm_train.families.importing.shell import UNKNOWN, Script, flags

CP_ALGOS = {"ulysses_cp_algo": "ulysses", "megatron_cp_algo": "ring", "hybrid_cp_algo": "hybrid"}
SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant"}
# Megatron's fused projections (and MindSpeed-MM's Wan DiT names) as the Hugging Face / diffusers
# modules mm's LoRA targets
LORA_NAMES = {"linear_qkv": ["q_proj", "k_proj", "v_proj"], "linear_proj": ["o_proj"],
              "linear_fc1": ["gate_proj", "up_proj"], "linear_fc2": ["down_proj"],
              "proj_qkv": ["to_q", "to_k", "to_v"], "proj_q": ["to_q"], "proj_k": ["to_k"], "proj_v": ["to_v"],
              "proj_out": ["to_out.0"],
              "ffn.0": ["ffn.net.0.proj"], "ffn.2": ["ffn.net.2"]}
# flags that steer only Megatron's machinery (fused kernels, tokenizer, checkpoint format, data loading)
# or that mm decides itself: read, and named in the recipe's header as not needed
MACHINERY = {"use-mcore-models", "use-flash-attn", "use-fused-rmsnorm", "use-fused-swiglu", "use-fused-rotary-pos-emb",
             "swiglu", "normalization", "tokenizer-type", "vocab-size", "make-vocab-size-divisible-by", "seq-length",
             "variable-seq-lengths", "no-load-optim", "no-load-rng", "no-save-optim", "no-save-rng", "num-workers",
             "ckpt-format", "distributed-backend", "ai-framework", "mm-tool", "log-interval", "eval-interval",
             "eval-iters", "no-gradient-accumulation-fusion", "no-masked-softmax-fusion", "overlap-grad-reduce",
             "overlap-param-gather", "use-ascend-mc2", "lr-warmup-init", "fsdp2-config-path",
             "use-cpu-initialization", "init-model-with-meta-device", "log-tps", "untie-embeddings-and-output-weights",
             "optimizer-selection", "distributed-timeout-minutes", "lora-register-forward-hook", "qk-layernorm",
             "allow-tf32"}
# flags this module maps to recipe keys
MAPPED = {"mm-data", "mm-model", "use-distributed-optimizer", "sequence-parallel", "bf16", "fp16",
          "tensor-model-parallel-size", "pipeline-model-parallel-size", "virtual-pipeline-model-parallel-size",
          "num-layers-per-virtual-pipeline-stage", "context-parallel-size", "context-parallel-algo",
          "ulysses-degree-in-cp", "expert-model-parallel-size", "micro-batch-size", "global-batch-size", "lr",
          "min-lr", "lr-decay-style", "lr-decay-iters", "lr-warmup-fraction", "lr-warmup-iters", "weight-decay",
          "clip-grad", "adam-beta1", "adam-beta2", "adam-eps", "seed", "train-iters", "save-interval", "load", "save",
          "recompute-granularity", "recompute-method", "recompute-num-layers", "lora-r", "lora-alpha",
          "lora-target-modules", "lora-dropout", "use-torch-fsdp2"}


def _number(value) -> float:
    return float(value)


def read_flags(out: Imported, script: Script) -> Dict[str, object]:
    """The program's flags; the world (nodes x processes per node) from the launcher's flags."""
    found = flags(script.args)
    for name, value in list(found.items()):
        if isinstance(value, str) and UNKNOWN in value:
            out.leave_out(f"--{name}", "its value comes from a command substitution `$( ... )`, which is never run")
            del found[name]
    launcher = flags([w.replace("_", "-") if w.startswith("--") else w for w in script.launcher])
    world = launcher.get("worker-num") or launcher.get("nnodes")
    local = launcher.get("local-worker-num") or launcher.get("nproc-per-node")
    if local and str(local).isdigit():
        per_node = int(local)
        nodes = int(world) // per_node if launcher.get("worker-num") else int(world or 1)
        out.set("cluster.nodes", max(1, nodes))
        out.set("cluster.devices_per_node", per_node)
        out.set("cluster.device", "ascend-910b2")  # the examples' Atlas 800T A2; set ascend-910c for an A3
        out.world_size = max(1, nodes) * per_node
    return found


def config_flags(gpt_args: Dict[str, object]) -> Dict[str, object]:
    """A YAML config's gpt_args as flags: use_torch_fsdp2 (fully sharded parameters) read as ZeRO-3."""
    found: Dict[str, object] = {}
    for key, value in gpt_args.items():
        if value is False or value is None:
            continue
        found[key.replace("_", "-")] = True if value is True else str(value)
    return found


def apply_flags(out: Imported, found: Dict[str, object], layers: Optional[int]) -> None:
    _layout(out, found, layers)
    _batch_and_steps(out, found)
    _optimizer(out, found)
    if found.get("lora-r"):
        lora = {"r": int(found["lora-r"]), "alpha": _number(found.get("lora-alpha", 2 * int(found["lora-r"])))}
        if found.get("lora-dropout"):
            lora["dropout"] = _number(found["lora-dropout"])
        if found.get("lora-target-modules"):
            names = re.split(r"[,\s]+", str(found["lora-target-modules"]).strip())
            lora["target_modules"] = [hf for name in names for hf in LORA_NAMES.get(name, [name])]
        out.set("model.lora", lora)
    if found.get("load"):
        out.leave_out(f"--load {found['load']}", "a Megatron checkpoint; mm loads Hugging Face folders (model.path "
                                                 "is the data JSON's model_name_or_path when it names one)")
    if found.get("save"):
        out.set("output_dir", str(found["save"]))
    for name, value in found.items():
        if name in MACHINERY:
            out.not_needed.append(f"--{name}")
        elif name not in MAPPED:
            out.leave_out(f"--{name}" + ("" if value is True else f" {value}"), "no mm equivalent")


def _layout(out: Imported, found: Dict[str, object], layers: Optional[int]) -> None:
    for flag, key in (("tensor-model-parallel-size", "tp"), ("pipeline-model-parallel-size", "pp"),
                      ("context-parallel-size", "cp"), ("expert-model-parallel-size", "ep")):
        if found.get(flag):
            out.set(f"parallel.{key}", int(found[flag]))
    pp = int(found.get("pipeline-model-parallel-size", 1))
    if found.get("virtual-pipeline-model-parallel-size"):
        out.set("parallel.vpp", int(found["virtual-pipeline-model-parallel-size"]))
    elif found.get("num-layers-per-virtual-pipeline-stage") and layers:
        out.set("parallel.vpp", layers // (pp * int(found["num-layers-per-virtual-pipeline-stage"])))
    if int(found.get("context-parallel-size", 1)) > 1:
        algo = str(found.get("context-parallel-algo", "megatron_cp_algo"))
        if algo not in CP_ALGOS:
            raise ValueError(f"--context-parallel-algo {algo}: mm's are {sorted(CP_ALGOS)}")
        out.set("parallel.cp_algo", CP_ALGOS[algo])
        if found.get("ulysses-degree-in-cp"):
            out.set("parallel.ulysses_degree", int(found["ulysses-degree-in-cp"]))
    if found.get("sequence-parallel"):
        out.set("parallel.sequence_parallel", True)
    if found.get("use-distributed-optimizer"):
        out.set("parallel.zero_stage", 1)  # Megatron's distributed optimizer shards the optimizer state: ZeRO-1
    if found.get("use-torch-fsdp2"):
        out.set("parallel.zero_stage", 3)  # FSDP2 shards the parameters too: ZeRO-3
    granularity = found.get("recompute-granularity")
    if granularity == "selective":
        out.set("model.recompute", "selective")
    elif granularity == "full":
        method = str(found.get("recompute-method", "uniform"))
        count = int(found.get("recompute-num-layers", 1))
        if method == "block":
            out.set("model.recompute", "block")
            out.set("model.recompute_num_layers", count)
        else:
            out.set("model.recompute", "full")
            if count > 1:
                out.leave_out(f"--recompute-num-layers {count} (uniform)", "mm's full recomputation keeps each "
                                                                          "layer's input (groups of one layer)")


def _batch_and_steps(out: Imported, found: Dict[str, object]) -> None:
    micro = int(found.get("micro-batch-size", 1))
    out.set("train.micro_batch_size", micro)
    if found.get("global-batch-size"):
        out.set("train.global_batch_size", int(found["global-batch-size"]))
    out.set("train.steps", int(found.get("train-iters", 1000)))
    out.set("train.seed", int(found.get("seed", 1234)))  # Megatron's default seed
    out.set("train.precision", "bf16" if found.get("bf16") else "fp16" if found.get("fp16") else "fp32")
    if found.get("save-interval"):
        out.set("checkpoint.every", int(found["save-interval"]))


def _optimizer(out: Imported, found: Dict[str, object]) -> None:
    steps = int(found.get("train-iters", 1000))
    style = str(found.get("lr-decay-style", "linear"))  # Megatron's default
    if style not in SCHEDULES:
        out.leave_out(f"--lr-decay-style {style}", f"mm's schedules are {sorted(SCHEDULES)}: cosine used")
    warmup = (int(found["lr-warmup-iters"]) if found.get("lr-warmup-iters") else
              round(_number(found.get("lr-warmup-fraction", 0.0)) * int(found.get("lr-decay-iters", steps))))
    optim = {"lr": _number(found.get("lr", 1e-4)), "min_lr": _number(found.get("min-lr", 0.0)),
             "lr_schedule": SCHEDULES.get(style, "cosine"), "warmup_steps": warmup,
             "decay_steps": int(found.get("lr-decay-iters", steps)),
             "weight_decay": _number(found.get("weight-decay", 0.01)),
             "clip_grad": _number(found.get("clip-grad", 1.0)),
             "betas": [_number(found.get("adam-beta1", 0.9)), _number(found.get("adam-beta2", 0.999))],
             "eps": _number(found.get("adam-eps", 1e-8))}
    out.recipe.setdefault("optim", {}).update(optim)
