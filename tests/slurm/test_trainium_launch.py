"""Trainium's torchrun world (training/slurm/launch.sh, node step): static ranks as Neuron
launches them, and the root-comm address on rank 0's node, for every node order.

The node step runs as srun runs it on each node of a job (SLURM_JOB_NODELIST, SLURM_NODEID,
SLURMD_NODENAME), with the local Slurm's real ``scontrol`` expanding the node list, and a
stand-in Python that records what torchrun would have been given. The fixture cluster has one
node, so the multi-node orders are driven through the node step itself; the real job on
the fixture (tests/slurm/test_train_jobs.py, the trainium sbatch) runs the same code path.
"""

from __future__ import annotations

import itertools
import json
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, SlurmCluster

LAUNCHER = REPO / "training/slurm/launch.sh"
NODES = ("trn-a", "trn-b", "trn-c")

RECORDER = """#!/usr/bin/env python3
import json, os, sys
print("RECORD " + json.dumps({"argv": sys.argv[1:], "root_comm": os.environ.get("NEURON_RT_ROOT_COMM_ID"),
                              "extract": os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY"),
                              "wrapped_by": os.environ.get("WRAPPED_BY")}))
"""
# neuron_parallel_compile's contract as far as the launch goes: it runs the command it is given
# with NEURON_EXTRACT_GRAPHS_ONLY set (then compiles what the run extracted).
PARALLEL_COMPILE = """#!/usr/bin/env bash
export NEURON_EXTRACT_GRAPHS_ONLY=1 WRAPPED_BY=neuron_parallel_compile
exec "$@"
"""


@pytest.fixture
def fake_env(tmp_path: Path) -> Path:
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    python = env / "bin/python"
    python.write_text(RECORDER)
    python.chmod(0o755)
    tool = env / "bin/neuron_parallel_compile"
    tool.write_text(PARALLEL_COMPILE)
    tool.chmod(0o755)
    return env


def node_step(cluster: SlurmCluster, env_dir: Path, tmp: Path, nodelist: str, node_id: int, me: str,
              kind: str = "trainium", **extra: str) -> subprocess.CompletedProcess:
    env = cluster.env(SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=nodelist, SLURM_JOB_NUM_NODES="3",
                      SLURM_NODEID=str(node_id), SLURMD_NODENAME=me, SANA_ENV_PATH=str(env_dir),
                      SANA_NPROC_PER_NODE="32", SANA_RDZV_PORT="29500", SANA_JOB_LOG_DIR=str(tmp / "logs"),
                      SANA_RUN_DIR=str(tmp / "run"), **extra)
    env.pop("NEURON_RT_ROOT_COMM_ID", None)
    return subprocess.run(["bash", str(LAUNCHER), "node", kind, "--max-steps", "1"], env=env,
                          capture_output=True, text=True, timeout=60)


def recorded(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RECORD ")]
    return json.loads(line.removeprefix("RECORD "))


def flag(argv: list[str], name: str) -> str | None:
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    return values[0] if values else None


@pytest.mark.parametrize("order", list(itertools.permutations(NODES)), ids="-".join)
def test_rank0_node_master_and_root_comm_agree_for_every_node_order(slurm_cluster, fake_env, tmp_path, order):
    nodelist = ",".join(order)
    hosts = slurm_cluster.run("scontrol", "show", "hostnames", nodelist).split()
    assert hosts == list(order)  # the job's node order, as Slurm expands it
    for node_id, me in enumerate(hosts):
        rec = recorded(node_step(slurm_cluster, fake_env, tmp_path, nodelist, node_id, me))
        argv = rec["argv"]
        assert argv[:2] == ["-m", "torch.distributed.run"]
        assert flag(argv, "node-rank") == str(node_id)  # static: SLURM_NODEID, never store order
        assert flag(argv, "master-addr") == hosts[0] and flag(argv, "master-port") == "29500"
        assert flag(argv, "rdzv-backend") is None  # torchrun's static rendezvous
        assert flag(argv, "nnodes") == "3" and flag(argv, "nproc-per-node") == "32"
        # global rank 0 = node rank 0, local rank 0: it lives on hosts[0], where the root comm is
        assert rec["root_comm"] == f"{hosts[0]}:46820"
        assert "--config" in argv and argv[argv.index("--config") + 1].endswith("configs/trn-sana-600m-512.yaml")


def test_a_node_id_that_is_not_this_node_fails_in_one_line(slurm_cluster, fake_env, tmp_path):
    proc = node_step(slurm_cluster, fake_env, tmp_path, "trn-a,trn-b", 1, "trn-a")
    assert proc.returncode != 0
    (line,) = proc.stderr.strip().splitlines()
    assert "SLURM_NODEID=1 is trn-b" in line and "this node is trn-a" in line


def test_the_root_comm_port_comes_from_the_node_profile(slurm_cluster, fake_env, tmp_path):
    rec = recorded(node_step(slurm_cluster, fake_env, tmp_path, "trn-a", 0, "trn-a", SANA_NEURON_COMM_PORT="47001"))
    assert rec["root_comm"] == "trn-a:47001"


def test_precompile_wraps_the_training_jobs_own_world_in_neuron_parallel_compile(slurm_cluster, fake_env,
                                                                                 tmp_path):
    """Same node rank, master, world size and config as the training job on every node: the
    graphs the tool extracts carry the real run's collectives, so the real run hits them."""
    nodelist = "trn-b,trn-a,trn-c"
    for node_id, me in enumerate(("trn-b", "trn-a", "trn-c")):
        train = recorded(node_step(slurm_cluster, fake_env, tmp_path, nodelist, node_id, me))
        pre = recorded(node_step(slurm_cluster, fake_env, tmp_path, nodelist, node_id, me, kind="precompile"))
        assert pre["wrapped_by"] == "neuron_parallel_compile" and pre["extract"] == "1"
        assert train["wrapped_by"] is None
        world = ("nnodes", "nproc-per-node", "node-rank", "master-addr", "master-port")
        assert [flag(pre["argv"], f) for f in world] == [flag(train["argv"], f) for f in world]
        assert pre["root_comm"] == train["root_comm"] == "trn-b:46820"
        entry = pre["argv"][pre["argv"].index("training.trainium"):]
        assert entry[:3] == train["argv"][train["argv"].index("training.trainium"):][:3]  # module + --config X
        assert "--precompile" in entry and "--resume" not in entry


def test_precompile_without_the_tool_fails_in_one_line(slurm_cluster, fake_env, tmp_path):
    (fake_env / "bin/neuron_parallel_compile").unlink()
    proc = node_step(slurm_cluster, fake_env, tmp_path, "trn-a", 0, "trn-a", kind="precompile")
    assert proc.returncode != 0
    (line,) = proc.stderr.strip().splitlines()
    assert "no neuron_parallel_compile at" in line and "torch-neuronx" in line
