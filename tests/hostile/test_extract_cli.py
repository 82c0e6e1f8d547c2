"""Hostile command lines and files for swin-extract-features, in process (the console-script
subprocesses are in test_console_scripts.py).

Usage rows: argparse's exit status 2 and a message naming the option, what it expects and
what it got, before any model is built or image read. Failure rows: ``main`` returns 1 and
says why in one line. File rows: one run over a folder of hostile image files; each file is
either extracted correctly or listed as failed with the reason, naming it. Output rows: names
that cannot collide, OUT_DIR inside INPUT never read as input, no temporary files left."""
import os

import numpy as np
import pytest
from PIL import Image

from swin_backbone.tools import extract_features as tool
from swin_backbone.checkpoint.files import atomic_write

SMALL = ["--embed-dims", "16", "--depths", "1", "1", "1", "1", "--num-heads", "1", "2", "4", "8",
         "--random-weights", "--no-progress", "--batch-size", "2", "--workers", "0"]


def save(path, array, **kw):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(array).save(path, **kw)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    rng = np.random.RandomState(0)
    save(str(root / "in" / "a.png"), rng.randint(0, 256, (24, 40, 3), dtype=np.uint8))
    save(str(root / "in" / "b.jpg"), rng.randint(0, 256, (24, 40, 3), dtype=np.uint8))
    (root / "empty").mkdir()
    (root / "file.txt").write_text("not a folder")
    (root / "ckpt_dir").mkdir()
    return root


