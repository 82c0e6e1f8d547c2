"""The downloader finishes or fails (issue #45): one deadline from a minimum throughput, shared
by the processes waiting on the lock; the cache checked against its records; each row of the
issue's error table a CheckpointError naming the URL or path and the remedy, with no retry
where a retry cannot help. Against the real HTTP server on 127.0.0.1 (loopback.py)."""
import fcntl
import io
import json
import os
import time

import pytest
import torch

from swin_backbone import CheckpointError
from swin_backbone.checkpoint import read_checkpoint
from swin_backbone.checkpoint.remote import cache_dir, cached_file, fetch

from .loopback import server, torch_home  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


def _body(seed=0, n=4):
    torch.manual_seed(seed)
    buf = io.BytesIO()
    torch.save({"state_dict": {"w": torch.randn(n)}}, buf)
    return buf.getvalue()


def _w(obj):
    return obj["state_dict"]["w"]


def _cached():
    folder = cache_dir()
    return sorted(f for f in os.listdir(folder) if not f.endswith(".lock")) if os.path.isdir(folder) else []


# ---------------------------------------------------------------- the deadline
def test_a_trickling_server_ends_at_the_deadline(server, torch_home, monkeypatch):
    body = _body()
    url = server.serve("/slow/swin_trickle.pth", body)
    server.trickle["/slow/swin_trickle.pth"] = 0.05  # a byte every 0.05 s: never a read timeout
    monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_TIMEOUT", "0.5")
    monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_RETRIES", "0")
    monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_MIN_SPEED", str(len(body)))  # deadline: 0.5 + 1 s
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"checkpoint '{url}': 127\.0\.0\.1:\d+ sent \d+ of {len(body)} bytes, "
                                              r"and it did not finish within its deadline of 1\.5 s .*"
                                              r"\$SWIN_BACKBONE_DOWNLOAD_MIN_SPEED.*nothing was kept"):
        read_checkpoint(url)
    assert time.monotonic() - start < 3.0
    assert server.requests["/slow/swin_trickle.pth"] == 1 and not [f for f in _cached() if not f.endswith(".json")]


def test_waiting_on_another_download_shares_its_deadline(server, torch_home, monkeypatch):
    url = server.serve("/held/swin_held.pth", _body())
    monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_TIMEOUT", "0.5")
    monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_RETRIES", "0")
    monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_MIN_SPEED", "1000")
    os.makedirs(cache_dir())
    lock = cached_file(url) + ".lock"
    holder = os.open(lock, os.O_RDWR | os.O_CREAT)  # a stuck downloader: holds the lock, says 1000 bytes, has 10
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        os.write(holder, json.dumps(dict(pid=4242, size=1000, received=10)).encode())
        start = time.monotonic()
        with pytest.raises(CheckpointError, match=rf"checkpoint '{url}': another process \(pid 4242\) is downloading "
                                                  r"it \(10 bytes so far\), and it did not finish within its "
                                                  r"deadline of 1\.5 s"):
            read_checkpoint(url)
        assert 1.4 < time.monotonic() - start < 3.5 and server.total() == 0
    finally:
        os.close(holder)
    torch.testing.assert_close(_w(read_checkpoint(url)), _w(torch.load(io.BytesIO(_body()), weights_only=True)))


def test_bad_min_speed_names_the_variable(server, torch_home, monkeypatch):
    url = server.serve("/s/swin_speed.pth", _body())
    for bad in ("0", "fast", "-3", "inf"):
        monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_MIN_SPEED", bad)
        with pytest.raises(CheckpointError, match=rf"\$SWIN_BACKBONE_DOWNLOAD_MIN_SPEED: expected a number > 0 .*"
                                                  rf"got '{bad}'"):
            read_checkpoint(url)
    assert server.total() == 0


# ---------------------------------------------------------------- the cache against its records
@pytest.mark.parametrize("change", ["other-size", "same-size"])
def test_a_replaced_cached_file_is_downloaded_again(server, torch_home, change):
    body = _body(1)
    url = server.serve("/r/swin_replaced.pth", body)
    first = read_checkpoint(url)
    path = cached_file(url)
    other = _body(2, n=4 if change == "same-size" else 100)
    assert (len(other) == len(body)) == (change == "same-size") and other != body
    with open(path, "wb") as f:
        f.write(other)
    with pytest.warns(RuntimeWarning, match=rf"the cached file {path} is not the one downloaded from {url} "
                                            r"\((it has|its sha256) .*downloading it again"):
        again = read_checkpoint(url)
    torch.testing.assert_close(_w(again), _w(first))
    assert server.requests["/r/swin_replaced.pth"] == 2
    with open(path, "rb") as f:
        assert f.read() == body
    read_checkpoint(url)  # verified once in this process: no new request
    assert server.requests["/r/swin_replaced.pth"] == 2


