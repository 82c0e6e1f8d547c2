"""The FSDP segmentation recipe at toy size on the CPU (configs/toy/upernet_swin-toy_fsdp_toy-ade.py:
UPerNet, SwinFSDPStrategy, with_cp, a frozen stage, sharded checkpoints ``state_dict_cfg='local'``),
in bf16 (``--amp``: autocast in the optimizer wrapper, as the large recipes), started from a file in
mmseg's model-zoo layout (``load_from``; its backbone keys in mmseg's SwinTransformer names):

* under FSDP (2 processes, tools/dist_train.sh, the config as mmengine dumps it into a work dir) it
  trains as the same recipe under DDP launched through tools/slurm_train.sh (2 SLURM tasks:
  mmengine's ``slurm`` launcher from the variables srun sets; ``tests/mmlab/slurm/srun`` stands in
  for SLURM's, which this machine lacks): the same
  losses at every iteration to ``BF16_RTOL``, both from the file's weights (``load_from`` of a
  single file under ``'local'``, keys converted while the sharded model loads them);
* its sharded checkpoint (a folder of rankN.pth) tested through tools/slurm_test.sh at the
  training's world size gives the training's own validation; in one process, a clear error.

Real processes, real gloo, real mmseg / mmengine, the generated toy ADE20K."""
import glob
import json
import math
import os

import pytest
import torch

from ..helpers import FAST, ROOT, assert_losses_close, launch, losses, scalars

SEG_FSDP = "configs/toy/upernet_swin-toy_fsdp_toy-ade.py"
SEG_DDP = "configs/toy/upernet_swin-toy_flexible-ddp_toy-ade.py"
ITERS = 3
#: bf16 autocast in both runs: the same bf16 operations on the same weights, so iteration 1 agrees
#: to float rounding; after it, FSDP's reduce-scatter and DDP's all-reduce may sum the fp32 gradients
#: in another order (other backends, more ranks), which bf16 rounding of the next forward can amplify
#: towards bf16's resolution (2^-8 = 4e-3). Seen here (gloo, 2 ranks, 3 iterations): bit-identical.
BF16_RTOL = 1e-3
#: the values compared: the total, the decode and auxiliary heads' losses
NAMES = ("loss", "decode.loss", "aux.loss")
#: a fixed seed, constant learning rate, every iteration logged, validation and the checkpoint at
#: the end, the model-zoo-layout file as load_from (appended by the fixtures)
RUN = FAST + ["randomness.seed=0", "param_scheduler.0.start_factor=1.0", "default_hooks.logger.interval=1",
              f"train_cfg.max_iters={ITERS}", f"train_cfg.val_interval={ITERS}",
              f"default_hooks.checkpoint.interval={ITERS}"]
SLURM = os.path.join(ROOT, "tests", "mmlab", "slurm")


def seg_metrics(work):
    return [{k: v for k, v in row.items() if k in ("aAcc", "mIoU", "mAcc")} for row in scalars(work) if "mIoU" in row]


def slurm_env(tmp, tasks=2):
    """What tools/slurm_*.sh need here: srun (the stand-in) on PATH, CPU tasks (no --gres), and
    the master's address / port (SLURM's first node is this machine)."""
    return dict(PATH=SLURM + os.pathsep + os.environ["PATH"], GPUS=str(tasks), GPUS_PER_NODE="0", CPUS_PER_TASK="1",
                SRUN_RECORD=str(tmp / "srun.json"))


