"""Hostile checkpoint files, one table: each row builds a file, loads it into a model and
asserts the exception type and that the message names the file and what was expected (or,
for files that are fine after all, the correct result)."""
import os

import pytest
import torch

from swin_backbone import CheckpointError, SwinBackbone, SwinV2Backbone, load_checkpoint
from swin_backbone.checkpoint import CheckpointNotFoundError

from ..helpers import TINY as V1

V2 = dict(V1, window_size=8)
EXPECTED_ANY = "expected a torch checkpoint (torch.save: zip or legacy pickle) or a safetensors file"


def _v1(**kw):
    return SwinBackbone(**dict(V1, **kw))


def _v2(**kw):
    return SwinV2Backbone(**dict(V2, **kw))


def _save(path, obj):
    torch.save(obj, path)
    return path


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def _half(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _safetensors(path, state):
    save_file = pytest.importorskip("safetensors.torch").save_file
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def _transformers_file(tmp_path, name):
    """A transformers model of another architecture, saved as transformers saves it."""
    transformers = pytest.importorskip("transformers")
    if name == "vit":
        cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                     image_size=32, patch_size=8)
        model = transformers.ViTForImageClassification(cfg)
    elif name == "convnext":
        cfg = transformers.ConvNextConfig(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1])
        model = transformers.ConvNextForImageClassification(cfg)
    else:
        model = transformers.Swinv2Model(transformers.Swinv2Config(
            embed_dim=16, depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 4], window_size=8, image_size=256))
    model.save_pretrained(tmp_path / name)
    return tmp_path / name / "model.safetensors"


def _timm_vit(path):
    timm = pytest.importorskip("timm")
    return _save(path, timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1, num_classes=0).state_dict())


# Each row: (id, build(tmp_path) -> path, model factory, exception type or None, message parts).
# Every error message must also name the file; rows with None must load (checked per row below).
ROWS = [
    ("missing", lambda t: t / "nope.pth", _v1, CheckpointNotFoundError, ["no such file", EXPECTED_ANY]),
    ("directory", lambda t: t, _v1, CheckpointError, ["is a directory", "expected a file"]),
    ("empty", lambda t: _write(t / "empty.pth", b""), _v1, CheckpointError, ["the file is empty", EXPECTED_ANY]),
    ("text", lambda t: _write(t / "notes.pth", b"this is not a checkpoint\n"), _v1, CheckpointError,
     [EXPECTED_ANY, "found text", "this is not a checkpoint"]),
    ("random-bytes", lambda t: _write(t / "noise.bin", bytes(range(7, 250)) * 4), _v1, CheckpointError,
     [EXPECTED_ANY, "found binary data"]),
    ("truncated-zip", lambda t: _half(_save(t / "half.pth", _v1().state_dict())), _v1, CheckpointError,
     [EXPECTED_ANY, "zip archive that cannot be read", "truncated"]),
    ("truncated-safetensors", lambda t: _half(_safetensors(t / "half.safetensors", _v1().state_dict())), _v1,
     CheckpointError, ["expected a complete safetensors file", "truncated"]),
    ("text-named-safetensors", lambda t: _write(t / "x.safetensors", b"{not really}"), _v1, CheckpointError,
     ["expected a safetensors file", "found text"]),
    ("torch-zip-named-safetensors", lambda t: _save(t / "y.safetensors", _v1().state_dict()), _v1, CheckpointError,
     ["expected a safetensors file", "a torch zip archive (torch.save), not safetensors"]),
    ("not-a-dict", lambda t: _save(t / "list.pth", [torch.zeros(1)]), _v1, CheckpointError,
     ["expected a dict of tensors", "got list"]),
    ("no-tensors", lambda t: _save(t / "meta.pth", {"epoch": 3, "meta": {"lr": 0.1}}), _v1, CheckpointError,
     ["found no tensors", "'epoch'"]),
    ("no-swin-keys", lambda t: _save(t / "other.pth", {"foo.weight": torch.zeros(2)}), _v1, CheckpointError,
     ["not a Swin Transformer checkpoint of any known format", "foo.weight"]),
    ("timm-vit", lambda t: _timm_vit(t / "vit.pth"), _v1, CheckpointError,
     ["not a Swin Transformer checkpoint", "a plain ViT", "cls_token"]),
    ("transformers-vit", lambda t: _transformers_file(t, "vit"), _v1, CheckpointError,
     ["not a Swin Transformer checkpoint", "a Hugging Face transformers 'vit' model", "vit.embeddings"]),
    ("transformers-convnext", lambda t: _transformers_file(t, "convnext"), _v1, CheckpointError,
     ["not a Swin Transformer checkpoint", "transformers 'convnext' model"]),
    ("wider-swin", lambda t: _save(t / "wide.pth", SwinBackbone(**dict(V1, embed_dims=32)).state_dict()), _v1,
     CheckpointError, ["format 'ours'", "tensors match (wrong architecture?)", "mismatched"]),
    ("deeper-swin", lambda t: _save(t / "deep.pth", SwinBackbone(**dict(V1, depths=(2, 2, 4, 2))).state_dict()),
     _v1, None, []),
    ("v2-into-v1", lambda t: _save(t / "v2.pth", _v2().state_dict()), _v1, CheckpointError,
     ["a Swin V2 (SwinV2Backbone) checkpoint", "use SwinV2Backbone"]),
    ("v1-into-v2", lambda t: _save(t / "v1.pth", _v1().state_dict()), _v2, CheckpointError,
     ["a Swin V1 (SwinBackbone) checkpoint", "use SwinBackbone"]),
    ("transformers-v2-into-v1", lambda t: _transformers_file(t, "swinv2"), _v1, CheckpointError,
     ["format 'hf-v2'", "use SwinV2Backbone"]),
    ("nested-odd-keys", lambda t: _save(t / "nested.pth", {"weights": {"net": _v1().state_dict()}, "step": 7}),
     _v1, None, []),
    ("two-nested-dicts", lambda t: _save(t / "two.pth", {"a": {"net": _v1().state_dict()}, "b": {"x": torch.ones(1)}}),
     _v1, CheckpointError, ["expected one dict of tensors", "'a.net'", "'b'"]),
]


