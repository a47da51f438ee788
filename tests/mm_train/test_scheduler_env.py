"""mm_train.scheduler_env: a node's place in a multi-node job from the command line, Slurm or a
Kubernetes / Volcano job (the two-launch Slurm run is in test_run.py)."""

import pytest

from mm_train.scheduler_env import expand_hostlist, node_place

NONE = dict.fromkeys(("nnodes", "node_rank", "master_addr", "master_port", "nproc_per_node"))


@pytest.mark.parametrize("text, hosts", [
    ("node7", ["node7"]),
    ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
    ("10.0.0.[3-4]", ["10.0.0.3", "10.0.0.4"]),
])
def test_slurm_host_lists_expand_as_slurm_writes_them(text, hosts):
    assert expand_hostlist(text) == hosts


def test_a_host_list_that_cannot_be_read_is_an_error():
    with pytest.raises(ValueError, match="'a-c' is not a number or a range"):
        expand_hostlist("n[a-c]")


def test_slurm():
    env = {"SLURM_JOB_ID": "123456", "SLURM_NNODES": "4", "SLURM_NODEID": "2",
           "SLURM_JOB_NODELIST": "ascend[07-10]", "SLURM_NTASKS_PER_NODE": "8(x4)"}
    place = node_place(NONE, env)
    assert place.values == {"nnodes": 4, "node_rank": 2, "master_addr": "ascend07", "master_port": 23456,
                            "nproc_per_node": 8}
    assert place.describe() == ("nnodes 4, node-rank 2, master-addr ascend07 from Slurm; master-port 23456 from "
                                "Slurm (from the job id); nproc-per-node 8 from Slurm (SLURM_NTASKS_PER_NODE)")
    given = dict(NONE, node_rank=0, nproc_per_node=2)  # the command line wins
    assert node_place(given, env).values["node_rank"] == 0
    assert node_place(given, env).sources["nproc_per_node"] == "the command line"


def test_kubernetes_and_volcano():
    kubeflow = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "RANK": "1", "WORLD_SIZE": "3"}
    place = node_place(NONE, kubeflow, recipe_devices_per_node=8)
    assert place.values == {"nnodes": 3, "node_rank": 1, "master_addr": "job-master-0", "master_port": 23456,
                            "nproc_per_node": 8}
    assert place.sources["node_rank"] == "the pod's RANK"
    assert place.sources["nproc_per_node"] == "the recipe's cluster.devices_per_node"
    volcano = dict(kubeflow, VC_TASK_INDEX="2", ASCEND_VISIBLE_DEVICES="0,1,2,3")
    place = node_place(NONE, volcano)
    assert place.values["node_rank"] == 2 and place.values["nproc_per_node"] == 4
    assert place.sources["node_rank"] == "the pod's VC_TASK_INDEX"


def test_what_is_missing_or_out_of_range_is_named():
    with pytest.raises(ValueError, match="needs --nnodes, --node-rank, --master-addr, --master-port: pass them"):
        node_place(NONE, {})
    with pytest.raises(ValueError, match=r"node rank 3 \(Slurm\) is not in 0 .. 1 \(Slurm\)"):
        node_place(NONE, {"SLURM_JOB_ID": "1", "SLURM_NNODES": "2", "SLURM_NODEID": "3",
                          "SLURM_JOB_NODELIST": "n1,n2"})
