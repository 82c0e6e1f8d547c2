"""The downloader finishes or fails (issue #45): one deadline from a minimum throughput, shared
by the processes waiting on the lock; a size cap ($SWIN_BACKBONE_DOWNLOAD_MAX_BYTES) on what a
server declares or sends; non-ASCII file names; the cache checked against its records; each row
of the issue's error table a CheckpointError naming the URL or path and the remedy, with no
retry where a retry cannot help. Against the real HTTP server on 127.0.0.1 (loopback.py)."""
import fcntl
import io
import json
import os
import threading
import time

import pytest
import torch

from swin_backbone import CheckpointError
from swin_backbone.checkpoint import read_checkpoint
from swin_backbone.checkpoint.records import ASKS_FOR_CODE
from swin_backbone.checkpoint.remote import cache_dir, cached_file, fetch, record_of

from . import pickles
from .loopback import server, torch_home  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


def _body(seed=0, n=4):
    torch.manual_seed(seed)
    buf = io.BytesIO()
    torch.save({"state_dict": {"w": torch.randn(n)}}, buf)
    return buf.getvalue()


def _settings(monkeypatch, **values):
    """``$SWIN_BACKBONE_DOWNLOAD_<NAME>`` for each ``name=value``."""
    for name, value in values.items():
        monkeypatch.setenv(f"SWIN_BACKBONE_DOWNLOAD_{name.upper()}", str(value))


def _w(obj):
    return obj["state_dict"]["w"]


def _cached():
    folder = cache_dir()
    return sorted(f for f in os.listdir(folder) if not f.endswith(".lock")) if os.path.isdir(folder) else []


# ---------------------------------------------------------------- the deadline
@pytest.mark.parametrize("declared", [None, 3000, 10 ** 9], ids=["no-length", "small-length", "huge-length"])
def test_a_trickling_server_ends_at_the_deadline_whatever_size_it_declares(server, torch_home, monkeypatch,
                                                                             declared):
    """A byte every 0.05 s never trips the read timeout. The deadline, the tries' TIMEOUT + received
    bytes / MIN_SPEED, is about 0.5 s for each: a false Content-Length under the cap (10**9 bytes,
    10**6 s at 1000 bytes/s) buys the server no time."""
    _settings(monkeypatch, timeout="0.5", retries="0", min_speed="1000")
    url = server.stream("/slow/swin_trickle.pth", declared=declared, fill=b"x", chunk=1, every=0.05)
    size = declared or r"\?"
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"checkpoint '{url}': 127\.0\.0\.1:\d+ sent \d+ of "
                                              rf"{size} bytes, and it did not finish within its "
                                              r"deadline of 0\.5\d* s \(the tries' 0\.5 s \+ \d+ bytes received / "
                                              r"\$SWIN_BACKBONE_DOWNLOAD_MIN_SPEED=1000 bytes/s\).*nothing was kept"):
        read_checkpoint(url)
    assert time.monotonic() - start < 2.0  # (the server would trickle for 8 s)
    assert server.requests["/slow/swin_trickle.pth"] == 1 and _cached() == []


@pytest.mark.parametrize("answer", ["trickled-headers", "endless-continue"])
def test_a_server_that_never_finishes_its_headers_ends_at_the_deadline(torch_home, monkeypatch, answer):
    """Before any body byte: a status line and then a header byte every 0.05 s (http.client reads
    header lines of up to 64 KB, 100 of them: 90 hours), or ``100 Continue`` answers without end
    (http.client skips any number of them: forever, at full speed). The deadline, 0.5 s here,
    counted only the body's reads. Against a raw socket server on 127.0.0.1."""
    import socket

    _settings(monkeypatch, timeout="0.5", retries="0", min_speed="1000")
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():  # (it gives up after 8 s, so that a loader without the deadline fails rather than hangs)
        conn, _ = listener.accept()
        until = time.monotonic() + 8
        with conn:
            conn.recv(65536)
            try:
                if answer == "trickled-headers":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                    while not stop.wait(0.05) and time.monotonic() < until:
                        conn.sendall(b"a")
                else:
                    while not stop.is_set() and time.monotonic() < until:
                        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n" * 100)
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/swin_headers.pth"
    start = time.monotonic()
    try:
        with pytest.raises(CheckpointError, match=rf"checkpoint '{url}': 127\.0\.0\.1:\d+ did not send its answer's "
                                                  r"status line and headers, and it did not finish within its deadline "
                                                  r"of 0\.5 s .*nothing was kept in the cache"):
            read_checkpoint(url)
        assert time.monotonic() - start < 3.0
    finally:
        stop.set()
        listener.close()
        thread.join(5)
    assert _cached() == []


