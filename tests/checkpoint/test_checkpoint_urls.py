"""Checkpoint references as mmengine accepts them (issue #36): URLs downloaded once into torch's
hub cache (``$TORCH_HOME``), read from there with no network afterwards, shared with mmengine's
own loader; ``open-mmlab://``, ``torchvision://``, ``mmcls://`` names; storage backends through
mmengine's ``CheckpointLoader``; and every bad case as a clear error naming the reference, with
nothing half-written left in the cache. All against a real HTTP server on 127.0.0.1 that counts
requests (tests/checkpoint/loopback.py)."""
import hashlib
import io
import json
import os
import socket

import pytest
import torch

from swin_backbone import CheckpointError, SwinBackbone, load_checkpoint
from swin_backbone.checkpoint import read_checkpoint
from swin_backbone.checkpoint.base import FROM_OURS
from swin_backbone.checkpoint.remote import cache_dir, cached_file, fetch

from ..helpers import TINY
from .loopback import server, torch_home  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


def _model():
    return SwinBackbone(**dict(TINY, out_indices=(3,))).eval()


def _source():
    """A randomised Swin and its weights as the official repository's file: ``{'model': ...}``
    in the official layout, as ``torch.save`` writes it (bytes)."""
    src = _model()
    with torch.no_grad():
        for p in src.parameters():
            p.normal_(std=0.2)
    buf = io.BytesIO()
    torch.save({"model": FROM_OURS["official"](src.state_dict())}, buf)
    return src, buf.getvalue()


def _same_weights(a, b):
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=lambda m: f"{k}: {m}")


def _files(folder):
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def _checkpoints(folder):
    """The cached files, without their source records (``.json``) and locks (``.lock``)."""
    return [f for f in _files(folder) if not f.endswith((".json", ".lock"))]


