"""The download cache cannot confuse two sources (issue #42): every cached file records the URL
it came from and URLs whose names collide get their own files; one download per file across
processes with or without a process group (a file lock, no collective); a stalled server ends in
an error naming the URL, a 503 is retried; torchvision-style hash prefixes are checked; mmengine's
``prefix=`` of ``init_cfg`` is honoured. All against a real HTTP server on 127.0.0.1
(tests/checkpoint/loopback.py) and real processes."""
import ast
import datetime
import hashlib
import io
import json
import os
import time

import pytest
import torch

from swin_backbone import CheckpointError, SwinBackbone, load_checkpoint
from swin_backbone.checkpoint import read_checkpoint
from swin_backbone.checkpoint.base import FROM_OURS
from swin_backbone.checkpoint.remote import cache_dir, cached_file, expected_hash, fetch, is_ambiguous

from ..helpers import TINY
from .loopback import server, torch_home  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")
CHECKPOINT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "swin_backbone", "checkpoint")


def _model():
    return SwinBackbone(**dict(TINY, out_indices=(3,))).eval()


def _random_model(seed):
    torch.manual_seed(seed)
    src = _model()
    with torch.no_grad():
        for p in src.parameters():
            p.normal_(std=0.2)
    return src


def _bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _official(src):
    return _bytes({"model": FROM_OURS["official"](src.state_dict())})


def _same_weights(a, b):
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=lambda m: f"{k}: {m}")


def _loaded(url):
    ours = _model()
    load_checkpoint(ours, url, logger=None)
    return ours


def _checkpoints():
    folder = cache_dir()
    return sorted(f for f in os.listdir(folder) if not f.endswith((".json", ".lock"))) if os.path.isdir(folder) else []


# ---------------------------------------------------------------- two sources, one name
@pytest.mark.parametrize("a, b", [
    ("/dino_swinl/epoch_12.pth", "/codetr_swinl/epoch_12.pth"),  # mmengine run names
    ("/uc?id=AAAA&export=download", "/uc?id=BBBB&export=download"),  # a query string (Google Drive)
    ("/api/files/123/content", "/api/files/456/content"),  # no extension (REST downloads)
    ("/v1/swin_tiny_test.pth", "/v2/swin_tiny_test.pth"),  # an official-looking name: its record tells them apart
], ids=["run-name", "query", "no-extension", "recorded"])
def test_two_urls_with_one_file_name_give_each_its_own_weights(server, torch_home, a, b):
    src_a, src_b = _random_model(1), _random_model(2)
    url_a, url_b = server.serve(a, _official(src_a)), server.serve(b, _official(src_b))
    _same_weights(_loaded(url_a), src_a)
    _same_weights(_loaded(url_b), src_b)  # before: the first URL's weights, silently
    _same_weights(_loaded(url_a), src_a)
    _same_weights(_loaded(url_b), src_b)
    assert server.requests[a] == server.requests[b] == 1  # each downloaded once, then the cache
    assert cached_file(url_a) != cached_file(url_b) and len(_checkpoints()) == 2
    for url in (url_a, url_b):
        with open(cached_file(url) + ".json") as f:
            assert json.load(f)["url"] == url
    if a.startswith("/v1/"):  # the first keeps torch's / mmengine's name; the second gets the URL's hash
        assert os.path.basename(cached_file(url_a)) == "swin_tiny_test.pth" and not is_ambiguous(url_a)
        assert os.path.basename(cached_file(url_b)) == hashlib.sha256(url_b.encode()).hexdigest()[:12] + \
            "-swin_tiny_test.pth"
    else:
        assert is_ambiguous(url_a) and is_ambiguous(url_b)


def test_a_file_mmengine_downloaded_is_used_for_official_names_only(server, torch_home):
    # mmengine's own http loader, as a process without swin_backbone runs it (once swin_backbone
    # is imported, CheckpointLoader sends URLs to this package's reader: mmengine_schemes.py)
    from mmengine.runner.checkpoint import load_from_http

    src_a, src_b = _random_model(1), _random_model(2)
    # mmengine downloads expA's epoch_12.pth under the bare name, with no record of where from
    url_a = server.serve("/expA/epoch_12.pth", _official(src_a))
    load_from_http(url_a, map_location="cpu")
    assert os.path.isfile(os.path.join(cache_dir(), "epoch_12.pth"))
    # expB's epoch_12.pth is never served from it
    url_b = server.serve("/expB/epoch_12.pth", _official(src_b))
    _same_weights(_loaded(url_b), src_b)
    assert server.requests["/expB/epoch_12.pth"] == 1
    # an official, unambiguous name mmengine downloaded is used as it is (the shared cache)
    url_c = server.serve("/releases/swin_tiny_official.pth", _official(src_a))
    load_from_http(url_c, map_location="cpu")
    _same_weights(_loaded(url_c), src_a)
    assert server.requests["/releases/swin_tiny_official.pth"] == 1
    assert not os.path.exists(os.path.join(cache_dir(), "swin_tiny_official.pth.json"))  # no record is made up


