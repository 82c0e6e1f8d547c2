"""swin-extract-features over "datasets": resume after a crash, --pool avg shards, the
random-weights guard, and 2-process torchrun (gloo) sharding, incl. a failing rank and the
rerun that finishes its work. Real SwinBackbone (a small one), real PNG/JPEG files written with
PIL, real torchrun processes."""
import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from swin_backbone.features import mean_pool
from swin_backbone.tools import extract_features as tool
from swin_backbone.tools.extraction import default_workers, find_images

from ..helpers import EXTRACT_ARGS as SMALL
from ..helpers import ROOT, assert_same_features, features, pooled, write_images


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    write_images(root)
    return root


@pytest.fixture(scope="module")
def reference(images, tmp_path_factory):
    """One uninterrupted 1-process run, decoding in the main process (--workers 0)."""
    out = tmp_path_factory.mktemp("reference")
    summary = tool.extract([str(images), str(out), "--pool", "avg", "--workers", "0"] + SMALL)
    return out, summary


def test_reference_run(reference):
    out, summary = reference
    assert summary["images"] == summary["new"] == 8 and summary["world_size"] == 1
    assert sorted(os.path.basename(f["image"]) for f in summary["failed"]) == ["broken.jpg", "truncated.png"]
    assert len(features(out)) == 8 and len(pooled(out)) == 8


def test_pooled_vectors_are_the_means_of_the_full_maps(reference, images):
    out, _ = reference
    maps, vectors = features(out), pooled(out)
    assert {os.path.relpath(p, images).replace(os.sep, "/") for p in maps} == set(vectors)
    for path, stages in maps.items():
        vec = vectors[os.path.relpath(path, images).replace(os.sep, "/")]
        assert sorted(vec) == sorted(stages) == [0, 1, 2, 3]
        for s, arr in stages.items():
            assert vec[s].shape == (arr.shape[0],) and vec[s].dtype == np.float32
            np.testing.assert_allclose(vec[s], arr.mean(axis=(1, 2)), rtol=1e-6, atol=1e-6)


def test_workers_and_same_size_batches_equal_single_image_api(reference, images):
    """The tool's output (workers, same-size batches of 2) equals the API run image by image."""
    from swin_backbone.features import FeatureExtractor

    out, _ = reference
    fx = FeatureExtractor.from_arch(None, embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8), seed=0,
                                    batch_size=1)
    for path, stages in features(out).items():
        (alone,) = fx([np.array(Image.open(path).convert("RGB"))])
        for s, arr in stages.items():
            np.testing.assert_allclose(arr, alone[s].numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["npz", "npy", "pt"])
def test_resume_after_a_crash_redoes_cut_off_files_only(tmp_path, images, reference, fmt):
    out = tmp_path / "out"
    first = tool.extract([str(images), str(out), "--pool", "avg", "--format", fmt, "--workers", "1"] + SMALL)
    assert first["new"] == 8
    # The crash: one image's output cut off mid-file, one image never written, a partial
    # pooled file cut off, and leftovers of the shard written by the crashed run gone.
    files = sorted(p for p in out.rglob(f"*.{fmt}") if "pooled" not in p.parts)
    cut, lost = files[0], files[-1]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    lost.unlink()
    shard = out / "pooled" / "shard-00000-of-00001.npz"
    (out / "pooled" / "partial-00000-of-00001-x.1.npz").write_bytes(shard.read_bytes()[:100])
    untouched = {p: p.stat().st_mtime_ns for p in files if p not in (cut, lost)}
    again = tool.extract([str(images), str(out), "--pool", "avg", "--format", fmt, "--workers", "1"] + SMALL)
    # stage files of one image share a base name: --format npy / pt cut or lost one stage of one image each
    redone = {os.path.basename(str(p)).split(".")[0] for p in (cut, lost)}
    assert again["new"] == len(redone) and again["resumed"] == 8 - len(redone) and again["images"] == 8
    assert {p: p.stat().st_mtime_ns for p in untouched if p.name.split(".")[0] not in redone} == \
        {p: t for p, t in untouched.items() if p.name.split(".")[0] not in redone}
    assert not (out / "pooled" / "partial-00000-of-00001-x.1.npz").exists()
    assert not list(out.rglob("*.tmp*"))
    # final outputs equal the uninterrupted run
    ref_out, _ = reference
    if fmt == "npz":
        assert_same_features(features(out), features(ref_out))
    else:
        index = json.load(open(out / "index.json"))
        ref = features(ref_out)
        assert len(index["features"]) == 32
        for row in index["features"]:
            path = out / row["file"]
            arr = np.load(path) if fmt == "npy" else torch.load(path).numpy()
            np.testing.assert_allclose(arr, ref[row["image"]][row["stage"]], rtol=1e-4, atol=1e-5)
    assert_same_features(pooled(out), pooled(ref_out))


def test_pooled_only_run_resumes_from_its_shard(tmp_path, images, reference):
    out = tmp_path / "out"
    args = [str(images), str(out), "--pool", "avg", "--no-maps"] + SMALL
    first = tool.extract(args)
    assert first["new"] == 8 and first["features"] == [] and not list(out.rglob("img*"))
    again = tool.extract(args)
    assert again["new"] == 0 and again["resumed"] == 8
    assert_same_features(pooled(out), pooled(reference[0]))


