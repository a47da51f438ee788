"""`mm-train run` end to end: the built-in default trains (loss falls, metrics.jsonl has every
field, loss.png is drawn); the same recipe gives the same losses on 1 process, DP2 and TP2 (msrun
started by mm-train itself), rank 0's progress and summary shown in the terminal; a worker's
failure ends with its own error line; a layout the processes cannot hold is refused before launching."""

import json
import os

import pytest
from helpers.mm_train_cli import launch_two_nodes, losses, mm_train, val_losses

pytestmark = pytest.mark.distributed

def test_help_everywhere(tmp_path):
    for args in (["--help"], ["run", "--help"]):
        result = mm_train(*args, data=tmp_path)
        assert result.returncode == 0 and "usage: mm-train" in result.stdout


def test_the_default_trains_the_same_under_dp2_tp2_pp2_and_cp2(tmp_path, run_distributed):
    """dp2 through the launcher (rank 0's lines relayed); the other layouts as its workers run them
    (train_runs)."""
    from helpers.train_runs import train

    # a held-out quarter validated every 2 steps in batches of 8: the same validation loss under every layout
    short = ["--set", "train.steps=4", "--set", "data.samples=32", "--set", "eval.every=2", "--set",
             "eval.fraction=0.25", "--set", "eval.batch_size=8", "--no-progress"]
    cp2 = ["--set", "parallel.cp=2", "--set"]
    picture = tmp_path / "data" / "images" / "00000.png"  # the built-in set's, written by the first run
    answers = ["--set", "eval.sample_every=4", "--set", "eval.prompts=[<image>]", "--set", f"eval.images=[{picture}]",
               "--set", "eval.max_new_tokens=6"]  # greedy answers about a picture of the set
    runs = {"single": (1, answers), "tp2": (2, ["--set", "parallel.tp=2", *answers]),
            "pp2": (2, ["--set", "parallel.pp=2", *answers]),
            "cp2_ulysses": (2, cp2 + ["parallel.cp_algo=ulysses", *answers]),
            "cp2_ring": (2, cp2 + ["parallel.cp_algo=ring"])}
    got = {}
    for name, (nproc, extra) in runs.items():
        train(run_distributed, *short, *extra, "--set", f"output_dir={tmp_path / name}", nproc=nproc,
              data=tmp_path / "data")
        got[name] = losses(tmp_path / name)
    shown = [a for a in short if a != "--no-progress"]  # dp2 shows its progress
    result = mm_train("run", *shown, "--nproc", "2", "--set", f"output_dir={tmp_path / 'dp2'}", data=tmp_path / "data")
    assert result.returncode == 0, result.stderr[-3000:]
    got["dp2"] = losses(tmp_path / "dp2")
    lines = result.stderr.splitlines()  # rank 0's progress (plain lines: no terminal) and summary, relayed
    assert any(line.startswith("step     4/4 [") for line in lines), result.stderr[-2000:]
    assert any(line.startswith("loss ") and "in 4 steps" in line for line in lines), result.stderr[-2000:]
    assert "\r" not in result.stderr and "WARNING" not in result.stderr
    # the device and launch mode, said once by the launcher (mm_parallel.runtime): always blocking on CPU
    said = [line for line in lines if line.startswith("mm-train: device ")]
    assert len(said) == 1 and said[0].startswith("mm-train: device CPU (train.device=auto: MindSpore reports no "
                                                 "Ascend); blocking launch (always on CPU: "), said
    assert got["single"][-1] < got["single"][0]
    for name in got:
        assert got[name] == pytest.approx(got["single"], rel=1e-4), (name, got)
        validated = val_losses(tmp_path / name)
        assert list(validated) == [2, 4] and validated == pytest.approx(val_losses(tmp_path / "single"), rel=1e-4)
    assert (tmp_path / "single" / "loss.png").exists()
    page = (tmp_path / "single" / "samples" / "step_4" / "answers.md").read_text()
    assert "![00000.png](image_0.png)" in page and (tmp_path / "single" / "samples" / "step_4" / "image_0.png").exists()
    for name in ("tp2", "pp2", "cp2_ulysses"):  # the cache's decoding (tp2), whole passes per token (pp2, cp2)
        assert (tmp_path / name / "samples" / "step_4" / "answers.md").read_text() == page, name


def test_a_device_this_mindspore_cannot_run_is_refused(tmp_path):
    result = mm_train("run", "--set", "train.device=ascend", data=tmp_path / "data")
    assert result.returncode == 2 and "train.device=ascend, but this MindSpore cannot run on Ascend" in result.stderr
    assert not (tmp_path / "data").exists()


def test_a_layout_the_processes_cannot_hold_is_refused_before_launch(tmp_path):
    result = mm_train("run", "--nproc", "3", "--set", "parallel.tp=2", data=tmp_path / "data")
    assert result.returncode == 2 and "cannot hold tp x cp x pp" in result.stderr
    assert not (tmp_path / "data").exists()  # nothing started


