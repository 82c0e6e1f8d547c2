"""More than one machine, on this one: swin-extract-features as 2 torchrun nodes of 1 process each
(``--nnodes 2 --node-rank 0|1``, torchrun's c10d rendezvous on 127.0.0.1), equal to the 1-process
run. Real torchrun processes, real gloo, a small SwinBackbone, real image files
(tests/tools/test_features_dataset_runs.py). The training tools' multi-node launches
(tools/dist_train.sh, tools/dist_test.sh) are in tests/mmlab/test_fsdp.py."""
import json
import os
import socket
import subprocess
import sys
from typing import Callable, Dict, List, Optional

import pytest

from swin_backbone.tools import extract_features as tool

from .test_features_dataset_runs import SMALL, assert_same_features, features, pooled, write_images

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