def test_a_pooled_run_that_stops_keeps_its_vectors_for_the_rerun(tmp_path, images, reference, monkeypatch):
    """Vectors go to partial files every FLUSH images and when the rank stops on an error; the
    rerun takes them from there, redoes the rest, and leaves only its shard."""
    out = tmp_path / "out"
    args = [str(images), str(out), "--pool", "avg", "--no-maps", "--workers", "0"] + SMALL
    monkeypatch.setattr(tool.PooledStore, "FLUSH", 2)
    done = []

    def stop_at_the_sixth(feat):
        if len(done) == 5:
            raise RuntimeError("stopped")
        done.append(1)
        return mean_pool(feat)

    monkeypatch.setattr(tool, "mean_pool", stop_at_the_sixth)
    with pytest.raises(tool.RankFailed, match="rank 0 of 1 failed on .*RuntimeError: stopped"):
        tool.extract(args)
    assert len(list((out / "pooled").glob("partial-*.npz"))) == 3  # 2 + 2 at FLUSH, 1 at the error
    assert json.load(open(out / "ranks" / "rank-00000-of-00001.json"))["status"] == "failed"
    monkeypatch.setattr(tool, "mean_pool", mean_pool)
    again = tool.extract(args)
    assert again["resumed"] == 5 and again["new"] == 3
    assert not list((out / "pooled").glob("partial-*"))
    assert_same_features(pooled(out), pooled(reference[0]))


def test_random_weights_need_saying_so_and_are_flagged(tmp_path, images, capsys):
    with pytest.raises(SystemExit) as err:
        tool.extract([str(images), str(tmp_path / "x"), "--arch", "tiny", "--png"])
    assert err.value.code == 2
    message = capsys.readouterr().err
    assert "--checkpoint" in message and "--random-weights" in message
    assert not (tmp_path / "x").exists()
    out = tmp_path / "y"
    summary = tool.extract([str(images / "nested"), str(out)] + SMALL)
    index = json.load(open(out / "index.json"))
    assert index["weights"]["random"] is True and "RANDOM WEIGHTS" in index["warnings"][0]
    assert summary["warnings"] == index["warnings"]
    assert "WARNING: RANDOM WEIGHTS" in capsys.readouterr().err
    # a rerun with other weights into the same folder is refused, --overwrite redoes it
    with pytest.raises(SystemExit, match="out_dir .*other settings.*random_weights_seed"):
        tool.extract([str(images / "nested"), str(out), "--seed", "1"] + SMALL)
    assert tool.extract([str(images / "nested"), str(out), "--seed", "1", "--overwrite"] + SMALL)["new"] == 3


def test_argument_errors_name_the_argument(tmp_path, images, capsys):
    for extra, name in [(["--workers", "-1"], "--workers"), (["--batch-size", "0"], "--batch-size"),
                        (["--no-maps"], "--no-maps"),
                        (["--checkpoint", str(tmp_path / "none.pth")], "--random-weights")]:
        with pytest.raises(SystemExit):
            tool.extract([str(images), str(tmp_path / "o")] + SMALL + extra)
        assert name in capsys.readouterr().err
    assert 1 <= default_workers() <= 8 and default_workers(4096) == 1
    assert default_workers(4096, "cpu") == 0 and default_workers(1, "cpu") in (0, 1)


# ---------------------------------------------------------------------------------- torchrun
def torchrun(args, nproc=2):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(port), "-m", "swin_backbone.tools.extract_features"] + args
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_torchrun_two_ranks_share_the_images_and_report_broken_ones_once(tmp_path, images, reference):
    out = tmp_path / "out"
    proc = torchrun([str(images), str(out), "--pool", "avg"] + SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    index = json.load(open(out / "index.json"))
    ref_out, ref = reference
    assert index["world_size"] == 2 and [r["rank"] for r in index["ranks"]] == [0, 1]
    # each rank a disjoint, deterministic share: sorted paths, rank::2
    assert [r["assigned"] for r in index["ranks"]] == [5, 5]
    shards = [np.load(out / p["file"])["images"].tolist() for p in index["pooled"]]
    assert not set(shards[0]) & set(shards[1]) and len(shards[0]) + len(shards[1]) == 8
    # exactly the images of the 1-process run, each once, same features and pooled vectors
    assert_same_features(features(out), features(ref_out))
    assert_same_features(pooled(out), pooled(ref_out))
    assert sorted(f["image"] for f in index["failed"]) == sorted(f["image"] for f in ref["failed"])
    for f in ref["failed"]:
        assert len(re.findall(re.escape(f"skipped {f['image']}:"), log)) == 1, log
    assert log.count("WARNING: RANDOM WEIGHTS") == 2  # rank 0 only: at the start and in the summary
    assert not list((out / "pooled").glob("partial-*"))


def test_torchrun_failing_rank_is_reported_with_its_images_and_a_rerun_finishes(tmp_path, images, reference):
    out = tmp_path / "out"
    paths, _ = find_images(str(images))
    victim = paths[1]  # rank 1's first image; its output path is blocked by a folder
    blocker = out / (os.path.splitext(os.path.relpath(victim, images))[0] + ".npz")
    blocker.mkdir(parents=True)
    proc = torchrun([str(images), str(out)] + SMALL)
    assert proc.returncode != 0
    assert f"rank 1 of 2 failed on {victim}" in proc.stderr
    root_cause = proc.stderr[proc.stderr.index("Root Cause"):]
    assert re.search(r"rank\s*: 1 ", root_cause), root_cause[:800]
    state = json.load(open(out / "ranks" / "rank-00001-of-00002.json"))
    assert state["status"] == "failed" and victim in state["pending"] and victim in state["in_flight"]
    assert "IsADirectoryError" in state["error"] and not (out / "index.json").exists()
    blocker.rmdir()
    proc = torchrun([str(images), str(out)] + SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = json.load(open(out / "index.json"))
    assert index["images"] == 8 and index["resumed"] >= 4 and index["new"] == 8 - index["resumed"]
    assert json.load(open(out / "ranks" / "rank-00001-of-00002.json"))["status"] == "complete"
    assert_same_features(features(out), features(reference[0]))