def test_a_steady_download_outlasting_the_tries_timeouts_finishes(server, torch_home, monkeypatch):
    """Received bytes extend the deadline: 20 KB/s for about a second, above a MIN_SPEED of 5000
    bytes/s, finishes although the tries' TIMEOUT alone (0.5 s) is shorter."""
    _settings(monkeypatch, timeout="0.5", retries="0", min_speed="5000")
    body = _body(8, n=5000)
    url = server.stream("/steady/swin_steady.pth", declared=len(body), body=body, chunk=2000, every=0.1)
    start = time.monotonic()
    torch.testing.assert_close(_w(read_checkpoint(url)), _w(torch.load(io.BytesIO(body), weights_only=True)))
    assert time.monotonic() - start > 0.5 and server.requests["/steady/swin_steady.pth"] == 1


def test_waiting_on_another_download_shares_its_deadline(server, torch_home, monkeypatch):
    url = server.serve("/held/swin_held.pth", _body())
    _settings(monkeypatch, timeout="0.5", retries="0", min_speed="1000")
    os.makedirs(cache_dir())
    lock = cached_file(url) + ".lock"
    holder = os.open(lock, os.O_RDWR | os.O_CREAT)  # a stuck downloader: holds the lock, has received 1000 bytes
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        os.write(holder, json.dumps(dict(pid=4242, received=1000)).encode())
        start = time.monotonic()
        with pytest.raises(CheckpointError, match=rf"checkpoint '{url}': another process \(pid 4242\) is downloading "
                                                  r"it \(1000 bytes so far\), and it did not finish within its "
                                                  r"deadline of 1\.5 s"):
            read_checkpoint(url)
        assert 1.4 < time.monotonic() - start < 3.5 and server.total() == 0
    finally:
        os.close(holder)
    torch.testing.assert_close(_w(read_checkpoint(url)), _w(torch.load(io.BytesIO(_body()), weights_only=True)))


def _read_at_once(rank, barrier, url, out):
    torch.set_num_threads(1)
    barrier.wait()  # both ask at once: one downloads, the other waits on the lock
    torch.save(read_checkpoint(url), os.path.join(out, f"p{rank}.pth"))


@pytest.mark.slow  # 2 processes
def test_a_waiter_outlasts_its_own_timeouts_while_the_holder_makes_progress(server, torch_home, monkeypatch,
                                                                            tmp_path):
    """Two real processes, a download of about 1.5 s at 20 KB/s, the tries' TIMEOUT 1 s: the waiter
    reads the holder's progress from the lock file, waits it out and reads the holder's file."""
    import multiprocessing

    _settings(monkeypatch, timeout="1", retries="0", min_speed="5000")
    body = _body(9, n=7000)
    url = server.stream("/both/swin_both.pth", declared=len(body), body=body, chunk=2000, every=0.1)
    ctx = multiprocessing.get_context("fork")
    torch.multiprocessing.start_processes(_read_at_once, args=(ctx.Barrier(2), url, str(tmp_path)), nprocs=2,
                                          start_method="fork")
    want = _w(torch.load(io.BytesIO(body), weights_only=True))
    for rank in range(2):
        torch.testing.assert_close(_w(torch.load(tmp_path / f"p{rank}.pth", weights_only=True)), want)
    assert server.requests["/both/swin_both.pth"] == 1
    assert os.path.getsize(cached_file(url) + ".lock") == 0  # emptied: the next download's waiters start from 0


def test_bad_min_speed_names_the_variable(server, torch_home, monkeypatch):
    url = server.serve("/s/swin_speed.pth", _body())
    for bad in ("0", "fast", "-3", "inf"):
        monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_MIN_SPEED", bad)
        with pytest.raises(CheckpointError, match=rf"\$SWIN_BACKBONE_DOWNLOAD_MIN_SPEED: expected a number > 0 .*"
                                                  rf"got '{bad}'"):
            read_checkpoint(url)
    assert server.total() == 0