# ---------------------------------------------------------------- one download across processes
def _load_at_once(rank, barrier, url, out):
    torch.set_num_threads(1)
    barrier.wait()  # both ask at the same moment: without the lock both would download
    torch.save(_loaded(url).state_dict(), os.path.join(out, f"p{rank}.pth"))


@pytest.mark.slow  # 2 processes
def test_two_processes_without_a_process_group_make_one_request(server, torch_home, tmp_path):
    import multiprocessing

    src = _random_model(3)
    url = server.serve("/shared/swin_shared.pth", _official(src))
    server.delay["/shared/swin_shared.pth"] = 0.5  # the second process asks while the first downloads
    ctx = multiprocessing.get_context("fork")  # (the children need no fresh imports; the server stays here)
    torch.multiprocessing.start_processes(_load_at_once, args=(ctx.Barrier(2), url, str(tmp_path)), nprocs=2,
                                          start_method="fork")
    for rank in range(2):
        state = torch.load(tmp_path / f"p{rank}.pth", weights_only=True)
        for key, value in src.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    assert server.requests["/shared/swin_shared.pth"] == 1
    assert _checkpoints() == ["swin_shared.pth"]


def _rank0_reads(rank, world, store, url, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    try:
        if rank == 0:  # e.g. a rank-0-only hook: the other rank never reads
            state = read_checkpoint(url)
            torch.save(state, os.path.join(out, "rank0.pth"))
        total = torch.ones(1)
        dist.all_reduce(total)  # the first collective both ranks enter
        assert total.item() == world
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 2 processes (gloo ranks)
def test_a_rank_0_only_read_does_not_hang(server, torch_home, tmp_path):
    # Before: the read entered a barrier that the other rank never did (or matched the wrong collective).
    src = _random_model(4)
    body = _official(src)
    url = server.serve("/rank0/swin_rank0.pth", body)
    start = time.monotonic()
    ctx = torch.multiprocessing.start_processes(_rank0_reads, args=(2, str(tmp_path / "store"), url, str(tmp_path)),
                                                nprocs=2, start_method="fork", join=False)
    while not ctx.join(timeout=60):
        assert time.monotonic() - start < 60, "a rank-0-only read hung"
    got = torch.load(tmp_path / "rank0.pth", weights_only=True)["model"]
    assert set(got) == set(torch.load(io.BytesIO(body), weights_only=True)["model"])
    assert server.requests["/rank0/swin_rank0.pth"] == 1


# ---------------------------------------------------------------- timeout and retries
@pytest.mark.parametrize("where", ["mid-body", "before-the-answer"])
def test_a_stalled_server_ends_in_an_error_naming_the_url(server, torch_home, monkeypatch, where):
    body = _official(_random_model(5))
    url = server.serve("/stall/swin_stall.pth", body)
    if where == "mid-body":
        server.stall.add("/stall/swin_stall.pth")
    else:
        server.delay["/stall/swin_stall.pth"] = 3.0
    monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_TIMEOUT", "0.3")
    monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_RETRIES", "1")
    after = rf" after {len(body) // 2} bytes" if where == "mid-body" else ""
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"checkpoint '{url}': no data from 127\.0\.0\.1:\d+ for 0\.3 s "
                                              rf"\(\$SWIN_BACKBONE_DOWNLOAD_TIMEOUT\).*stalled{after} \(2 tries, "
                                              r"\$SWIN_BACKBONE_DOWNLOAD_RETRIES=1\); nothing was kept"):
        load_checkpoint(_model(), url, logger=None)
    assert time.monotonic() - start < 2.5  # two tries of 0.3 s, not the server's stall
    assert server.requests["/stall/swin_stall.pth"] == 2 and _checkpoints() == []
    assert not [f for f in os.listdir(cache_dir()) if f.endswith((".tmp", ".partial"))]


