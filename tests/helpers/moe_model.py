"""A toy model of MoE layers for the layout-equivalence tests: h = x; per layer h = h + moe(h, mask);
loss per sample = sum_t (head . h_t)^2 / tokens + aux_loss_coef * aux + z_loss_coef * z, with the
aux and z losses of transformers / ST-MoE over every layer (mm_parallel.moe). One forward is one
sample, so the routing statistics (and capacity) are per sample under every layout; the model's
loss is the mean over samples. The aux loss counts the tokens the sample's mask marks (each rank
passes its own part of the mask, cut as its tokens are). Pipeline stages pass the hidden tokens
and the statistics of the layers before them."""

from __future__ import annotations

import json
import os

import numpy as np

H, INNER, E, K, LAYERS, S, SAMPLES = 8, 6, 4, 2, 2, 8, 4  # 2I != H: the fused expert layouts differ in shape
CONFIG = {"num_layers": LAYERS, "moe": {"hidden_size": H, "moe_intermediate_size": INNER, "num_experts": E,
                                        "top_k": K, "aux_loss_coef": 0.05, "z_loss_coef": 0.01}}


def toy_class():
    from mindspore import Tensor, nn, ops

    from mm_parallel import mappings
    from mm_parallel.blocks import Indexed, Linear
    from mm_parallel.model_base import ParallelModel
    from mm_parallel.moe import MoEConfig, MoELayer, load_balancing_loss, router_z_loss

    class Block(nn.Cell):
        def __init__(self, config, topo):
            super().__init__()
            self.mlp = MoELayer(config, topo, init_std=0.5)

        def construct(self, h, mask):
            return h + self.mlp(h, token_mask=mask)

    class ToyMoE(ParallelModel):
        layer_prefix = "layers."

        def __init__(self, config, topology=None, chunk=0, pipeline_num_layers=None):
            super().__init__()
            layers = self.build_stage(topology, chunk, config["num_layers"], pipeline_num_layers)
            self.config, self.moe_config = config, MoEConfig(**config["moe"])
            self.layers = Indexed(*[Block(self.moe_config, self.topology) for _ in layers])
            self.head = Linear(H, 1, bias=False) if self.is_last else None

        @classmethod
        def load_config(cls, config, overrides=None):
            if isinstance(config, (str, os.PathLike)):
                with open(os.path.join(config, "config.json")) as f:
                    config = json.load(f)
            config = json.loads(json.dumps(config))
            config["moe"].update((overrides or {}).get("moe", {}))
            return config

        def write_config(self, path, dtype="float32"):
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(self.config, f)

        def run_layers(self, h, stats, mask):
            for i in range(len(self.layers)):
                h = self.layers[i](h, mask)
                stats = stats + [self.layers[i].mlp.stats]
            return h, stats

        def pipeline_stage(self, x, batch):
            if self.is_first:
                h, stats = self.enter_sequence(Tensor(batch["x"])), []
            else:
                h, stats = x["hidden"], [x["moe_stats"][i] for i in range(x["moe_stats"].shape[0])]
            mask = self.enter_sequence(Tensor(batch["mask"][..., None])).asnumpy()  # this rank's part
            h, stats = self.run_layers(h, stats, mask)
            return {"hidden": h, "moe_stats": ops.stack(stats)}

        def pipeline_loss(self, out, batch):
            topo, cfg = self.topology, self.moe_config
            h = out["hidden"]
            if topo.config.sequence_parallel:
                h = mappings.gather_from_sequence(h, topo.tp, 1, grad_reduce_scatter=False)
            pred = self.head(h)
            task = self.reduce_loss_over_cp((pred * pred).sum() / float(np.prod(batch["x"].shape[:2])))
            stats = [out["moe_stats"][i] for i in range(out["moe_stats"].shape[0])]
            return task + cfg.aux_loss_coef * load_balancing_loss(stats, E) + cfg.z_loss_coef * router_z_loss(stats, E)

        def sample_loss(self, batch):
            return self.pipeline_loss(self.pipeline_stage(None, batch), batch)

    return ToyMoE


def write_checkpoints(root):
    """base/ (random), skewed/ (the first layer's router sends every token to experts 0 and 1),
    base in the other two expert layouts (transposed/, per_expert/), and shared/ (top-k then
    softmax, a gated shared expert)."""
    from mindspore import Tensor

    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.moe.checkpoint import convert_folder
    from mm_parallel.tensor_parallel import seed_parameters

    topo = mm_parallel.initialize(ParallelConfig())
    seed_parameters(3)
    model = toy_class()(CONFIG, topo)
    model.save_pretrained(os.path.join(root, "base"))
    gate = model.layers[0].mlp.gate.weight
    skew = np.full((E, H), -2.0, np.float32)
    skew[0], skew[1] = 2.0, 1.0
    gate.set_data(Tensor(skew))
    model.save_pretrained(os.path.join(root, "skewed"))
    shared = {**CONFIG, "moe": {**CONFIG["moe"], "score_order": "topk_softmax", "shared_expert_intermediate_size": 6,
                                "shared_expert_gate": True}}
    toy_class()(shared, topo).save_pretrained(os.path.join(root, "shared"))
    convert_folder(os.path.join(root, "base"), os.path.join(root, "transposed"), "fused_transposed")
    convert_folder(os.path.join(root, "base"), os.path.join(root, "per_expert"), "per_expert")


def batch():
    """Positive inputs, so the skewed router's choice holds for every token."""
    rng = np.random.default_rng(11)
    mask = np.ones((SAMPLES, S), np.float32)
    mask[:, S - 3:] = rng.integers(0, 2, (SAMPLES, 3))  # padding at the ends of some samples
    return {"x": (np.abs(rng.standard_normal((SAMPLES, S, H))) + 0.1).astype(np.float32), "mask": mask}


def spec():
    from mm_parallel.testing.equivalence import ModelSpec

    cls = toy_class()

    def build(path, topo, case):
        return [cls.from_pretrained(path, topo, chunk=c, moe=case.get("moe", {})) for c in range(topo.config.vpp)]

    def split(b, index, parts):
        n = b["x"].shape[0] // parts
        return {key: value[index * n:(index + 1) * n] for key, value in b.items()}

    def loss(model, b):
        parts = [model.sample_loss({key: value[i:i + 1] for key, value in b.items()}) for i in range(b["x"].shape[0])]
        return sum(parts) / len(parts)

    return ModelSpec(build=build, split=split, samples=lambda b: b["x"].shape[0], loss=loss)
