"""Past one machine, tested on the CPU: the toy Mask R-CNN recipe on mmengine's FlexibleRunner with
FSDPStrategy (configs/toy/mask-rcnn_swin-toy_fpn_fsdp_toy-coco.py: one FSDP unit per Swin block,
original parameters, sharded checkpoints, with_cp, a frozen stage, per-stage learning rates).

* the FSDP run, launched as 2 nodes of 1 process (tools/dist_train.sh with NNODES / NODE_RANK /
  MASTER_PORT), trains as the same recipe under DDPStrategy on 1 node of 2 processes: equal losses
  at every iteration (``LOSS_RTOL``) and the same validation metrics;
* its sharded checkpoint (one file per rank) resumes on 1 node: the resumed iterations equal the
  uninterrupted run's;
* tools/dist_test.sh as 2 nodes (torchrun's c10d rendezvous) gives the metrics the training's
  validation gave for the same weights;
* the FSDP wrapping the config asks for (mmengine's MMFullyShardedDataParallel, in 2 gloo
  processes): one unit per block, the optimizer's per-parameter settings as without FSDP, the
  frozen stage unchanged by training steps; SwinBackbone and SwinV2Backbone gradients under
  FSDP equal the unsharded model's.

Real torchrun processes, real gloo, real mmdet / mmengine, the generated toy COCO."""
import glob
import os
import shutil
import subprocess
import sys

import pytest
import torch

from .test_tools_train import FAST, ROOT, scalars, toy_data  # noqa: F401  (fixture)

FSDP_CFG = "configs/toy/mask-rcnn_swin-toy_fpn_fsdp_toy-coco.py"
DDP_CFG = "configs/toy/mask-rcnn_swin-toy_fpn_flexible-ddp_toy-coco.py"
ITERS = 3
#: FSDP reduce-scatters gradients where DDP all-reduces them, which may sum in another order
#: (other backends, more ranks): equal to float rounding. Seen here (gloo, 2 ranks): bit-identical.
LOSS_RTOL = 1e-5
#: a fixed seed (same initial weights and data order in every run), a constant learning rate
#: from the first iteration (the toy schedule's warm-up would leave the weights almost still),
#: every iteration logged, validation at the end. No random draws during training (mmengine does
#: not restore random states on resume): no flips, and the RPN / R-CNN heads take every anchor and
#: proposal (PseudoSampler) instead of a random sample, so a resumed run can equal the uninterrupted one.
RUN = FAST + ["randomness.seed=0", "param_scheduler.0.start_factor=1.0", "default_hooks.logger.interval=1",
              f"train_cfg.max_iters={ITERS}", f"train_cfg.val_interval={ITERS}", "default_hooks.checkpoint.interval=2",
              "train_dataloader.dataset.pipeline.3.prob=0.0", "model.train_cfg.rpn.sampler.type=PseudoSampler",
              "model.train_cfg.rcnn.sampler.type=PseudoSampler"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, toy_data, nnodes=1, env=None, timeout=600):  # noqa: F811
    """``bash args`` once per node (NNODES / NODE_RANK set, the last node first); every node's
    output, after all succeeded."""
    base = dict(os.environ, TOY_DATA_ROOT=toy_data, OMP_NUM_THREADS="1", PYTHON=sys.executable,
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), NNODES=str(nnodes), **(env or {}))
    procs = {}
    try:
        for node in reversed(range(nnodes)):
            procs[node] = subprocess.Popen(["bash"] + args, cwd=ROOT, env=dict(base, NODE_RANK=str(node)),
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        outs = [procs[node].communicate(timeout=timeout)[0] for node in range(nnodes)]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for node, out in enumerate(outs):
        assert procs[node].returncode == 0, f"node {node} of {nnodes}: {' '.join(args)}\n{out[-6000:]}"
    return outs


def losses(work):
    """``{iteration: {loss name: value}}`` of the training rows logged under ``work``."""
    return {row["iter"]: {k: v for k, v in row.items() if k.startswith("loss")}
            for row in scalars(work) if "iter" in row and "loss" in row}


def metrics(work):
    return [{k: v for k, v in row.items() if k.startswith("coco/")} for row in scalars(work) if "coco/bbox_mAP" in row]


def assert_losses_close(got, expected, rtol):
    assert sorted(got) == sorted(expected) and got
    for it in expected:
        assert got[it].keys() == expected[it].keys()
        for name, value in expected[it].items():
            assert got[it][name] == pytest.approx(value, rel=rtol, abs=1e-6), f"iteration {it}, {name}"


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, toy_data):  # noqa: F811
    """The reference: the recipe under DDPStrategy, 1 node of 2 processes."""
    work = str(tmp_path_factory.mktemp("ddp"))
    launch(["tools/dist_train.sh", DDP_CFG, "2", "--work-dir", work, "--cfg-options", *RUN], toy_data)
    return work


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, toy_data):  # noqa: F811
    """The recipe under FSDPStrategy, 2 nodes of 1 process (static rendezvous: NODE_RANK orders
    the ranks, so rank 0 logs the losses of the same half of each batch as the reference's)."""
    work = str(tmp_path_factory.mktemp("fsdp"))
    outs = launch(["tools/dist_train.sh", FSDP_CFG, "1", "--work-dir", work, "--cfg-options", *RUN], toy_data,
                  nnodes=2)
    return work, outs