def test_a_503_is_retried_and_a_lasting_one_names_the_url(server, torch_home, monkeypatch):
    src = _random_model(6)
    url = server.serve("/busy/swin_busy.pth", _official(src))
    server.fail["/busy/swin_busy.pth"] = [503, 429]
    _same_weights(_loaded(url), src)  # the third try (default: 3 retries) gets the file
    assert server.requests["/busy/swin_busy.pth"] == 3
    url = server.serve("/down/swin_down.pth", _official(src))
    server.fail["/down/swin_down.pth"] = [503] * 5
    monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_RETRIES", "2")
    with pytest.raises(CheckpointError, match=rf"checkpoint '{url}': the server answered HTTP 503 Service "
                                              r"Unavailable \(3 tries, \$SWIN_BACKBONE_DOWNLOAD_RETRIES=2\)"):
        load_checkpoint(_model(), url, logger=None)
    assert server.requests["/down/swin_down.pth"] == 3 and _checkpoints() == ["swin_busy.pth"]


def test_bad_download_settings_name_the_variable(server, torch_home, monkeypatch):
    url = server.serve("/s/swin_settings.pth", _official(_random_model(7)))
    monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_TIMEOUT", "soon")
    with pytest.raises(CheckpointError, match=r"\$SWIN_BACKBONE_DOWNLOAD_TIMEOUT: expected a number > 0 .*got 'soon'"):
        load_checkpoint(_model(), url, logger=None)
    monkeypatch.delenv("SWIN_BACKBONE_DOWNLOAD_TIMEOUT")
    monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_RETRIES", "-1")
    with pytest.raises(CheckpointError, match=r"\$SWIN_BACKBONE_DOWNLOAD_RETRIES: expected an integer >= 0"):
        load_checkpoint(_model(), url, logger=None)
    assert server.total() == 0


# ---------------------------------------------------------------- hashes, the cache folder
def test_hash_prefix_in_the_name(server, torch_home):
    body = _official(_random_model(8))
    digest = hashlib.sha256(body).hexdigest()
    good = server.serve(f"/tv/swin_t-{digest[:8]}.pth", body)
    bad = server.serve("/tv/swin_t-0badc0de.pth", body)
    assert fetch(good, check_hash=True)[1] is not None  # downloaded and checked
    with pytest.raises(CheckpointError, match=rf"checkpoint '{bad}': the downloaded file's sha256 is {digest}, but "
                                              r"its name says it starts with 0badc0de.*nothing was kept"):
        fetch(bad, check_hash=True)
    assert _checkpoints() == [f"swin_t-{digest[:8]}.pth"]
    # Checked by default where the publisher guarantees the name's hash (torchvision: check_hash=True), not
    # for OpenMMLab's names (open-mmlab/mim#11 dropped that check) nor a loopback URL.
    assert expected_hash("https://download.pytorch.org/models/swin_t-704ceda3.pth") == "704ceda3"
    assert expected_hash("https://download.openmmlab.com/x/swin_20220317-1cdeb081.pth") == ""
    assert expected_hash("https://download.pytorch.org/models/swin_t-704ceda3.pth", check_hash=False) == ""
    fetch(bad)  # (no check asked: loads)
    pytest.importorskip("torchvision")
    from mmengine.runner.checkpoint import get_torchvision_models

    assert expected_hash(get_torchvision_models()["swin_t.imagenet1k_v1"])  # torchvision:// names are checked


def test_an_unwritable_cache_is_a_clear_error_and_a_hit_writes_nothing(server, torch_home, tmp_path, monkeypatch):
    url = server.serve("/ro/swin_ro.pth", _official(_random_model(9)))
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("TORCH_HOME", str(not_a_folder / "torch_home"))
    with pytest.raises(CheckpointError, match=rf"checkpoint '{url}': cannot write to the download cache .*"
                                              r"NotADirectoryError.*point \$TORCH_HOME at a writable folder"):
        load_checkpoint(_model(), url, logger=None)
    assert server.total() == 0
    monkeypatch.setenv("TORCH_HOME", str(torch_home))
    _loaded(url)
    os.remove(cached_file(url) + ".lock")
    _loaded(url)  # a hit takes no lock (a read-only cache serves hits) and opens no connection
    assert not os.path.exists(cached_file(url) + ".lock") and server.total() == 1