@pytest.fixture(scope="module")
def start_file(tmp_path_factory, toy_data):  # noqa: F811
    """A whole-segmentor checkpoint in mmseg's model-zoo layout: the toy UPerNet's weights (another
    seed than the runs'), the backbone's keys in mmseg's SwinTransformer names, both heads' final
    convolutions zero (their logits are then 0: the first iteration's loss is ln(classes) exactly,
    which shows the file was loaded)."""
    import swin_backbone  # noqa: F401  (first: mmcv-lite, registration)
    from mmengine.config import Config
    from mmengine.registry import DefaultScope
    from mmseg.registry import MODELS

    from swin_backbone import detect_format
    from swin_backbone.checkpoint.formats import ours_to_mmdet

    os.environ.setdefault("TOY_DATA_ROOT", toy_data)
    cfg = Config.fromfile(os.path.join(ROOT, SEG_FSDP))
    with DefaultScope.overwrite_default_scope("mmseg"):
        torch.manual_seed(123)
        model = MODELS.build(cfg.model)
        model.init_weights()
    for head in (model.decode_head, model.auxiliary_head):
        torch.nn.init.zeros_(head.conv_seg.weight)
        torch.nn.init.zeros_(head.conv_seg.bias)
    state = model.state_dict()
    backbone = ours_to_mmdet({k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")})
    assert detect_format(backbone) == "mmdet"
    state = dict({k: v for k, v in state.items() if not k.startswith("backbone.")},
                 **{"backbone." + k: v for k, v in backbone.items()})
    path = tmp_path_factory.mktemp("start") / "upernet_toy_mmseg_layout.pth"
    torch.save({"state_dict": state, "meta": {}}, path)
    return str(path)


@pytest.fixture(scope="module")
def seg_ddp_run(tmp_path_factory, toy_data, start_file):  # noqa: F811
    """The reference: the recipe under DDPStrategy, bf16, 2 SLURM tasks (tools/slurm_train.sh)."""
    tmp = tmp_path_factory.mktemp("seg_ddp")
    work = str(tmp / "work")
    out = launch(["tools/slurm_train.sh", "debug", "swin-toy", SEG_DDP, work, "--amp", "--cfg-options", *RUN,
                  f"load_from={start_file}"], toy_data, env=slurm_env(tmp))[0]
    return work, out, json.load(open(tmp / "srun.json"))


@pytest.fixture(scope="module")
def seg_fsdp_run(tmp_path_factory, toy_data, start_file):  # noqa: F811
    """The recipe under FSDP, bf16, 2 processes (tools/dist_train.sh), sharded checkpoints, from
    the config as mmengine writes it into a work dir (``Config.dump``: values only; fine-tuning
    from it in fresh processes)."""
    from mmengine.config import Config

    tmp = tmp_path_factory.mktemp("seg_fsdp")
    os.environ["TOY_DATA_ROOT"] = toy_data  # read when the config is parsed
    dumped = str(tmp / os.path.basename(SEG_FSDP))
    Config.fromfile(os.path.join(ROOT, SEG_FSDP)).dump(dumped)
    work = str(tmp / "work")
    out = launch(["tools/dist_train.sh", dumped, "2", "--work-dir", work, "--amp", "--cfg-options", *RUN,
                  f"load_from={start_file}"], toy_data)[0]
    return work, out


def test_fsdp_bf16_from_a_model_zoo_file_trains_as_ddp_under_slurm(seg_ddp_run, seg_fsdp_run):
    (ddp, ddp_out, srun), (work, out) = seg_ddp_run, seg_fsdp_run
    # the DDP run went through srun as mmdet's slurm_train.sh does, with mmengine's slurm launcher
    assert srun["partition"] == "debug" and srun["job-name"] == "swin-toy" and srun["ntasks"] == "2"
    assert "gres" not in srun and srun["command"][-len(RUN) - 3:][:2] == ["--amp", "--cfg-options"]
    assert "--launcher=slurm" in srun["command"]
    ddp_log = open(glob.glob(os.path.join(ddp, "*", "*.log"))[0]).read()
    assert "Distributed launcher: slurm" in ddp_log and "GPU number: 2" in ddp_log
    # both runs in bf16 (the CPU's --amp), from the file: iteration 1's decode loss is ln(4 classes)
    for run in (ddp, work):
        assert "BF16AutocastOptimWrapper" in open(glob.glob(os.path.join(run, "*.py"))[0]).read()
        assert losses(run, NAMES)[1]["decode.loss_ce"] == pytest.approx(math.log(4), rel=1e-5)
    # under FSDP the file's mmseg-layout backbone keys were converted while the sharded model
    # loaded them on every rank, and every tensor of the model got a value
    assert "from format 'mmdet'" in out
    assert "SwinFSDPStrategy" in out and "missing: [] (0), unexpected: [] (0)" in out
    assert_losses_close(losses(work, NAMES), losses(ddp, NAMES), BF16_RTOL)
    assert len(losses(work)) == ITERS
    assert abs(losses(ddp)[1]["loss"] - losses(ddp)[ITERS]["loss"]) > 1e-3  # it trained
    got, expected = seg_metrics(work), seg_metrics(ddp)
    assert len(got) == len(expected) == 1
    # state_dict_cfg='local': a folder, one file per rank
    assert sorted(os.listdir(os.path.join(work, f"iter_{ITERS}.pth"))) == ["rank0.pth", "rank1.pth"]


def test_sharded_folder_tests_at_its_world_size_only(tmp_path, seg_fsdp_run, toy_data):  # noqa: F811
    """tools/slurm_test.sh with 2 tasks (the training's world size) evaluates the shard folder with
    the training's validation metrics; tools/test.py in one process refuses it, saying why."""
    work, _ = seg_fsdp_run
    folder = os.path.join(work, f"iter_{ITERS}.pth")
    cfg = os.path.join(work, os.path.basename(SEG_FSDP))  # the work-dir copy
    from swin_backbone.tools.test import main

    with pytest.raises(SystemExit) as one:  # in one process (no launcher): the one-line error, status 1
        main([cfg, folder, "--work-dir", str(tmp_path / "one")])
    assert str(one.value).startswith("tools/test.py: error: checkpoint")
    assert "a sharded FSDP checkpoint of 2 ranks" in str(one.value) and "this run has 1 process" in str(one.value)
    launch(["tools/slurm_test.sh", "debug", "swin-toy-test", cfg, folder, "--work-dir", str(tmp_path / "test")],
           toy_data, env=slurm_env(tmp_path))
    got = seg_metrics(str(tmp_path / "test"))
    assert len(got) == 1 and got[0] == pytest.approx(seg_metrics(work)[0], abs=1e-6)
