"""Which of mmcv's compiled ops the Swin models of mmdet 3.3, mmseg 1.2 and this project call, on
mmcv-lite: each model built from its shipped config (a small Swin via config overrides, small
images), a training step (loss + backward) and a prediction, with every ``_ext`` call recorded.
The recorded ops are the coverage table of docs/mmcv-lite.md; a test fails if a model calls an op
the table does not list for it (or stops calling one), and any op not covered raises in the step."""
import copy
import importlib.util
import os

import pytest
import torch

import swin_backbone  # noqa: F401,I001  (installs the mmcv._ext finder: a checkout has no .pth)
from mmengine.config import Config, ConfigDict
from mmengine.registry import DefaultScope

from .common import Recorder, lite_ext, use_ext

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NMS, ROI = {"nms"}, {"roi_align_forward", "roi_align_backward"}
FOCAL = {"sigmoid_focal_loss_forward", "sigmoid_focal_loss_backward"}  # mmdet's FocalLoss: on CUDA only
MSDA = {"ms_deform_attn_forward", "ms_deform_attn_backward"}  # mmcv calls it on CUDA only
DCN = {"modulated_deform_conv_forward", "modulated_deform_conv_backward"}

#: family: (library, config (lib: inside the installed package; ours: under configs/), ops on the
#: CPU, ops added on CUDA).
FAMILIES = {
    "mask-rcnn": ("mmdet", "lib:swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py", NMS | ROI, set()),
    "cascade-mask-rcnn": ("mmdet", "ours:mmdet/cascade-mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py", NMS | ROI,
                          set()),
    "retinanet": ("mmdet", "lib:swin/retinanet_swin-t-p4-w7_fpn_1x_coco.py", NMS, FOCAL),
    "mask2former": ("mmdet", "lib:mask2former/mask2former_swin-t-p4-w7-224_8xb2-lsj-50e_coco.py", set(), MSDA),
    "maskformer": ("mmdet", "lib:maskformer/maskformer_swin-l-p4-w12_64xb1-ms-300e_coco.py", set(), FOCAL),
    "dino": ("mmdet", "lib:dino/dino-5scale_swin-l_8xb2-12e_coco.py", set(), MSDA | FOCAL),
    "dyhead-atss": ("mmdet", "lib:dyhead/atss_swin-l-p4-w12_fpn_dyhead_ms-2x_coco.py", NMS | DCN, FOCAL),
    "rtmdet": ("mmdet", "lib:rtmdet/rtmdet_l_swin_b_4xb32-100e_coco.py", NMS, set()),
    "ddq-detr": ("mmdet", "lib:ddq/ddq-detr-4scale_swinl_8xb2-30e_coco.py", NMS, MSDA | FOCAL),
    "upernet": ("mmseg", "lib:swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py", set(),
                set()),
    "upernet-ours": ("mmseg", "ours:mmseg/upernet_swin-t_512x512_160k_ade20k.py", set(), set()),
    "mask2former-seg": ("mmseg", "lib:mask2former/mask2former_swin-t_8xb2-160k_ade20k-512x512.py", set(), MSDA),
    "maskformer-seg": ("mmseg", "lib:maskformer/maskformer_swin-t_upernet_8xb2-160k_ade20k-512x512.py", set(),
                       FOCAL),
    "knet": ("mmseg", "lib:knet/knet-s3_swin-t_upernet_8xb2-adamw-80k_ade20k-512x512.py", set(), set()),
    # with a language model: a one-layer BERT written to a temporary directory (tiny_bert)
    "glip": ("mmdet", "lib:glip/glip_atss_swin-t_a_fpn_dyhead_pretrain_obj365.py", NMS | DCN, set()),
    "grounding-dino": ("mmdet", "lib:grounding_dino/grounding_dino_swin-t_pretrain_obj365_goldg_cap4m.py", set(),
                       MSDA),
}
LANGUAGE = ("glip", "grounding-dino")
CLASS_NAMES = ("person", "car", "dog")
EMBED = 32
SIZE = 128


def config_path(lib, where):
    kind, rel = where.split(":", 1)
    if kind == "ours":
        return os.path.join(ROOT, "configs", rel)
    spec = importlib.util.find_spec(lib)
    return os.path.join(spec.submodule_search_locations[0], ".mim", "configs", rel)