# ---------------------------------------------------------------- the size cap
def test_a_declared_size_above_the_cap_is_refused_before_the_body(server, torch_home, monkeypatch):
    # the review's case: Content-Length 10**12, a byte every 0.4 s; the default cap (8 GiB) refuses it at once
    _settings(monkeypatch, timeout="1", retries="2", min_speed="1000")
    url = server.stream("/huge/swin_huge.pth", declared=10 ** 12, fill=b"x", chunk=1, every=0.4)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"checkpoint '{url}': 127\.0\.0\.1:\d+ declares 1000000000000 bytes "
                                              r"\(Content-Length\), more than the download cap of 8589934592 bytes "
                                              r"\(\$SWIN_BACKBONE_DOWNLOAD_MAX_BYTES\); nothing was read\. If the file "
                                              r"is that large, raise \$SWIN_BACKBONE_DOWNLOAD_MAX_BYTES.*nothing was "
                                              r"kept"):
        fetch(url)
    assert time.monotonic() - start < 1.0
    assert server.requests["/huge/swin_huge.pth"] == 1 and server.sent["/huge/swin_huge.pth"] <= 2  # no retry
    assert _cached() == []
    # an honest checkpoint above a small cap: refused, nothing cached; under a cap it fits, downloaded
    body = _body(5, n=5000)
    url = server.serve("/cap/swin_capped.pth", body)
    monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_MAX_BYTES", str(len(body) - 1))
    with pytest.raises(CheckpointError, match=rf"declares {len(body)} bytes \(Content-Length\), more than the "
                                              rf"download cap of {len(body) - 1} bytes"):
        fetch(url)
    assert _cached() == [] and server.requests["/cap/swin_capped.pth"] == 1
    monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_MAX_BYTES", str(len(body)))
    torch.testing.assert_close(_w(read_checkpoint(url)), _w(torch.load(io.BytesIO(body), weights_only=True)))
    assert _cached() == ["swin_capped.pth", "swin_capped.pth.json"]


def test_a_stream_without_a_size_is_cut_at_the_cap(server, torch_home, monkeypatch):
    # the review's case: no Content-Length, an endless 40 KB/s (above MIN_SPEED); cut at a 60 KB cap, not retried
    _settings(monkeypatch, retries="2", min_speed="1000", max_bytes="60000")
    url = server.stream("/endless/swin_endless.pth", declared=None, fill=b"\0", chunk=4000, every=0.1)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"checkpoint '{url}': 127\.0\.0\.1:\d+ sent more than the download "
                                              r"cap of 60000 bytes \(\$SWIN_BACKBONE_DOWNLOAD_MAX_BYTES; it declared "
                                              r"no size\); the download was cut off there\. If the file is that large, "
                                              r"raise \$SWIN_BACKBONE_DOWNLOAD_MAX_BYTES.*nothing was kept"):
        fetch(url)
    assert 1.0 < time.monotonic() - start < 5.0  # 60000 bytes at 40 KB/s: 1.5 s, then cut
    assert server.requests["/endless/swin_endless.pth"] == 1 and _cached() == []
    # the cap is inclusive: a checkpoint of exactly MAX_BYTES with no Content-Length downloads, one byte less is cut
    body = _body(6)
    url = server.stream("/nolength/swin_nolength.pth", declared=None, body=body)
    monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_MAX_BYTES", str(len(body) - 1))
    with pytest.raises(CheckpointError, match=rf"sent more than the download cap of {len(body) - 1} bytes"):
        fetch(url)
    assert _cached() == []
    monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_MAX_BYTES", str(len(body)))
    torch.testing.assert_close(_w(read_checkpoint(url)), _w(torch.load(io.BytesIO(body), weights_only=True)))
    assert record_of(cached_file(url))["size"] == len(body)


def test_a_waiter_counts_at_most_the_cap_of_a_huge_claimed_progress(server, torch_home, monkeypatch):
    """A lock file saying the holder has received 10**12 bytes: the waiter's deadline is TIMEOUT +
    MAX_BYTES / MIN_SPEED (0.5 + 2000 / 1000 s; one try), not 10**9 s."""
    url = server.serve("/held/swin_held_huge.pth", _body())
    _settings(monkeypatch, timeout="0.5", retries="0", min_speed="1000", max_bytes="2000")
    os.makedirs(cache_dir())
    holder = os.open(cached_file(url) + ".lock", os.O_RDWR | os.O_CREAT)
    release = threading.Timer(7.0, fcntl.flock, (holder, fcntl.LOCK_UN))  # without the clamp: the waiter gets it
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        os.write(holder, json.dumps(dict(pid=4243, received=10 ** 12)).encode())
        release.start()
        start = time.monotonic()
        with pytest.raises(CheckpointError, match=rf"checkpoint '{url}': another process \(pid 4243\) is downloading "
                                                  r"it \(1000000000000 bytes so far\), and it did not finish within "
                                                  r"its deadline of 2\.5 s \(the tries' 0\.5 s \+ 2000 bytes "
                                                  r"received"):
            read_checkpoint(url)
        assert 2.4 < time.monotonic() - start < 5.0 and server.total() == 0
    finally:
        release.cancel()
        os.close(holder)