@pytest.mark.parametrize("recipe,nproc,overrides,lines", [
    (None, 3, ["parallel.tp=3"], ["text_config.num_attention_heads=4 is not divisible by parallel.tp=3; choose "
                                  "parallel.tp among 1, 2, 4",
                                  "the vocabulary size (the tokenizer's 300 tokens rounded up to 64)=320 is not "
                                  "divisible by parallel.tp=3"]),
    (None, 2, ["parallel.pp=2", "model.config.text_config.num_hidden_layers=3"],
     ["text_config.num_hidden_layers=3 layers cannot be cut evenly into pp x vpp = 2 x 1 = 2 stages"]),
    (None, 2, ["parallel.pp=2", "parallel.pp_layers=[1,1]", "model.config.text_config.num_hidden_layers=3"],
     ["parallel.pp_layers [1, 1] holds 2 layers, the model has text_config.num_hidden_layers=3: give counts "
      "summing to 3"]),
    ("wan2_1_t2v_tiny", 4, ["parallel.cp=4"], ["Ulysses context parallelism splits each tp rank's 2 heads over 4 "
                                               "ranks"]),
    ("qwen3_vl_moe_tiny", 3, ["parallel.ep=3", "train.global_batch_size=12"],
     ["text_config.num_experts=4 is not divisible by parallel.ep=3"]),
    (None, 2, ["data.kind=llamafactory", "data.path=nowhere/data.json"],
     ["data.path nowhere/data.json does not exist; point it at a LLaMA-Factory JSON / JSONL file",
      "no tokenizer: set data.tokenizer (a model folder or a tokenizer.json) or model.path"]),
    ("wan2_1_t2v_tiny", 1, ["data.kind=video", "data.path=nowhere.jsonl", "data.vae=tiny", "data.text_encoder=te"],
     ["data.path nowhere.jsonl does not exist", "data.text_encoder te does not exist; point it at its model folder "
                                                "(or tiny)"]),
])
def test_a_run_the_model_or_data_cannot_hold_is_refused_before_launch(tmp_path, monkeypatch, capsys, recipe, nproc,
                                                                      overrides, lines):
    """Heads, vocabulary, layers per stage, Ulysses heads, experts, missing data and tokenizer:
    each a line saying what to change, exit 2, no process started and nothing written
    (mm_train.preflight)."""
    from mm_train import cli
    from mm_train.families.vl import tiny as tiny_data

    tiny_data.generate(str(tmp_path / "data"), 32)  # the tokenizer the vocabulary comes from
    monkeypatch.setenv("MM_TRAIN_DATA", str(tmp_path / "data"))
    args = ["run"] + ([recipe] if recipe else []) + ["--nproc", str(nproc), "--set", f"output_dir={tmp_path / 'out'}"]
    assert cli.main(args + [a for o in overrides for a in ("--set", o)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mm-train: this run cannot start: ")
    for line in lines:
        assert line in err, err
    assert all(line.startswith("mm-train: ") for line in err.splitlines())
    assert not (tmp_path / "out").exists()


def test_a_worker_failure_ends_with_the_workers_own_error_line(tmp_path):
    out = tmp_path / "out"
    result = mm_train("run", "--nproc", "2", "--set", "train.steps=4", "--set", "data.samples=32", "--set",
                      "optim.lr=1e30", "--set", "train.max_nonfinite_steps=1", "--set", f"output_dir={out}",
                      data=tmp_path / "data")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("mm-train: the run stopped: 1 steps in a row"), result.stderr[-2000:]
    assert any(line.startswith("mm-train: the run failed: ") and "died with exit code" in line for line in lines)
    assert sum(line.startswith("mm-train: the run stopped") for line in lines) == 1  # shown once, last
    assert "Traceback" not in result.stderr and "RuntimeError" not in result.stderr
    assert "msrun" in (out / "logs" / "node_0" / "failure.txt").read_text()


def test_two_nodes_on_loopback_train_like_one_process(tmp_path):
    """A data-parallel world of two over two launches; the losses equal one process's."""
    from helpers.train_runs import train

    short = ["--set", "train.steps=3", "--set", "data.samples=32", "--no-progress"]
    train(None, *short, "--set", f"output_dir={tmp_path / 'single'}", data=tmp_path / "data")
    launch_two_nodes(tmp_path, *short, outs=[tmp_path / "two"] * 2, data=tmp_path / "data")
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "single"), rel=1e-4)
    assert (tmp_path / "two" / "logs" / "node_1").is_dir()