def _remap_channels(node, old, new):
    """Every ``in_channels`` list equal to the backbone's old channels gets the new ones."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "in_channels" and isinstance(v, (list, tuple)) and list(v) == old:
                node[k] = new
            else:
                _remap_channels(v, old, new)
    elif isinstance(node, (list, tuple)):
        for v in node:
            _remap_channels(v, old, new)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A one-layer BERT (hidden size 768, as GLIP's fusion layers expect) with a 16-word vocabulary,
    saved as Hugging Face files: GLIP and Grounding DINO load it by path instead of downloading
    bert-base-uncased. Random weights: the ops, not the language, are under test."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers.BertTokenizer, "batch_encode_plus"):
        pytest.skip(f"mmdet 3.3's language model calls tokenizer.batch_encode_plus, which transformers "
                    f"{transformers.__version__} removed (5.0): GLIP / Grounding DINO do not run here with any mmcv; "
                    "their mmcv layers are DyHead's ModulatedDeformConv2d and DINO's MultiScaleDeformableAttention")
    path = tmp_path_factory.mktemp("tiny-bert")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "a", "the", "and"] + list(CLASS_NAMES)
    (path / "vocab.txt").write_text("\n".join(words) + "\n")
    transformers.BertTokenizer(str(path / "vocab.txt")).save_pretrained(str(path))
    config = transformers.BertConfig(vocab_size=len(words), hidden_size=768, num_hidden_layers=1,
                                     num_attention_heads=12, intermediate_size=64, max_position_embeddings=256)
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(str(path))
    return str(path)


def _set_language_model(node, path):
    """Every BERT name in the model config (the language model's, GLIP's head's) -> ``path``."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("name", "lang_model_name") and v == "bert-base-uncased":
                node[k] = path
            else:
                _set_language_model(v, path)
    elif isinstance(node, (list, tuple)):
        for v in node:
            _set_language_model(v, path)


def small_model_cfg(lib, where, bert=None):
    """The config's model with a small Swin (32 channels, one block a stage), random weights, sizes
    for SIZE x SIZE images, fewer queries: the same layers, quicker."""
    cfg = Config.fromfile(config_path(lib, where))
    model = copy.deepcopy(cfg.model)
    bb = model.backbone
    out_indices = list(bb.get("out_indices", (0, 1, 2, 3)))
    old_embed = bb.get("embed_dims", 96) if bb.get("arch", None) is None else {"tiny": 96}.get(bb.arch, 96)
    old = [old_embed * 2 ** i for i in out_indices]
    new = [EMBED * 2 ** i for i in out_indices]
    bb.update(embed_dims=EMBED, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8), init_cfg=None, drop_path_rate=0.0)
    if bb.type == "SwinBackbone":
        bb.update(arch=None)
    else:
        bb.update(window_size=4, pretrain_img_size=SIZE)
    model.pop("pretrained", None)
    _remap_channels(model, old, new)
    if bert is not None:
        _set_language_model(model, bert)
    aux = model.get("auxiliary_head")
    if isinstance(aux, dict) and aux.get("in_channels") == old_embed * 4:
        aux.in_channels = EMBED * 4
    pre = model.data_preprocessor
    if "batch_augments" in pre:
        pre.batch_augments = None
    if lib == "mmseg":
        pre.size = (SIZE, SIZE)
    _set_all(model, "num_queries", 50)
    for head in (model, model.get("decode_head") or {}):  # Mask2Former's point-sampled mask loss (12544 points)
        if isinstance(head.get("train_cfg"), dict) and "num_points" in head.train_cfg:
            head.train_cfg.num_points = 1024
    for key, value in (("nms_pre", 200), ("max_per_img", 50), ("num", 64), ("fc_out_channels", 256),
                       ("num_layers", 2), ("feedforward_channels", 256), ("score_thr", 0.0)):
        # fewer proposals, sampled RoIs and detections; smaller box heads; two transformer layers; every
        # score kept (freshly initialised classifiers score under the usual 0.05: NMS would see no box)
        _set_all(model, key, value)
    return cfg, model


