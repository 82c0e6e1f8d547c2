"""swin-convert-checkpoint as users run it: the installed entry point in a subprocess (this
checkout first on PYTHONPATH). Exit 0 with readable lines on stdout, 2 on usage errors, 1 on
failures with one line on stderr and no traceback; no partial output files."""
import os
import subprocess
import sys

import pytest
import torch

from swin_backbone import SwinBackbone, load_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slow  # the console script as a subprocess: out of `make test-fast`
SCRIPT = os.path.join(os.path.dirname(sys.executable), "swin-convert-checkpoint")
V1 = dict(arch=None, embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2), drop_path_rate=0.0)


def run(*args):
    assert os.path.isfile(SCRIPT), f"{SCRIPT}: the entry point is not installed (pip install -e .)"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([SCRIPT, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


def one_line_error(proc):
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture
def swin_file(tmp_path):
    model = SwinBackbone(**V1)
    model.init_weights()
    path = tmp_path / "swin.pth"
    torch.save({"state_dict": model.state_dict()}, path)
    return path, model


def test_runs_this_checkout():
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", "import swin_backbone; print(swin_backbone.__file__)"],
                          capture_output=True, text=True, env=env, cwd="/", check=True)
    # (the last line: on mmcv-lite, importing the package logs one line first)
    assert proc.stdout.strip().splitlines()[-1].startswith(ROOT)


def test_success_to_hf_safetensors(tmp_path, swin_file):
    src, model = swin_file
    dst = tmp_path / "out" / "model.safetensors"
    proc = run(src, dst, "--to", "hf", "--strict")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"checkpoint {src}: format 'ours'" in out
    assert f"wrote {dst} (hf layout, " in out and "safetensors" in out
    assert "architecture: embed_dims=16 depths=(1, 1, 1, 1)" in out
    assert "{'" not in out and "{\"" not in out  # lines, not a dict dump
    assert sorted(p.name for p in dst.parent.iterdir()) == ["model.safetensors"]  # no temporary file left
    back = SwinBackbone(**V1)
    assert load_checkpoint(back, str(dst), strict=True, logger=None).format == "hf"
    for key, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


@pytest.mark.parametrize("args", [[], ["only_src.pth"], ["a.pth", "b.pth", "--to", "keras"]])
def test_usage_errors_exit_2(args):
    proc = run(*args)
    assert proc.returncode == 2
    assert "usage: swin-convert-checkpoint" in proc.stderr and "Traceback" not in proc.stderr


def test_failures_exit_1_with_one_line(tmp_path, swin_file):
    src, _ = swin_file
    text = tmp_path / "notes.pth"
    text.write_text("just some text\n")
    line = one_line_error(run(text, tmp_path / "o.pth"))
    assert str(text) in line and "expected a torch checkpoint" in line and "found text" in line

    folder = tmp_path / "outdir"
    folder.mkdir()
    line = one_line_error(run(src, folder))
    assert f"dst {str(folder)!r}: is a directory" in line
    assert list(folder.iterdir()) == []

    # keys missing that the architecture is read from: a clear error naming the file and key
    state = torch.load(src, weights_only=True)["state_dict"]
    broken = {k: v for k, v in state.items() if not k.startswith("stages.2.blocks.0.attn.relative_position_bias")}
    torch.save(broken, tmp_path / "broken.pth")
    line = one_line_error(run(tmp_path / "broken.pth", tmp_path / "never.pth"))
    assert str(tmp_path / "broken.pth") in line and "stages.2.blocks.*.attn.relative_position_bias_table" in line
    assert not (tmp_path / "never.pth").exists()

    # the file named once, where the checkpoint holds no tensors or another network's
    torch.save([1, 2], tmp_path / "list.pth")
    torch.save({"state_dict": {"fc.weight": torch.ones(2, 2)}}, tmp_path / "fc.pth")
    for name, says in (("list.pth", "expected a dict of tensors"), ("fc.pth", "not a Swin Transformer checkpoint")):
        line = one_line_error(run(tmp_path / name, tmp_path / "never.pth"))
        assert f"checkpoint {tmp_path / name}: " in line and says in line and "checkpoint checkpoint" not in line, line


def test_partial_checkpoint_converts_what_it_has(tmp_path, swin_file):
    """Some keys missing (not ones the architecture is read from): converted with the per-key
    report, the missing tensors listed and not written (never random values in their place)."""
    src, model = swin_file
    state = torch.load(src, weights_only=True)["state_dict"]
    del state["stages.1.blocks.0.mlp.fc1.weight"]
    torch.save(state, tmp_path / "partial.pth")
    dst = tmp_path / "partial_out.pth"
    proc = run(tmp_path / "partial.pth", dst)
    assert proc.returncode == 0, proc.stderr
    assert "stages.1.blocks.0.mlp.fc1.weight" in proc.stdout
    assert "not written: 1 model tensors" in proc.stdout
    written = torch.load(dst, weights_only=True)["state_dict"]
    assert "stages.1.blocks.0.mlp.fc1.weight" not in written
    assert len(written) == len(model.state_dict()) - 1


def test_a_model_larger_than_the_file_holds_is_refused_before_it_is_built(tmp_path):
    """The architecture comes from the file's keys and shapes: stride-0 views let a few KB name
    a 5.5e9-parameter model (22 GB). Refused, sized on the meta device, before any allocation."""
    from swin_backbone.checkpoint import CheckpointError
    from swin_backbone.tools.convert_checkpoint import convert_file

    base = torch.zeros(1024)

    def view(*shape):
        return base.as_strided(shape, (0,) * len(shape))

    c, depths = 1024, (2, 2, 18, 2)
    state = {"patch_embed.proj.weight": view(c, 3, 4, 4)}
    for i, (depth, heads) in enumerate(zip(depths, (c // 32, c // 16, c // 8, c // 4))):
        state[f"stages.{i}.blocks.0.attn.relative_position_bias_table"] = view(169, heads)
        state[f"stages.{i}.blocks.{depth - 1}.attn.qkv.weight"] = base[:1]
    torch.save(state, tmp_path / "huge.pth")
    with pytest.raises(CheckpointError, match=r"a model of \d+ parameters .* far more than its 4096 bytes"):
        convert_file(str(tmp_path / "huge.pth"), str(tmp_path / "out.pth"))
    assert not (tmp_path / "out.pth").exists()