# ---------------------------------------------------------------- the error table
def test_urls_naming_no_file_or_with_spaces_are_refused_before_any_request(server, torch_home):
    for path in ("/x/..", "/x/.", "/x/"):
        with pytest.raises(CheckpointError, match=r"the URL names no file .*expected the URL of a checkpoint file"):
            fetch(server.url(path))
    for bad in (server.url("/x/swin tiny.pth"), server.url("/x/swin\ntiny.pth"), server.url("/x/a\x00.pth")):
        with pytest.raises(CheckpointError, match=r"not a valid URL: it contains .* at position \d+; percent-encode"):
            fetch(bad)
    assert server.total() == 0 and _cached() == []


def test_a_long_file_name_is_cached_under_a_short_one(server, torch_home):
    name = "swin_" + "x" * 300 + ".pth"
    url = server.serve(f"/long/{name}", _body(3))
    path = fetch(url)[0]
    assert len(os.path.basename(path)) < 140 and path.endswith("x.pth")
    torch.testing.assert_close(_w(read_checkpoint(url)), _w(torch.load(io.BytesIO(_body(3)), weights_only=True)))


def test_a_redirect_off_http_names_its_target_and_is_not_retried(server, torch_home):
    server.redirect["/r/swin_ftp.pth"] = "ftp://files.example/swin_ftp.pth"
    url = server.url("/r/swin_ftp.pth")
    with pytest.raises(CheckpointError, match=r"redirected \(HTTP 302\) to 'ftp://files\.example/swin_ftp\.pth', "
                                              r"which is not an http:// or https:// URL"):
        fetch(url)
    assert server.requests["/r/swin_ftp.pth"] == 1
    # an http redirect is followed, and an error after it names where it went
    server.redirect["/r/moved.pth"] = server.url("/new/gone.pth")
    with pytest.raises(CheckpointError, match=r"HTTP 404 Not Found \(at http://127\.0\.0\.1:\d+/new/gone\.pth\)"):
        fetch(server.url("/r/moved.pth"))
    assert server.requests["/new/gone.pth"] == 1  # a 404 is not retried


def test_a_file_size_limit_is_a_clear_error(server, torch_home):
    """RLIMIT_FSIZE (ulimit -f) below the file's size, for this one fetch: the error names the
    URL and the limit, and nothing stays in the cache (a full disk takes the same path: ENOSPC)."""
    resource = pytest.importorskip("resource")
    url = server.serve("/big/swin_big.pth", _body(4, n=20000))
    os.makedirs(cache_dir())
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, hard))
    try:
        with pytest.raises(CheckpointError) as info:
            fetch(url)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    message = str(info.value)
    assert url in message and "may not write files this large" in message and "ulimit -f" in message, message
    assert server.requests["/big/swin_big.pth"] == 1  # not retried
    assert not [f for f in os.listdir(cache_dir()) if f.endswith((".pth", ".tmp"))]


@pytest.mark.parametrize("header, problem", [
    (b'{"w": {"dtype": "F32", "shape": ["x"], "data_offsets": [0, 4]}}', "shape must be a list of sizes"),
    (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 99999999999999999999999]}}', "data_offsets must be"),
    (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}', "data_offsets must be"),
    (b'{"w": 3}', "expected an object, found int"),
    (b'{"w": ' + b"[" * 100000 + b"]" * 100000 + b"}", "not JSON"),
])
def test_malformed_safetensors_headers_name_the_file(tmp_path, header, problem):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(CheckpointError, match=rf"checkpoint '{path}': expected a safetensors file; .*{problem}"):
        read_checkpoint(str(path))


def test_a_fifo_or_a_device_is_not_a_file(tmp_path):
    fifo = tmp_path / "pipe.pth"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match=rf"checkpoint '{fifo}': is a FIFO \(named pipe\), not a regular file"):
        read_checkpoint(str(fifo))  # (opening it would block)
    with pytest.raises(CheckpointError, match=r"checkpoint '/dev/zero': is a character device, not a regular file"):
        read_checkpoint("/dev/zero")