#: Families trained with instance masks (RTMDet's assigner would take masks for RTMDet-Ins's).
WITH_MASKS = ("mask-rcnn", "cascade-mask-rcnn", "mask2former", "maskformer")


def det_batch(num_classes, with_mask, texts=None):
    from mmdet.testing import demo_mm_inputs

    return demo_mm_inputs(2, [(3, SIZE, SIZE)] * 2, num_items=[3, 2], num_classes=num_classes, with_mask=with_mask,
                          texts=texts)


def seg_batch(num_classes):
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample

    inputs, samples = [], []
    for i in range(2):
        inputs.append(torch.randint(0, 256, (3, SIZE, SIZE), dtype=torch.uint8))
        sample = SegDataSample(metainfo=dict(img_shape=(SIZE, SIZE), ori_shape=(SIZE, SIZE), pad_shape=(SIZE, SIZE)))
        labels = torch.randint(0, num_classes, (1, SIZE // 16, SIZE // 16)).repeat_interleave(16, 1).repeat_interleave(
            16, 2)
        sample.gt_sem_seg = PixelData(data=labels)
        samples.append(sample)
    return dict(inputs=inputs, data_samples=samples)


def num_classes(node):
    """The first ``num_classes`` (or things + stuff) in the model config."""
    if isinstance(node, dict):
        if "num_classes" in node:
            return node["num_classes"]
        if "num_things_classes" in node:
            return node["num_things_classes"] + node.get("num_stuff_classes", 0)
        node = list(node.values())
    if isinstance(node, (list, tuple)):
        for v in node:
            n = num_classes(v)
            if n is not None:
                return n
    return None


def _set_all(node, key, value):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key and isinstance(v, (int, float)) and not isinstance(v, bool):
                node[k] = value
            else:
                _set_all(v, key, value)
    elif isinstance(node, (list, tuple)):
        for v in node:
            _set_all(v, key, value)


def train_and_predict(lib, model_cfg, batch, device="cpu"):
    """One loss + backward (train mode) and one prediction (eval mode) of the built model."""
    registry = importlib.import_module(f"{lib}.registry").MODELS
    with DefaultScope.overwrite_default_scope(lib):
        model = registry.build(model_cfg)
    model.init_weights()  # DETR-like models leave parameters uninitialised (torch.Tensor(n, d)) until here
    model.to(device)
    model.train()
    data = model.data_preprocessor(copy.deepcopy(batch), True)
    losses = model.loss(data["inputs"], data["data_samples"])
    total = sum(v.sum() for k, v in losses.items() if "loss" in k and isinstance(v, torch.Tensor)) + sum(
        sum(x.sum() for x in v) for k, v in losses.items() if "loss" in k and isinstance(v, list))
    total.backward()
    assert torch.isfinite(total)
    model.eval()
    with torch.no_grad():
        data = model.data_preprocessor(copy.deepcopy(batch), False)
        preds = model.predict(data["inputs"], data["data_samples"])
    assert len(preds) == 2
    return total


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_calls_the_listed_ops(family, device, one_thread, request):
    lib, where, cpu_ops, cuda_ops = FAMILIES[family]
    bert = request.getfixturevalue("tiny_bert") if family in LANGUAGE else None
    _, model_cfg = small_model_cfg(lib, where, bert)
    n = len(CLASS_NAMES) if bert else num_classes(model_cfg)
    texts = [CLASS_NAMES] * 2 if bert else None
    batch = det_batch(n, family in WITH_MASKS, texts) if lib == "mmdet" else seg_batch(n)
    recorder = Recorder(lite_ext())
    with use_ext(recorder):
        train_and_predict(lib, model_cfg, batch, device)
    called = {op for op, devices in recorder.calls.items() if device.type in devices}
    expected = cpu_ops | (cuda_ops if device.type == "cuda" else set())
    assert called == expected, f"{family}: calls {sorted(called)}, the table lists {sorted(expected)}"


def test_the_families_call_exactly_the_served_ops():
    """docs/mmcv-lite.md's table, ext.OPS and the ops the families above call are one list."""
    from swin_backbone.mmcv_lite.ext import OPS

    called = set().union(*(cpu | cuda for _, _, cpu, cuda in FAMILIES.values()))
    assert called == set(OPS), (sorted(called ^ set(OPS)))