def test_fsdp_on_two_nodes_trains_as_ddp_on_one(ddp_run, fsdp_run):
    work, outs = fsdp_run
    log = open(glob.glob(os.path.join(work, "*", "*.log"))[0]).read()
    assert "Distributed training: True" in log and "GPU number: 2" in log  # mmengine's words for 2 ranks
    assert_losses_close(losses(work), losses(ddp_run), LOSS_RTOL)
    assert len(losses(work)) == ITERS
    # the losses moved: the comparison is not between two untrained models
    first, last = losses(ddp_run)[1]["loss"], losses(ddp_run)[ITERS]["loss"]
    assert abs(first - last) > 1e-3
    got, expected = metrics(work), metrics(ddp_run)
    assert len(got) == len(expected) == 1
    assert got[0] == pytest.approx(expected[0], abs=1e-3)
    # sharded checkpoints: a folder with one file per rank, each about half of DDP's full file
    shards = sorted(os.listdir(os.path.join(work, "iter_2.pth")))
    assert shards == ["rank0.pth", "rank1.pth"]
    full = os.path.getsize(os.path.join(ddp_run, "iter_2.pth"))
    for shard in shards:
        assert 0.4 * full < os.path.getsize(os.path.join(work, "iter_2.pth", shard)) < 0.6 * full


def test_sharded_checkpoint_resumes_on_one_node(tmp_path, fsdp_run, toy_data):  # noqa: F811
    """The 2-node run's iteration-2 shards, resumed by 1 node of 2 processes, continue it exactly."""
    work, _ = fsdp_run
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(os.path.join(work, "iter_2.pth"), resumed / "iter_2.pth")
    (resumed / "last_checkpoint").write_text(str(resumed / "iter_2.pth"))  # `--resume`: the latest one
    out = launch(["tools/dist_train.sh", FSDP_CFG, "2", "--work-dir", str(resumed), "--resume", "--cfg-options",
                  *RUN], toy_data)[0]
    assert "resumed" in out.lower()
    continued = losses(str(resumed))
    assert sorted(continued) == list(range(3, ITERS + 1))
    assert_losses_close(continued, {it: v for it, v in losses(work).items() if it >= 3}, 1e-6)
    got, expected = metrics(str(resumed)), metrics(work)
    assert len(got) == len(expected) == 1 and got[0] == pytest.approx(expected[0], abs=1e-6)
    assert sorted(os.listdir(resumed / f"iter_{ITERS}.pth")) == ["rank0.pth", "rank1.pth"]


def test_dist_test_on_two_nodes_equals_the_validation(tmp_path, ddp_run, toy_data):  # noqa: F811
    """tools/dist_test.sh as 2 nodes (c10d rendezvous) evaluates the final weights as the
    training's own validation did."""
    ckpt = os.path.join(ddp_run, f"iter_{ITERS}.pth")
    # mmengine's Runner (tools/test.py checks that the checkpoint fits the model it builds; under
    # FlexibleRunner the model is built only inside runner.test())
    launch(["tools/dist_test.sh", DDP_CFG, ckpt, "1", "--work-dir", str(tmp_path / "test"), "--cfg-options",
            "runner_type=Runner", *FAST[2:6]], toy_data, nnodes=2, env=dict(RDZV_BACKEND="c10d"))
    got = metrics(str(tmp_path / "test"))
    assert len(got) == 1 and got[0] == pytest.approx(metrics(ddp_run)[0], abs=1e-6)


# --------------------------------------------------------------------- the wrapping, in-process ranks
def _spawn(fn, *args, world=2):
    import torch.multiprocessing as mp

    port = free_port()
    mp.spawn(fn, args=(world, port) + args, nprocs=world, join=True)


def _init(rank, world, port):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _backbone_grads_rank(rank, world, port, cases):
    _init(rank, world, port)
    for version, with_cp in cases:
        _backbone_grads(rank, world, version, with_cp)