def _closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ---------------------------------------------------------------- URLs
def test_url_downloads_once_into_torch_home_then_loads_from_the_cache(server, torch_home, monkeypatch):
    src, body = _source()
    url = server.serve("/storage/v1.0.0/swin_tiny_patch4_window7_224.pth", body)
    ours = _model()
    report = load_checkpoint(ours, url, strict=True, logger=None)
    assert report.format == "official" and report.complete and report.source == url
    _same_weights(ours, src)
    assert server.requests["/storage/v1.0.0/swin_tiny_patch4_window7_224.pth"] == 1
    cached = torch_home / "hub" / "checkpoints" / "swin_tiny_patch4_window7_224.pth"
    assert cached.read_bytes() == body and cached_file(url) == str(cached) and cache_dir() == str(cached.parent)
    # nothing else left there but the file's source record and its lock
    assert _files(cached.parent) == [cached.name, cached.name + ".json", cached.name + ".lock"]
    record = json.loads((cached.parent / (cached.name + ".json")).read_text())
    assert record["url"] == url and record["size"] == len(body) and record["etag"]
    assert record["sha256"] == hashlib.sha256(body).hexdigest()

    # init_cfg Pretrained, load_checkpoint and read_checkpoint again: the cache, no request
    via_init = SwinBackbone(**dict(TINY, out_indices=(3,)), init_cfg=dict(type="Pretrained", checkpoint=url))
    via_init.init_weights()
    _same_weights(via_init.eval(), src)
    assert read_checkpoint(url)["model"].keys() == torch.load(io.BytesIO(body), weights_only=True)["model"].keys()
    assert server.total() == 1

    # ... even with the network gone: a cache hit opens no connection
    def refuse(self, *args, **kwargs):
        raise AssertionError(f"a cached checkpoint opened a connection to {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    again = _model()
    load_checkpoint(again, url, logger=None)
    _same_weights(again, src)


def test_the_cache_is_the_one_mmengine_uses_both_ways(server, torch_home):
    from mmengine.runner.checkpoint import CheckpointLoader

    src, body = _source()
    ours_first = server.serve("/a/swin_a.pth", body)
    load_checkpoint(_model(), ours_first, logger=None)
    loaded = CheckpointLoader.load_checkpoint(ours_first, map_location="cpu")  # mmengine: from our download
    assert set(loaded["model"]) == set(torch.load(io.BytesIO(body), weights_only=True)["model"])
    assert server.requests["/a/swin_a.pth"] == 1

    mm_first = server.serve("/b/swin_b.pth", body)
    CheckpointLoader.load_checkpoint(mm_first, map_location="cpu")  # mmengine downloads it
    assert server.requests["/b/swin_b.pth"] == 1
    ours = _model()
    load_checkpoint(ours, mm_first, logger=None)  # ours: from mmengine's download
    _same_weights(ours, src)
    assert server.requests["/b/swin_b.pth"] == 1


def test_a_local_path_never_opens_a_connection(tmp_path, monkeypatch):
    src, body = _source()
    path = tmp_path / "swin.pth"
    path.write_bytes(body)

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"a local checkpoint opened a connection to {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    ours = _model()
    load_checkpoint(ours, str(path), logger=None)
    _same_weights(ours, src)


def test_safetensors_url_and_generic_hub_file_names(server, torch_home):
    save = pytest.importorskip("safetensors.torch").save
    src, _ = _source()
    body = save({k: v.contiguous() for k, v in FROM_OURS["mmdet"](src.state_dict()).items()})
    # Two models' files called model.safetensors (the Hugging Face hub's layout) never meet in the cache.
    a = server.serve("/org/swin-a/resolve/main/model.safetensors", body)
    b = server.serve("/org/swin-b/resolve/main/model.safetensors", b"not the same file")
    ours = _model()
    assert load_checkpoint(ours, a, logger=None).format == "mmdet"
    _same_weights(ours, src)
    assert cached_file(a) != cached_file(b) and cached_file(a).endswith("-model.safetensors")
    with pytest.raises(CheckpointError, match="swin-b/resolve/main/model.safetensors"):
        load_checkpoint(_model(), b, logger=None)
    assert _checkpoints(cache_dir()) == [os.path.basename(cached_file(a))]


# ---------------------------------------------------------------- bad cases
def test_unreachable_host(torch_home):
    url = f"http://127.0.0.1:{_closed_port()}/swin.pth"
    with pytest.raises(CheckpointError, match=rf"checkpoint '{url}': cannot reach 127\.0\.0\.1:\d+ \(.*refused"):
        load_checkpoint(_model(), url, logger=None)
    assert _checkpoints(cache_dir()) == []


def test_http_404(server, torch_home):
    url = server.url("/missing/swin.pth")
    with pytest.raises(CheckpointError, match=rf"checkpoint '{url}': the server answered HTTP 404 Not Found"):
        load_checkpoint(_model(), url, logger=None)
    assert server.requests["/missing/swin.pth"] == 1 and _checkpoints(cache_dir()) == []  # (404: no retry)


def test_cut_off_download_leaves_nothing_in_the_cache_and_a_retry_downloads(server, torch_home, monkeypatch):
    src, body = _source()
    url = server.serve("/cut/swin.pth", body)
    server.cut.add("/cut/swin.pth")
    monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_RETRIES", "1")
    with pytest.raises(CheckpointError, match=rf"checkpoint '{url}': the connection closed after {len(body) // 2} of "
                                              rf"{len(body)} bytes \(cut off\) \(2 tries.*nothing was kept"):
        load_checkpoint(_model(), url, logger=None)
    assert _checkpoints(cache_dir()) == []  # no partial, no staging file, no truncated checkpoint
    assert server.requests["/cut/swin.pth"] == 2  # the first try and one retry
    server.cut.clear()
    ours = _model()
    load_checkpoint(ours, url, logger=None)
    _same_weights(ours, src)
    assert server.requests["/cut/swin.pth"] == 3


def test_a_file_that_is_not_a_checkpoint(server, torch_home):
    url = server.serve("/page/swin.pth", b"<!DOCTYPE html><html><body>Sign in to download</body></html>")
    with pytest.raises(CheckpointError, match=rf"checkpoint '{url}': the downloaded file \(\d+ bytes\) is not a "
                                              r"readable checkpoint: .*found text .*'<!DOCTYPE html>"):
        load_checkpoint(_model(), url, logger=None)
    assert _checkpoints(cache_dir()) == []


def test_a_broken_file_already_in_the_cache_is_named(server, torch_home):
    url = server.serve("/x/swin_broken.pth", b"unused")
    os.makedirs(cache_dir())
    with open(cached_file(url), "wb") as f:
        f.write(b"\x00\x01garbage" * 10)
    with pytest.raises(CheckpointError, match=r"cached at .*swin_broken\.pth.*delete the cached file"):
        load_checkpoint(_model(), url, logger=None)
    assert server.total() == 0


def test_a_url_that_names_no_file_and_an_unknown_scheme(torch_home):
    with pytest.raises(CheckpointError, match="names no file"):
        load_checkpoint(_model(), "http://127.0.0.1:9/models/", logger=None)
    with pytest.raises(CheckpointError, match=r"unknown scheme 'ftp://'.*http://, https://, torchvision://"):
        load_checkpoint(_model(), "ftp://127.0.0.1/swin.pth", logger=None)


# ---------------------------------------------------------------- mmengine's other prefixes
def test_open_mmlab_name_through_mmengine_home_table(server, torch_home, tmp_path):
    # $MMENGINE_HOME/open_mmlab.json extends mmengine's table (mmengine's own mechanism): a name
    # mapped to the loopback server downloads once, like any open-mmlab:// name.
    src, body = _source()
    url = server.serve("/openmmlab/swin_tiny_test.pth", body)
    home = tmp_path / "mmengine_home"
    home.mkdir(exist_ok=True)
    (home / "open_mmlab.json").write_text(json.dumps({"swin_tiny_test": url, "swin_local": "local/swin.pth"}))
    for _ in range(2):
        ours = _model()
        assert load_checkpoint(ours, "open-mmlab://swin_tiny_test", logger=None).format == "official"
        _same_weights(ours, src)
    assert server.requests["/openmmlab/swin_tiny_test.pth"] == 1
    # a name mapped to a file under $MMENGINE_HOME: read from there
    (home / "local").mkdir()
    (home / "local" / "swin.pth").write_bytes(body)
    ours = _model()
    load_checkpoint(ours, "openmmlab://swin_local", logger=None)
    _same_weights(ours, src)
    with pytest.raises(CheckpointError, match=r"'swin_nope' is not in mmengine's open-mmlab:// table"):
        load_checkpoint(_model(), "open-mmlab://swin_nope", logger=None)


def test_torchvision_and_mmcls_names_resolve_to_their_cached_files(torch_home, monkeypatch):
    # The names resolve through mmengine's tables to the libraries' real URLs; with the file in
    # the cache (where torch / mmengine would have put it) nothing is downloaded.
    from mmengine.runner.checkpoint import get_mmcls_models

    src, body = _source()
    os.makedirs(cache_dir())
    url = get_mmcls_models()["swin_tiny"]
    with open(cached_file(url), "wb") as f:
        f.write(body)

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"a cached checkpoint opened a connection to {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    ours = _model()
    load_checkpoint(ours, "mmcls://swin_tiny", logger=None)
    _same_weights(ours, src)
    assert fetch("mmcls://swin_tiny")[0] == cached_file(url)
    pytest.importorskip("torchvision")
    from mmengine.runner.checkpoint import get_torchvision_models

    tv_url = get_torchvision_models()["swin_t.imagenet1k_v1"]
    assert os.path.basename(cached_file(tv_url)).startswith("swin_t-")
    with open(cached_file(tv_url), "wb") as f:
        f.write(body)
    ours = _model()
    load_checkpoint(ours, "torchvision://swin_t.imagenet1k_v1", logger=None)
    _same_weights(ours, src)
    with pytest.raises(CheckpointError, match=r"'swin_q' is not in mmengine's torchvision:// table"):
        load_checkpoint(_model(), "torchvision://swin_q", logger=None)


@pytest.fixture
def loopback_scheme():
    """A storage backend registered with mmengine's CheckpointLoader (as s3:// / petrel:// are)."""
    from mmengine.runner.checkpoint import CheckpointLoader

    store = {}

    def load_from_store(filename, map_location=None):
        return torch.load(io.BytesIO(store[filename[len("swintest://"):]]), map_location=map_location,
                          weights_only=True)

    CheckpointLoader.register_scheme(prefixes="swintest://", loader=load_from_store)
    yield store
    CheckpointLoader._schemes.pop("swintest://", None)


def test_storage_backend_prefix_is_read_by_mmengines_loader(loopback_scheme):
    src, body = _source()
    loopback_scheme["bucket/swin.pth"] = body
    ours = _model()
    report = load_checkpoint(ours, "swintest://bucket/swin.pth", strict=True, logger=None)
    assert report.format == "official" and report.source == "swintest://bucket/swin.pth"
    _same_weights(ours, src)
    with pytest.raises(CheckpointError, match=r"checkpoint 'swintest://bucket/none.pth': mmengine's "
                                              r"CheckpointLoader cannot read it \(KeyError"):
        load_checkpoint(_model(), "swintest://bucket/none.pth", logger=None)
    with pytest.raises(CheckpointError, match=r"'swintest://bucket/swin.pth': read by mmengine's CheckpointLoader, "
                                              r"not a file to fetch"):
        fetch("swintest://bucket/swin.pth")


# ---------------------------------------------------------------- torch.distributed
def _rank_loads(rank, world, store, url, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ours = _model()
        load_checkpoint(ours, url, logger=None)
        torch.save(ours.state_dict(), os.path.join(out, f"rank{rank}.pth"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 2 processes (gloo ranks)
def test_distributed_ranks_download_once(server, torch_home, tmp_path):
    # One rank downloads under the cache file's lock, the other reads its file (no collective).
    src, body = _source()
    url = server.serve("/dist/swin_dist.pth", body)
    # (fork: the children need no fresh imports; the server thread stays in the parent)
    torch.multiprocessing.start_processes(_rank_loads, args=(2, str(tmp_path / "store"), url, str(tmp_path)),
                                          nprocs=2, start_method="fork")
    for rank in range(2):
        state = torch.load(tmp_path / f"rank{rank}.pth", weights_only=True)
        for key, value in src.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    assert server.requests["/dist/swin_dist.pth"] == 1