USAGE_ROWS = [
    # (id, arguments after INPUT OUT_DIR; SMALL is appended unless the row says RAW, words in the message)
    ("no-weights", "RAW --no-progress", ["--checkpoint", "--random-weights"]),
    ("checkpoint-and-random", "--checkpoint {root}/file.txt", ["--random-weights", "not allowed"]),
    ("checkpoint-missing", "RAW --checkpoint {root}/none.pth", ["--checkpoint", "no such file"]),
    ("checkpoint-folder", "RAW --checkpoint {root}/ckpt_dir", ["--checkpoint", "folder"]),
    ("config-missing", "RAW --config {root}/none.py --random-weights", ["--config", "no such file"]),
    ("config-and-arch", "RAW --config {root}/file.txt --arch tiny --random-weights", ["--arch", "not allowed"]),
    ("config-and-embed-dims", "RAW --config {root}/file.txt --embed-dims 16 --random-weights", ["--embed-dims",
                                                                                                 "--config"]),
    ("config-and-window", "RAW --config {root}/file.txt --window-size 7 --random-weights", ["--window-size"]),
    ("pretrained-windows-v1", "--pretrained-window-sizes 8", ["--pretrained-window-sizes", "V2"]),
    ("pretrained-windows-negative", "RAW --arch v2-tiny --pretrained-window-sizes -1 --random-weights",
     ["--pretrained-window-sizes", ">= 0", "-1"]),
    ("batch-size-zero", "--batch-size 0", ["--batch-size", ">= 1", "0"]),
    ("batch-size-negative", "--batch-size -1", ["--batch-size", ">= 1"]),
    ("batch-size-float", "--batch-size 1.5", ["--batch-size", "invalid int"]),
    ("batch-size-word", "--batch-size four", ["--batch-size", "invalid int"]),
    ("workers-negative", "--workers -1", ["--workers", ">= 0"]),
    ("workers-word", "--workers x", ["--workers", "invalid int"]),
    ("resize-zero", "--resize 0 0", ["--resize", ">= 1"]),
    ("resize-negative", "--resize -5 10", ["--resize", ">= 1"]),
    ("resize-one-value", "RAW --random-weights --resize 10", ["--resize", "2 arguments"]),
    ("resize-words", "--resize a b", ["--resize", "invalid int"]),
    ("no-maps-alone", "--no-maps", ["--no-maps", "--pool"]),
    ("dist-timeout-zero", "--dist-timeout 0", ["--dist-timeout", "> 0"]),
    ("dist-timeout-negative", "--dist-timeout -1", ["--dist-timeout", "> 0"]),
    ("dist-timeout-nan", "--dist-timeout nan", ["--dist-timeout", "> 0"]),
    ("stages-beyond", "--stages 7", ["--stages", "< 4", "7"]),
    ("stages-four", "--stages 0 4", ["--stages", "< 4"]),
    ("stages-negative", "--stages -1", ["--stages", ">= 0"]),
    ("stages-duplicate", "--stages 0 0", ["--stages", "each once"]),
    ("stages-word", "--stages x", ["--stages", "invalid int"]),
    ("stages-beyond-custom-depths", "RAW --random-weights --embed-dims 16 --depths 1 1 --num-heads 1 2 --stages 2",
     ["--stages", "< 2"]),
    ("window-zero", "--window-size 0", ["--window-size", "[1, 128]", "0"]),
    ("window-negative", "--window-size -7", ["--window-size", "[1, 128]"]),
    ("window-huge", "--window-size 1000", ["--window-size", "[1, 128]", "1000"]),
    ("window-float", "--window-size 7.5", ["--window-size", "invalid int"]),
    ("embed-dims-zero", "RAW --random-weights --embed-dims 0", ["--embed-dims", ">= 1"]),
    ("embed-dims-negative", "RAW --random-weights --embed-dims -16", ["--embed-dims", ">= 1"]),
    ("embed-dims-float", "RAW --random-weights --embed-dims 33.9", ["--embed-dims", "invalid int", "33.9"]),
    ("embed-dims-word", "RAW --random-weights --embed-dims abc", ["--embed-dims", "invalid int", "abc"]),
    ("depths-zero", "RAW --random-weights --depths 1 0 1 1", ["--depths", ">= 1"]),
    ("num-heads-zero", "RAW --random-weights --num-heads 0 2 4 8", ["--num-heads", ">= 1"]),
    ("num-heads-length", "RAW --random-weights --depths 1 1 1 1 --num-heads 1 2", ["--num-heads", "one per stage"]),
    ("device-banana", "--device banana", ["--device", "'cpu', 'cuda'", "banana"]),
    ("device-empty", "--device ''", ["--device"]),
    ("device-cuda-index", "--device cuda:99", ["--device"]),
    ("dtype-unknown", "--dtype float32", ["--dtype", "invalid choice"]),
    ("format-unknown", "--format h5", ["--format", "invalid choice"]),
    ("pool-unknown", "--pool max", ["--pool", "invalid choice"]),
    ("reader-unknown", "--reader cv2", ["--reader", "invalid choice"]),
    ("mean-two-values", "RAW --random-weights --mean 1 2", ["--mean", "3 arguments"]),
    ("mean-nan", "--mean nan 0 0", ["--mean", "finite"]),
    ("std-zero", "--std 0 0 0", ["--std", "> 0"]),
    ("std-negative", "--std -1 1 1", ["--std", "> 0"]),
    ("std-inf", "--std inf 1 1", ["--std", "finite"]),
    ("seed-word", "--seed x", ["--seed", "invalid int"]),
    ("unknown-option", "--fast", ["unrecognized", "--fast"]),
    ("input-missing", "INPUT={root}/nowhere", ["input", "no such file or folder", "nowhere"]),
    ("out-dir-is-a-file", "OUT={root}/file.txt", ["out_dir", "is a file", "folder"]),
    ("out-dir-under-a-file", "OUT={root}/file.txt/sub", ["out_dir", "is a file"]),
    ("out-dir-is-input", "OUT={root}/in", ["out_dir", "input folder itself"]),
]


def command(tree, spec):
    words = spec.format(root=tree).split()
    inp, out, raw = str(tree / "in"), str(tree / "out"), False
    rest = []
    for w in words:
        if w == "RAW":
            raw = True
        elif w.startswith("INPUT="):
            inp = w[6:]
        elif w.startswith("OUT="):
            out = w[4:]
        else:
            rest.append("" if w == "''" else w)
    return [inp, out] + ([] if raw else SMALL) + rest  # (the row's options last: they win)