def test_stale_staging_files_are_removed_and_only_this_files(server, torch_home):
    url = server.serve("/st/swin_stale.pth", _official(_random_model(10)))
    os.makedirs(cache_dir())
    path = cached_file(url)
    folder, name = os.path.split(path)
    ours_dead = os.path.join(folder, f".{name}.{'0' * 32}.tmp")  # a killed download of ours (the lock's holder's)
    torch_dead, torch_live = path + "." + "a" * 32 + ".partial", path + "." + "b" * 32 + ".partial"  # torch's
    # swin_stale.pth.tar downloads under its own lock: its staging files are not this download's
    other_ours, other_torch = os.path.join(folder, f".{name}.tar.{'1' * 32}.tmp"), path + ".tar." + "c" * 32 + ".partial"
    for f in (ours_dead, torch_dead, torch_live, other_ours, other_torch):
        open(f, "wb").close()
    for f in (torch_dead, other_torch):
        os.utime(f, (time.time() - 7200, time.time() - 7200))
    _loaded(url)
    assert not os.path.exists(ours_dead) and not os.path.exists(torch_dead) and os.path.exists(torch_live)
    assert os.path.exists(other_ours) and os.path.exists(other_torch)


# ---------------------------------------------------------------- init_cfg prefix=
def test_init_cfg_prefix_takes_that_submodule(server, torch_home):
    teacher, student = _random_model(11), _random_model(12)
    state = {f"teacher.backbone.{k}": v for k, v in FROM_OURS["mmdet"](teacher.state_dict()).items()}
    state.update({f"student.backbone.{k}": v for k, v in student.state_dict().items()})
    state["teacher.neck.conv.weight"] = torch.zeros(2, 2)
    url = server.serve("/distill/swin_distill.pth", _bytes({"state_dict": state, "meta": {}}))
    for prefix, src in (("teacher.backbone.", teacher), ("student.backbone", student)):  # (no dot: as mmengine)
        ours = SwinBackbone(**dict(TINY, out_indices=(3,)), init_cfg=dict(type="Pretrained", checkpoint=url,
                                                                          prefix=prefix))
        ours.init_weights()
        _same_weights(ours.eval(), src)
    report = load_checkpoint(_model(), url, prefix="teacher.backbone", logger=None)
    assert report.format == "mmdet" and report.complete
    assert report.unwrapped == ["took 'state_dict'", "kept 'teacher.backbone.*' (prefix='teacher.backbone.': "
                                f"{len(teacher.state_dict())} keys, {len(state) - len(teacher.state_dict())} "
                                "others dropped)"]
    # mmdet's prefix='backbone.' names no key here: an error saying which keys there are
    ours = SwinBackbone(**dict(TINY, out_indices=(3,)), init_cfg=dict(type="Pretrained", checkpoint=url,
                                                                      prefix="backbone."))
    with pytest.raises(CheckpointError, match=r"prefix='backbone\.': no key starts with it; the keys start with "
                                              r"teacher\. \(\d+\), student\. \(\d+\)"):
        ours.init_weights()
    with pytest.raises(CheckpointError, match=r"prefix: expected the non-empty prefix"):
        load_checkpoint(_model(), url, prefix=".", logger=None)
    assert server.total() == 1


def test_prefix_of_a_ddp_wrapped_whole_model():
    src = _random_model(13)
    state = {f"module.backbone.{k}": v for k, v in src.state_dict().items()}
    state["module.head.fc.weight"] = torch.zeros(3, 3)
    ours = _model()
    report = load_checkpoint(ours, state, prefix="backbone.", strict=True, logger=None)
    assert "kept 'module.backbone.*'" in report.unwrapped[-1]
    _same_weights(ours, src)


# ---------------------------------------------------------------- structure
def test_imports_inside_checkpoint_go_one_way():
    # Module-level and function-level relative imports alike: no circle (base.py's docstring).
    graph = {}
    for name in sorted(os.listdir(CHECKPOINT_DIR)):
        if name.endswith(".py") and name != "__init__.py":
            with open(os.path.join(CHECKPOINT_DIR, name)) as f:
                tree = ast.parse(f.read())
            deps = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 1:
                    deps.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
            graph[name[:-3]] = deps & {n[:-3] for n in os.listdir(CHECKPOINT_DIR) if n.endswith(".py")}
    assert graph["files"] == {"base", "records", "unpickler"} and graph["remote"] == {"base", "files"}
    assert graph["records"] == {"base"} and graph["unpickler"] == {"records"}
    done, circles = set(), []

    def visit(node, path):
        if node in path:
            circles.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        for dep in sorted(graph.get(node, ())):
            visit(dep, path + [node])
        done.add(node)

    for node in graph:
        visit(node, [])
    assert circles == []