def test_two_nodes_of_a_slurm_job_take_their_places_from_its_environment(tmp_path):
    """The same run started as a Slurm job would start it: no node flags, each node's place read
    from SLURM_* (the master the first host of the job's node list, the port MASTER_PORT); the
    losses equal one process's, and each launcher says where its values came from."""
    from helpers.train_runs import train

    def slurm(rank, port):
        return {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": str(rank),
                "SLURM_JOB_NODELIST": "127.0.0.1", "MASTER_PORT": port}

    short = ["--set", "train.steps=3", "--set", "data.samples=32", "--no-progress"]
    train(None, *short, "--set", f"output_dir={tmp_path / 'single'}", data=tmp_path / "data")
    errs = launch_two_nodes(tmp_path, *short, outs=[tmp_path / "two"] * 2, data=tmp_path / "data", job_env=slurm)
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "single"), rel=1e-4)
    assert ("mm-train: this node: nnodes 2, node-rank 1, master-addr 127.0.0.1 from Slurm; master-port "
            in errs[1]), errs[1][-2000:]
    assert "from MASTER_PORT; nproc-per-node 1 from the default" in errs[1]


def test_node_local_disks_keep_each_nodes_part_and_resume_across_both(tmp_path):
    """checkpoint.shared_fs=false with pp2 over two nodes, each with its own output_dir: each
    node's checkpoint holds its stage's weights and optimizer state plus the shared files, the
    manifests (equal) name the node of every file. A truncated file on node 1 makes both nodes
    skip that checkpoint; the resumed run continues from the one before with the uninterrupted
    losses. Resuming under another layout is refused naming the files on the other node."""
    from helpers.train_runs import train

    short = ["--set", "train.steps=4", "--set", "data.samples=32", "--set", "checkpoint.every=2", "--no-progress"]
    local = [*short, "--set", "parallel.pp=2", "--set", "checkpoint.shared_fs=false"]
    train(None, *short, "--set", f"output_dir={tmp_path / 'single'}", data=tmp_path / "data")
    outs = [tmp_path / "node0", tmp_path / "node1"]
    launch_two_nodes(tmp_path, *local, outs=outs, data=tmp_path / "data")
    whole = losses(outs[0])
    assert whole == pytest.approx(losses(tmp_path / "single"), rel=1e-4)
    step_4 = [out / "checkpoints" / "step_4" for out in outs]
    shared = {"config.json", "model.safetensors.index.json"}
    mine = [{"model-00001-of-00002.safetensors", *shared}, {"model-00002-of-00002.safetensors", *shared}]
    for node, folder in enumerate(step_4):
        assert set(os.listdir(folder / "model")) == mine[node]
        assert [n for n in os.listdir(folder) if n.startswith("optimizer")] == [f"optimizer-stage00{node}.safetensors"]
    manifests = [json.loads((folder / "manifest.json").read_text())["files"] for folder in step_4]
    assert manifests[0] == manifests[1]
    assert manifests[0]["optimizer-stage001.safetensors"]["nodes"] == ["1"]
    assert manifests[0]["trainer_state.json"]["nodes"] == ["0", "1"]
    assert not (outs[1] / "metrics.jsonl").exists()  # rank 0 alone writes the metrics

    stage_1 = step_4[1] / "optimizer-stage001.safetensors"
    with open(stage_1, "r+b") as f:
        f.truncate(stage_1.stat().st_size - 8)
    err = launch_two_nodes(tmp_path, *local, "--resume", outs=outs, data=tmp_path / "data")[0]
    assert "skipping checkpoint" in err and "on node 1: optimizer-stage001.safetensors has" in err, err[-3000:]
    assert "step_2 (step 2)" in err
    assert losses(outs[0]) == pytest.approx(whole, rel=1e-6)

    other_layout = [*short, "--set", "checkpoint.shared_fs=false", "--set", "train.collective_timeout=30"]
    err = launch_two_nodes(tmp_path, *other_layout, "--resume", outs=outs, data=tmp_path / "data",
                           expect_ok=False)[1]
    assert "checkpoint.shared_fs is false and this node (1) holds only its own part" in err, err[-3000:]
    assert "model-00001-of-00002.safetensors (on node 0)" in err


def test_the_lora_recipe_trains_adapters_and_checkpoints_them(tmp_path):
    from pathlib import Path

    from helpers.train_runs import train

    import mm_train as package

    recipe = Path(package.__file__).with_name("recipes") / "qwen2_5_vl_tiny_lora.yaml"
    out = tmp_path / "lora"
    train(None, str(recipe), "--set", "train.steps=4", "--set", "data.samples=32", "--set", "checkpoint.every=4",
          "--set", f"output_dir={out}", "--no-progress", data=tmp_path / "data")
    got = losses(out)
    assert got[-1] < got[0]
    adapters = json.loads((out / "checkpoints" / "step_4" / "adapters" / "adapter_config.json").read_text())
    assert adapters["peft_type"] == "LORA" and adapters["r"] == 8