@pytest.mark.parametrize("spec,says", [pytest.param(s, w, id=i) for i, s, w in USAGE_ROWS])
def test_usage_row(tree, spec, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        tool.main(command(tree, spec))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    for word in says:
        assert word.lower() in err.lower(), (word, err)
    assert not (tree / "out").exists()  # refused before anything was written


FAILURE_ROWS = [
    ("input-folder-without-images", "INPUT={root}/empty", ["no images found"]),
    ("input-glob-matching-nothing", "INPUT={root}/in/*.tiff", ["no images found"]),
    ("arch-unknown", "RAW --arch tinyy --random-weights --no-progress", ["arch", "tiny"]),
    ("heads-not-dividing", "RAW --random-weights --embed-dims 16 --depths 1 1 1 1 --num-heads 3 2 4 8",
     ["num_heads[0]", "divisor"]),
    # references are fetched, not refused as missing files (a closed loopback port: never outside)
    ("checkpoint-url-unreachable", "RAW --checkpoint http://127.0.0.1:9/swin_hostile_row.pth --no-progress",
     ["checkpoint 'http://127.0.0.1:9/swin_hostile_row.pth'", "cannot reach 127.0.0.1:9"]),
    ("checkpoint-unknown-scheme", "RAW --checkpoint ftp://127.0.0.1/swin.pth --no-progress",
     ["ftp://127.0.0.1/swin.pth", "unknown scheme"]),
]


@pytest.mark.parametrize("spec,says", [pytest.param(s, w, id=i) for i, s, w in FAILURE_ROWS])
def test_failure_row(tree, spec, says, capsys):
    assert tool.main(command(tree, spec)) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("swin-extract-features: error:"), err
    for word in says:
        assert word.lower() in err.lower(), (word, err)


# ---------------------------------------------------------------------------------- hostile files
def _png_bytes(array):
    import io

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


GOOD = np.random.RandomState(1).randint(0, 256, (24, 40, 3), dtype=np.uint8)
FILES = {
    # name -> (bytes or None for a folder, expected: "ok" or words of the failure)
    "empty.png": (b"", ["empty file"]),
    "text.jpg": (b"hello, this is text\n" * 20, ["decode"]),
    "random.png": (np.random.RandomState(2).bytes(4096), ["decode"]),
    "truncated.png": (_png_bytes(GOOD)[:400], ["decode"]),
    "html.webp": (b"<html><body>404 Not Found</body></html>", ["decode"]),
    "ok.png": (_png_bytes(GOOD), "ok"),
    "UPPER.PNG": (_png_bytes(GOOD[::-1].copy()), "ok"),
    "with space é.png": (_png_bytes(GOOD[:, ::-1].copy()), "ok"),
    "one-pixel.png": (_png_bytes(GOOD[:1, :1].copy()), "ok"),
    "one-row.png": (_png_bytes(GOOD[:1].copy()), "ok"),
}


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("files")
    src = root / "in"
    src.mkdir()
    for name, (data, _) in FILES.items():
        (src / name).write_bytes(data)
    (src / "folder.jpg").mkdir()  # a folder with an image's name is not an input
    summary = tool.extract([str(src), str(root / "out")] + SMALL)
    return src, root / "out", summary


@pytest.mark.parametrize("name", sorted(FILES))
def test_hostile_file_row(hostile_run, name):
    src, out, summary = hostile_run
    expected = FILES[name][1]
    failed = {os.path.basename(f["image"]): f["error"] for f in summary["failed"]}
    done = {os.path.basename(r["image"]) for r in summary["features"]}
    if expected == "ok":
        assert name in done and name not in failed
        rows = [r for r in summary["features"] if os.path.basename(r["image"]) == name]
        h, w = np.asarray(Image.open(src / name)).shape[:2]
        assert rows[0]["shape"] == [16, -(-h // 4), -(-w // 4)]
    else:
        assert name in failed and name not in done
        assert name in failed[name], failed[name]  # the reason names the file
        for word in expected:
            assert word in failed[name], failed[name]


def test_hostile_files_leave_no_temporary_files_and_no_folder_inputs(hostile_run):
    src, out, summary = hostile_run
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]
    assert not any("folder.jpg" in f["image"] for f in summary["failed"])
    assert summary["images"] == sum(1 for v in FILES.values() if v[1] == "ok")


def test_every_image_unreadable_is_a_failure(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jpg").write_bytes(b"no")
    (tmp_path / "in" / "b.png").write_bytes(b"")
    assert tool.main([str(tmp_path / "in"), str(tmp_path / "out")] + SMALL) == 1
    err = capsys.readouterr().err
    assert "none of the 2 images could be read" in err and "b.png: empty file" in err


# ---------------------------------------------------------------------------------- outputs never lost
def test_same_stem_images_keep_both_outputs(tmp_path):
    rng = np.random.RandomState(3)
    src = tmp_path / "in"
    save(str(src / "x0.jpg"), rng.randint(0, 256, (24, 40, 3), dtype=np.uint8), quality=95)
    save(str(src / "x0.png"), rng.randint(0, 256, (32, 32, 3), dtype=np.uint8))
    save(str(src / "y.png"), rng.randint(0, 256, (32, 32, 3), dtype=np.uint8))
    summary = tool.extract([str(src), str(tmp_path / "out"), "--stages", "0"] + SMALL)
    files = {os.path.basename(r["image"]): r["file"] for r in summary["features"]}
    assert files == {"x0.jpg": "x0.jpg.npz", "x0.png": "x0.png.npz", "y.png": "y.npz"}
    shapes = {n: np.load(tmp_path / "out" / f)["stage0"].shape for n, f in files.items()}
    assert shapes["x0.jpg"] == (16, 6, 10) and shapes["x0.png"] == (16, 8, 8)
    again = tool.extract([str(src), str(tmp_path / "out"), "--stages", "0"] + SMALL)
    assert again["resumed"] == 3 and again["new"] == 0  # the names are stable across runs


def test_names_colliding_even_with_extensions_are_refused_before_any_work(tmp_path, capsys):
    src = tmp_path / "in"
    save(str(src / "a.png"), GOOD)
    save(str(src / "A.PNG"), GOOD)
    assert tool.main([str(src), str(tmp_path / "out")] + SMALL) == 1
    assert "would write the same outputs" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_out_dir_inside_input_is_never_read_as_input(tmp_path):
    src = tmp_path / "in"
    save(str(src / "a.png"), GOOD)
    save(str(src / "sub" / "b.png"), GOOD[:16])
    args = [str(src), str(src / "feats"), "--png"] + SMALL
    first = tool.extract(args)
    assert first["images"] == 2 and list((src / "feats").rglob("*.stage0.png"))
    second = tool.extract(args)  # its own visualisations are not new images
    assert second["images"] == 2 and second["resumed"] == 2 and second["new"] == 0
    assert not second["failed"]
    glob_run = tool.extract([str(src / "**" / "*.png"), str(src / "feats")] + SMALL[:-4] + ["--png", "--workers", "0"])
    assert glob_run["images"] == 2


def test_only_out_dir_in_input_says_so(tmp_path, capsys):
    (tmp_path / "in" / "feats").mkdir(parents=True)
    save(str(tmp_path / "in" / "feats" / "old.stage0.png"), GOOD)
    assert tool.main([str(tmp_path / "in"), str(tmp_path / "in" / "feats")] + SMALL) == 1
    assert "OUT_DIR, not searched" in capsys.readouterr().err


def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "x.npz"

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(str(target), b"data")
    assert list(tmp_path.iterdir()) == []
