"""More than one machine, on this one: swin-extract-features as 2 torchrun nodes of 1 process each
(``--nnodes 2 --node-rank 0|1``, torchrun's c10d rendezvous on 127.0.0.1), equal to the 1-process
run. Real torchrun processes, real gloo, a small SwinBackbone, real image files
(tests/tools/test_features_dataset_runs.py). The training tools' multi-node launches
(tools/dist_train.sh, tools/dist_test.sh) are in tests/mmlab/test_fsdp.py.

Misconfigured multi-node launches stop with an error naming the requirement: tools/dist_train.sh with
NNODES > 1 and a loopback (or no) MASTER_ADDR, before anything starts; tools/train.py as 2 nodes
whose work dirs are not the same folder, at start-up (rank 0 writes a token there, every rank reads
it)."""
import json
import os
import subprocess
import sys
from typing import Callable, Dict, List, Optional

import pytest

from swin_backbone.tools import extract_features as tool

from ..helpers import EXTRACT_ARGS as SMALL
from ..helpers import assert_same_features, features, free_port, pooled, write_images

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.slow  # torchrun nodes and launch scripts as subprocesses: out of `make test-fast`


def launch_nodes(command: Callable[[int], List[str]], nnodes: int = 2, env: Optional[Dict[str, str]] = None,
                 timeout: float = 300) -> List[subprocess.CompletedProcess]:
    """Start ``command(node_rank)`` once per node, the last node first (a node may start before
    the one that hosts the rendezvous), and wait for all of them.

    Returns one ``CompletedProcess`` per node rank (stdout and stderr as text)."""
    procs = {}
    try:
        for node in reversed(range(nnodes)):
            procs[node] = subprocess.Popen(command(node), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)
        results = []
        for node in range(nnodes):
            out, err = procs[node].communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(procs[node].args, procs[node].returncode, out, err))
        return results
    finally:
        for proc in procs.values():  # only if something above failed: never leave a node behind
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def torchrun_node(node: int, port: int, target: List[str], nnodes: int = 2) -> List[str]:
    """One node's torchrun: 1 process, c10d rendezvous on 127.0.0.1:``port``."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(node),
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", f"test-{port}"] + target


def node_env() -> Dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    write_images(root)
    return root


def test_extract_features_on_two_nodes_equals_one_process(tmp_path, images):
    reference = tmp_path / "one"
    ref = tool.extract([str(images), str(reference), "--pool", "avg", "--workers", "0"] + SMALL)
    out = tmp_path / "two_nodes"
    port = free_port()
    nodes = launch_nodes(lambda node: torchrun_node(node, port, ["-m", "swin_backbone.tools.extract_features",
                                                                 str(images), str(out), "--pool", "avg"] + SMALL),
                         env=node_env())
    for node, proc in enumerate(nodes):
        assert proc.returncode == 0, f"node {node}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    index = json.load(open(out / "index.json"))
    # two ranks, one per node (each node's only process: LOCAL_RANK 0, local world size 1)
    assert index["world_size"] == 2 and sorted(r["rank"] for r in index["ranks"]) == [0, 1]
    assert sorted(r["assigned"] for r in index["ranks"]) == [5, 5]
    assert index["images"] == ref["images"] == 8 and index["new"] == 8
    assert sorted(f["image"] for f in index["failed"]) == sorted(f["image"] for f in ref["failed"])
    # the same maps and pooled vectors as one process, each image once
    assert_same_features(features(out), features(reference))
    assert_same_features(pooled(out), pooled(reference))
    # rank 0 (on whichever node the rendezvous numbered first) alone reports
    assert sum("WARNING: RANDOM WEIGHTS" in p.stdout + p.stderr for p in nodes) == 1


def test_dist_train_refuses_several_nodes_on_a_loopback_master(tmp_path):
    for addr in ("127.0.0.1", "localhost", None):
        env = dict(os.environ, NNODES="2", NODE_RANK="1", PYTHON=sys.executable)
        env.pop("MASTER_ADDR", None)
        env.pop("SINGLE_HOST_NODES", None)
        if addr:
            env["MASTER_ADDR"] = addr
        proc = subprocess.run(["bash", "tools/dist_train.sh", "configs/toy/upernet_swin-toy_toy-ade.py", "1"], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        expected = "is a loopback address" if addr else "MASTER_ADDR is not set"
        assert expected in proc.stderr and "node 0's address, reachable from every node" in proc.stderr
        assert "torch" not in proc.stderr  # stopped before torchrun


def test_train_on_two_nodes_needs_one_work_dir(tmp_path):
    """Two "nodes" (1 process each) whose work dirs differ, as node-local disks would: both stop at
    start-up, naming the requirement, before building anything."""
    port = free_port()
    env = dict(node_env(), NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SINGLE_HOST_NODES="1",
               PYTHON=sys.executable, TOY_DATA_ROOT=str(tmp_path / "data"))
    nodes = launch_nodes(lambda node: ["env", f"NODE_RANK={node}", "bash", "tools/dist_train.sh",
                                       "configs/toy/upernet_swin-toy_flexible-ddp_toy-ade.py", "1", "--work-dir",
                                       str(tmp_path / f"node{node}")], env=env, timeout=300)
    for node, proc in enumerate(nodes):
        assert proc.returncode != 0, f"node {node} started"
    err = nodes[1].stdout + nodes[1].stderr
    assert "not the same folder on every node" in err and "a file system all nodes share" in err
    assert "rank 1" in err and str(tmp_path / "node1") in err
    assert "Iter(train)" not in nodes[0].stdout + nodes[0].stderr


# ------------------------------------------------------------------ the test metrics' file
def _test_run_rank(rank, world, port, work_dirs, fix):
    """One rank of a 2-process gloo job: mmengine's Runner tests a one-weight model whose metric
    is a long number on rank 1 (so its file would differ in length), each rank in its own work dir."""
    import torch
    import torch.distributed as dist
    from mmengine.evaluator import BaseMetric
    from mmengine.model import BaseModel
    from mmengine.runner import Runner

    from swin_backbone.tools.runner import rank_zero_test_json

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)

    class Model(BaseModel):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, inputs, data_samples=None, mode="tensor"):
            return [dict(value=float(self.w) * len(inputs))]

    class Metric(BaseMetric):
        def process(self, data_batch, data_samples):
            self.results.extend(data_samples)

        def compute_metrics(self, results):
            return dict(score=1.0 / 3.0 if dist.get_rank() else 0.5)

    runner = Runner(model=Model(), work_dir=work_dirs[rank], launcher="pytorch",
                    test_dataloader=dict(dataset=[dict(inputs=i) for i in range(4)], sampler=dict(type="DefaultSampler", shuffle=False),
                                         batch_size=1, collate_fn=dict(type="default_collate")),
                    test_cfg=dict(), test_evaluator=Metric(), default_scope="mmengine",
                    cfg=dict(model_wrapper_cfg=dict(type="MMDistributedDataParallel", device_ids=None)))  # CPU DDP
    if fix:
        rank_zero_test_json(runner)
    try:
        runner.test()
    finally:  # (a group left to the interpreter's exit may abort a rank: "terminate called without an active exception")
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.parametrize("fix", [False, True], ids=["mmengine", "ours"])
def test_test_metrics_file_is_written_by_rank_zero(tmp_path, fix):
    """mmengine's LoggerHook writes ``<log_dir>/<timestamp>.json`` after a test from every rank, to
    the same path: on a shared work dir (2-node tools/dist_test.sh here) the writes interleaved into
    invalid JSON. Each rank gets a work dir of its own here, so each write shows: with
    ``rank_zero_test_json`` (what swin-test calls) rank 1 writes none."""
    import torch.multiprocessing as mp

    work_dirs = [str(tmp_path / f"rank{r}") for r in range(2)]
    mp.spawn(_test_run_rank, args=(2, free_port(), work_dirs, fix), nprocs=2, join=True)
    written = [sorted(p for p in (tmp_path / f"rank{r}").rglob("*.json") if p.parent.parent == tmp_path / f"rank{r}")
               for r in range(2)]
    assert len(written[0]) == 1 and json.loads(written[0][0].read_text())["score"] == 0.5
    assert len(written[1]) == (0 if fix else 1)  # mmengine's own: rank 1 writes its file too