@pytest.mark.parametrize("build, model, error, parts", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_hostile_checkpoint(tmp_path, build, model, error, parts):
    path = build(tmp_path)
    net = model()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    if error is None:
        report = load_checkpoint(net, str(path), logger=None)
        assert report.loaded and not report.missing and not report.mismatched, report.summary()
        return
    with pytest.raises(error) as info:
        load_checkpoint(net, str(path), logger=None)
    message = str(info.value)
    assert os.fspath(path) in message, message  # names the file
    for part in parts:
        assert part in message, f"{part!r} not in: {message}"
    # nothing partially loaded
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


def test_deeper_and_nested_rows_report_what_they_did(tmp_path):
    """The two rows that load: a deeper Swin loads with its extra blocks listed by key, a dict
    nested under odd keys loads with the path it was found under."""
    deep = _save(tmp_path / "deep.pth", SwinBackbone(**dict(V1, depths=(2, 2, 4, 2))).state_dict())
    report = load_checkpoint(_v1(), str(deep), logger=None)
    assert sorted({k.split(".attn")[0].split(".norm")[0].split(".mlp")[0] for k in report.unexpected}) == [
        "stages.2.blocks.2", "stages.2.blocks.3"]
    nested = _save(tmp_path / "nested.pth", {"weights": {"net": _v1().state_dict()}, "step": 7})
    report = load_checkpoint(_v1(), str(nested), strict=True, logger=None)
    assert report.unwrapped == ["took 'weights' -> 'net'"]


def test_missing_file_is_also_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        load_checkpoint(_v1(), str(tmp_path / "nope.pth"), logger=None)


def test_text_file_through_feature_extractor(tmp_path):
    """The same reader under the feature-extraction API (no IndexError from the unpickler)."""
    from swin_backbone.features import FeatureExtractor

    path = _write(tmp_path / "weights.pth", b"not weights\n")
    with pytest.raises(CheckpointError, match=r"weights\.pth.*found text"):
        FeatureExtractor.from_arch("tiny", checkpoint=str(path))