def test_bad_max_bytes_names_the_variable(server, torch_home, monkeypatch):
    url = server.serve("/s/swin_cap.pth", _body())
    for bad in ("0", "-1", "lots", "1.5", "1e9", "inf"):
        monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_MAX_BYTES", bad)
        with pytest.raises(CheckpointError, match=r"\$SWIN_BACKBONE_DOWNLOAD_MAX_BYTES: expected an integer > 0 "
                                                  r"\(bytes a download may have.*; default 8589934592\), "
                                                  rf"got '{bad}'"):
            read_checkpoint(url)
    assert server.total() == 0 and _cached() == []
    monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_MAX_BYTES", " 1000000 ")
    read_checkpoint(url)
    assert server.total() == 1


# ---------------------------------------------------------------- non-ASCII names
def test_a_non_ascii_file_name_is_downloaded_and_cached_under_it(server, torch_home):
    body = _body(7)
    served = server.serve("/w/%C3%A9.pth", body)  # what a browser requests for /w/é.pth
    url = server.url("/w/é.pth")
    torch.testing.assert_close(_w(read_checkpoint(url)), _w(torch.load(io.BytesIO(body), weights_only=True)))
    assert cached_file(url) == os.path.join(cache_dir(), "é.pth") and record_of(cached_file(url))["url"] == url
    read_checkpoint(url)  # the cache: no second request
    assert server.requests["/w/%C3%A9.pth"] == 1
    # the percent-encoded spelling is another URL (another cache name, as torch names it), the same file
    torch.testing.assert_close(_w(read_checkpoint(served)), _w(torch.load(io.BytesIO(body), weights_only=True)))
    assert os.path.basename(cached_file(served)) == "%C3%A9.pth"
    # a query and a long name (over 120 bytes in UTF-8: hashed, shortened by bytes), all inside the cache folder
    server.serve("/uc?id=%C3%BC", body)
    long_name = "swin_" + "é" * 100 + ".pth"
    server.serve("/w/swin_" + "%C3%A9" * 100 + ".pth", body)
    server.serve("/w/..%2F..%2Fescape.pth", body)
    for other in ("/uc?id=ü", "/w/" + long_name, "/w/..%2F..%2Fescape.pth"):
        path = fetch(server.url(other))[0]
        assert os.path.dirname(path) == cache_dir() and os.path.isfile(path), path
        assert len(os.path.basename(path).encode()) <= 133 and record_of(path)["url"] == server.url(other)
    assert server.total() == 5 and not [f for f in os.listdir(os.path.dirname(cache_dir())) if f != "checkpoints"]
    # a lone surrogate (an undecodable file-system byte) is no URL: a clear error, no request
    with pytest.raises(CheckpointError, match=r"not a valid URL: it contains '\\udce9' at position \d+; "
                                              r"percent-encode"):
        fetch(server.url("/w/\udce9.pth"))
    assert server.total() == 5


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
    with pytest.raises(CheckpointError, match=r"not a valid URL \(nonnumeric port: 'port'\); percent-encode"):
        fetch("http://127.0.0.1:port/x/swin.pth")
    assert server.total() == 0 and _cached() == []


def test_a_served_file_that_asks_to_run_code_is_refused_and_not_cached(server, torch_home, tmp_path):
    marker = tmp_path / "ran"
    data = pickles.program(pickles.call(pickles.g("posix.system"), pickles.s(f"touch {marker}")))
    with open(pickles.in_zip(tmp_path / "evil.pth", data), "rb") as f:
        url = server.serve("/evil/swin_evil.pth", f.read())
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(url)
    message = str(info.value)
    assert message.startswith(f"checkpoint '{url}': the downloaded file (") and ASKS_FOR_CODE in message, message
    assert "posix.system" in message and "cut off" not in message and "nothing was kept in the cache" in message
    assert not marker.exists() and _cached() == [] and server.requests["/evil/swin_evil.pth"] == 1


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
    (b'{"w": {"dtype": "F32", "shape": ["x"], "data_offsets": [0, 4]}}', "shape must be a list of at most 32 sizes"),
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