def _backbone_grads(rank, world, version, with_cp):
    """FSDP (one unit per block, original parameters) around a Swin with a frozen stage: after
    a backward of each rank's own images, the gathered gradients equal the unsharded model's on
    both ranks' images."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from swin_backbone import SwinBackbone, SwinBlock, SwinBlockV2, SwinV2Backbone

    cls = SwinV2Backbone if version == 2 else SwinBackbone
    kw = dict(arch=None, embed_dims=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), drop_path_rate=0.0,
              frozen_stages=1, with_cp=with_cp, window_size=4)
    torch.manual_seed(0)
    model = cls(**kw)
    model.init_weights()
    ref = cls(**kw)
    ref.load_state_dict(model.state_dict())
    sharded = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({SwinBlock, SwinBlockV2}), use_orig_params=True,
                   device_id=torch.device("cpu"))
    units = [m for m in FSDP.fsdp_modules(sharded) if isinstance(m.module, (SwinBlock, SwinBlockV2))]
    assert len(units) == 8  # one per block
    images = [torch.randn(2, 3, 40, 56, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    sum(o.square().mean() for o in sharded.train()(images[rank])).backward()
    sum(o.square().mean() for o in ref.train()(torch.cat(images))).backward()
    with FSDP.summon_full_params(sharded, with_grads=True):
        named = {k.replace("_fsdp_wrapped_module.", ""): v for k, v in sharded.named_parameters()}
        assert named.keys() == dict(ref.named_parameters()).keys()
        for name, p in ref.named_parameters():
            got = named[name]
            if not p.requires_grad:  # frozen stage 0 / patch embedding: no gradient (zeros where the
                # unit's flat gradient covers it: the patch embedding shares the root unit)
                assert got.grad is None or not got.grad.any(), name
            else:
                torch.testing.assert_close(got.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_backbone_gradients_under_fsdp_equal_unsharded():
    _spawn(_backbone_grads_rank, [(1, True), (1, False), (2, False), (2, True)])


def _recipe_rank(rank, world, port, toy_data):  # noqa: F811
    """The config's own wrapping (mmengine MMFullyShardedDataParallel from ``strategy``): the
    optimizer's per-parameter settings equal those of the unwrapped model, and two training
    steps leave the frozen stage as it was and change the rest."""
    _init(rank, world, port)
    os.environ["TOY_DATA_ROOT"] = toy_data
    from mmdet.testing import demo_mm_inputs
    from mmengine.config import Config
    from mmengine.optim import build_optim_wrapper
    from mmengine.registry import MODEL_WRAPPERS, DefaultScope
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import swin_backbone
    from mmdet.registry import MODELS

    cfg = Config.fromfile(os.path.join(ROOT, FSDP_CFG))
    with DefaultScope.overwrite_default_scope("mmdet"):
        torch.manual_seed(0)
        model = MODELS.build(cfg.model)
        model.init_weights()
        start = {k: v.detach().clone() for k, v in model.named_parameters()}
        plain = MODELS.build(cfg.model)
        expected = {}
        for group in build_optim_wrapper(plain, cfg.optim_wrapper.copy()).optimizer.param_groups:
            names = {id(p): n for n, p in plain.named_parameters()}
            for p in group["params"]:
                expected[names[id(p)]] = (group["lr"], group["weight_decay"])
        wrapped = MODEL_WRAPPERS.build(cfg.strategy.model_wrapper, default_args=dict(
            module=model, device_id=int(os.environ["LOCAL_RANK"]), type="MMFullyShardedDataParallel"))
        blocks = [m for m in FSDP.fsdp_modules(wrapped) if isinstance(m.module, (swin_backbone.SwinBlock,))]
        assert len(blocks) == sum(model.backbone.depths)
        optim = build_optim_wrapper(wrapped, cfg.optim_wrapper.copy())
        names = {id(p): n.replace("_fsdp_wrapped_module.", "") for n, p in wrapped.module.named_parameters()}
        got = {names[id(p)]: (g["lr"], g["weight_decay"]) for g in optim.optimizer.param_groups for p in g["params"]}
        assert got == expected
        lr, decay = cfg.optim_wrapper.optimizer.lr, cfg.optim_wrapper.optimizer.weight_decay
        assert got["backbone.stages.1.blocks.0.attn.qkv.weight"] == pytest.approx((0.5 * lr, decay))
        assert got["backbone.stages.3.blocks.0.attn.qkv.weight"] == pytest.approx((lr, decay))
        assert got["backbone.stages.3.blocks.0.norm1.weight"] == pytest.approx((lr, 0.0))
        for step in range(2):
            data = demo_mm_inputs(batch_size=1, image_shapes=[(3, 96, 128)], num_items=[3], num_classes=3,
                                  with_mask=True)
            wrapped.train_step(data, optim)
        with FSDP.summon_full_params(wrapped):
            now = {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone() for k, v in wrapped.named_parameters()}
        assert now.keys() == start.keys()
        frozen = [k for k in start if k.startswith(("backbone.patch_embed.", "backbone.stages.0.", "backbone.norm0."))]
        assert frozen and all(torch.equal(now[k], start[k]) for k in frozen)
        trained = [k for k in start if k.startswith("backbone.stages.1.blocks.") and k.endswith("weight")]
        assert trained and all(not torch.equal(now[k], start[k]) for k in trained)


def test_recipe_wrapping_keeps_paramwise_settings_and_frozen_stage(toy_data):  # noqa: F811
    _spawn(_recipe_rank, toy_data)
