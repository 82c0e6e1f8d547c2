"""Checkpoint references that are not local paths, as mmengine's ``CheckpointLoader`` takes them
(:func:`resolve`): ``http(s)://`` URLs, downloaded once into ``torch.hub.get_dir()/checkpoints``
(the folder torch's and mmengine's ``load_url`` use) with a record ``<name>.json`` beside each
file (:func:`fetch`, :func:`cached_file`); ``torchvision://`` (``modelzoo://``), ``open-mmlab://``
(``openmmlab://``) and ``mmcls://`` names, through mmengine's tables to a URL or a file; any other
prefix (``s3://``, ``pavi://``, registered schemes), read by mmengine's loader.

A download is a security boundary (:class:`_Fetch`): a timeout on each read, retries of what a
retry can fix, one deadline that only received bytes extend (never a declared size), a size cap
on what a server declares or sends, one downloading process per file (``flock``), and a staging
file renamed into place only once complete, carrying the hash its name promises and readable as
a checkpoint (docs/checkpoints.md, "References" and "The download cache").
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import io
import itertools
import json
import os
import re
import socket
import sys
import time
import urllib.error
import warnings
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union
from urllib.parse import quote, urlparse, urlsplit, urlunsplit
from urllib.request import HTTPHandler, HTTPRedirectHandler, HTTPSHandler, Request, build_opener

import torch

from .base import CheckpointError
from .files import ASKS_FOR_CODE, atomic_path, atomic_write, read_file, temp_files_of

URL_PREFIXES = ("http://", "https://")
NAMED_PREFIXES = ("torchvision://", "modelzoo://", "open-mmlab://", "openmmlab://", "mmcls://")
#: File names that many sources share (Hugging Face hub files, other frameworks' run names).
GENERIC_NAMES = ("model.safetensors", "pytorch_model.bin", "model.bin", "model.pth", "model.pt", "checkpoint.pth",
                 "model_final.pth", "latest.pth")
#: mmengine's CheckpointHook names (``epoch_12.pth``, ``iter_160000.pth``, ``best_coco_bbox_mAP_epoch_36.pth``).
RUN_NAME = re.compile(r"^(?:(?:epoch|iter)_\d+|best_.+)\.pth$")
#: A sha256 prefix in a file name, as torch's ``HASH_REGEX`` (``swin_t-704ceda3.pth``), 8 hex digits at least.
HASH_IN_NAME = re.compile(r"-([0-9a-f]{8,64})\.[A-Za-z0-9]+$")
#: Hosts whose names' hash prefixes are guaranteed (torchvision loads them with ``check_hash=True``);
#: OpenMMLab's are not (mim dropped its check, open-mmlab/mim#11).
HASHED_HOSTS = ("download.pytorch.org",)

#: Settings from the environment: name -> (default, whether it must be > 0 rather than >= 0, what it is).
SETTINGS = {
    "SWIN_BACKBONE_DOWNLOAD_TIMEOUT": (60.0, True, "seconds without a byte from the server before a try fails"),
    "SWIN_BACKBONE_DOWNLOAD_RETRIES": (3, False, "tries after the first on a timeout, a dropped connection, "
                                                 "HTTP 5xx / 429"),
    "SWIN_BACKBONE_DOWNLOAD_BACKOFF": (1.0, False, "seconds before the first retry, doubled for each further one"),
    "SWIN_BACKBONE_DOWNLOAD_MIN_SPEED": (100000.0, True, "bytes per second a download, or a wait for one, must "
                                                         "average beyond the tries' timeouts and backoffs"),
    # Well above the largest Swin checkpoints (Swin-L / SwinV2-L detectors with optimizer state).
    "SWIN_BACKBONE_DOWNLOAD_MAX_BYTES": (8 * 1024 ** 3, True, "bytes a download may have: a larger Content-Length "
                                                              "is refused before the body, a longer stream cut off"),
}
RETRY_STATUS = (408, 429, 500, 502, 503, 504)
#: Failures of a connection once made, worth another try (a refused connection is not).
DROPPED = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, http.client.HTTPException)
#: A torch / mmengine ``.partial`` file not written to for this long belongs to a dead download.
STALE_PARTIAL_S = 3600
READ_CHUNK = 1 << 20
#: The printable ASCII characters: kept as they are in a request's URL.
URL_SAFE = "".join(map(chr, range(33, 127)))
#: Longer file names (UTF-8 bytes) are cached under a hashed, shortened name (file systems allow 255).
MAX_NAME = 120


def is_reference(checkpoint: str) -> bool:
    """``checkpoint`` names something other than a local path (it has a ``scheme://``)."""
    return "://" in checkpoint


def cache_dir() -> str:
    """``torch.hub.get_dir()/checkpoints``: where torch's and mmengine's ``load_url`` cache too."""
    return os.path.join(torch.hub.get_dir(), "checkpoints")


def download_settings() -> Dict[str, float]:
    """``{'timeout', 'retries', 'backoff', 'min_speed', 'max_bytes'}`` from :data:`SETTINGS`; a value
    that is not a finite number (an integer for ``RETRIES`` / ``MAX_BYTES``) >= 0 (> 0 where
    :data:`SETTINGS` says so) is a :class:`CheckpointError` naming the variable."""
    out = {}
    for var, (default, positive, what) in SETTINGS.items():
        raw = os.environ.get(var, "")
        try:
            value = type(default)(raw) if raw.strip() else default
        except ValueError:
            value = -1
        if not value >= 0 or (positive and value == 0) or value == float("inf"):
            kind = ("an integer" if isinstance(default, int) else "a number") + (" > 0" if positive else " >= 0")
            raise CheckpointError(f"${var}: expected {kind} ({what}; default {default}), got {raw!r}")
        out[var[len("SWIN_BACKBONE_DOWNLOAD_"):].lower()] = value
    return out


def _log(message: str) -> None:
    from mmengine.logging import print_log  # (mmengine's log, as the Runner's; imported once a download runs)

    print_log(message, logger="current")


# ---------------------------------------------------------------- names and records
def _name(url: str) -> str:
    """The file name ``url`` ends in (non-ASCII kept, as torch names the file); whitespace,
    control characters, lone surrogates and names ``''`` / ``.`` / ``..`` are errors."""
    bad = next((i for i, c in enumerate(url) if c.isspace() or ord(c) < 32 or ord(c) == 127
                or 0xD800 <= ord(c) <= 0xDFFF), None)
    if bad is not None:
        raise CheckpointError(f"checkpoint {url!r}: not a valid URL: it contains {url[bad]!r} at position {bad}; "
                              "percent-encode spaces, control characters and undecodable bytes (a space is %20)")
    name = urlparse(url).path.rsplit("/", 1)[-1]
    if name in ("", ".", ".."):
        raise CheckpointError(f"checkpoint {url!r}: the URL names no file (its path ends in {'/' + name!r}); "
                              "expected the URL of a checkpoint file")
    return name


def _request_url(url: str) -> str:
    """``url`` with the non-ASCII characters of its path and query percent-encoded as UTF-8, as a
    browser sends them (``/é.pth`` -> ``/%C3%A9.pth``)."""
    if url.isascii():
        return url
    parts = urlsplit(url)  # (spaces and control characters: refused by :func:`_name` before)
    path, query = quote(parts.path, safe=URL_SAFE), quote(parts.query, safe=URL_SAFE)
    return urlunsplit((parts.scheme, parts.netloc, path, query, ""))


def is_ambiguous(url: str) -> bool:
    """Whether ``url``'s file name may well name other files too: a query string, no extension,
    :data:`GENERIC_NAMES`, :data:`RUN_NAME`, or longer than :data:`MAX_NAME` bytes."""
    name = _name(url)
    return (bool(urlparse(url).query) or "." not in name or name.lower() in GENERIC_NAMES or bool(RUN_NAME.match(name))
            or len(name.encode()) > MAX_NAME)


def _json_object(read: Callable[[], str]) -> Optional[dict]:
    """``read()`` parsed as a JSON object; ``None`` where it cannot be read or holds no object."""
    try:
        value = json.loads(read())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def record_of(path: str) -> Optional[dict]:
    """The record ``<path>.json`` (url, size, sha256, etag, ...) of a cached file; ``None`` where
    there is none or it cannot be read."""

    def read() -> str:
        with open(path + ".json") as f:
            return f.read()

    return _json_object(read)


def cached_file(url: str, recorded: bool = True) -> str:
    """The cache path of ``url``: its file name, as torch's ``load_state_dict_from_url`` names it,
    or ``<sha256(url)[:12]>-<name>`` (the name's last :data:`MAX_NAME` UTF-8 bytes) where the name
    is ambiguous (:func:`is_ambiguous`) or, with ``recorded``, the file there records another URL.
    ``recorded=False``: the path that does not depend on the cache's content (its lock's name)."""
    name = tail = _name(url)
    while len(tail.encode()) > MAX_NAME:
        tail = tail[1:]
    hashed = os.path.join(cache_dir(), f"{hashlib.sha256(url.encode()).hexdigest()[:12]}-{tail}")
    if is_ambiguous(url):
        return hashed
    path = os.path.join(cache_dir(), name)
    record = record_of(path) if recorded and os.path.isfile(path) else None
    return hashed if record is not None and record.get("url") != url else path


def expected_hash(url: str, check_hash: Optional[bool] = None) -> str:
    """The sha256 prefix the name of ``url`` carries (:data:`HASH_IN_NAME`) where it is checked:
    always with ``check_hash=True``, never with ``False``, for :data:`HASHED_HOSTS` with ``None``."""
    m = HASH_IN_NAME.search(_name(url))
    if m is None or check_hash is False:
        return ""
    return m.group(1) if check_hash or urlparse(url).hostname in HASHED_HOSTS else ""


# ---------------------------------------------------------------- references
def resolve(checkpoint: str) -> Tuple[str, str]:
    """``('url', URL)``, ``('file', path)`` (an ``open-mmlab://`` name mapped to a file under
    ``$MMENGINE_HOME``) or ``('mmengine', ref)`` (read by mmengine's ``CheckpointLoader``).

    Raises:
        CheckpointError: a name mmengine's tables do not have, or a scheme nothing knows.
    """
    if checkpoint.startswith(URL_PREFIXES):
        return "url", checkpoint
    from mmengine.runner import checkpoint as mm

    if not checkpoint.startswith(NAMED_PREFIXES):
        # only the catch-all '' (local files) would match: no scheme knows it
        if not any(prefix and re.match(prefix, checkpoint) for prefix in mm.CheckpointLoader._schemes):
            raise CheckpointError(
                f"checkpoint {checkpoint!r}: unknown scheme {checkpoint.split('://')[0] + '://'!r}; expected a local "
                "path, a URL or a prefix of mmengine's CheckpointLoader (http://, https://, torchvision://, "
                "open-mmlab://, mmcls://, s3://, petrel://, pavi://, or one registered with "
                "CheckpointLoader.register_scheme)")
        return "mmengine", checkpoint
    prefix, name = checkpoint.split("://", 1)
    if prefix in ("torchvision", "modelzoo"):
        try:
            table = mm.get_torchvision_models()
        except ImportError as err:
            raise CheckpointError(f"checkpoint {checkpoint!r}: torchvision:// names are looked up in torchvision's "
                                  f"weight tables; install torchvision ({err})") from err
    elif prefix == "mmcls":
        table = mm.get_mmcls_models()
    else:
        table = mm.get_external_models()
        name = mm.get_deprecated_model_names().get(name, name)
    if name not in table:
        raise CheckpointError(f"checkpoint {checkpoint!r}: {name!r} is not in mmengine's {prefix}:// table "
                              f"({len(table)} names)")
    url = table[name]
    return ("url", url) if url.startswith(URL_PREFIXES) else ("file", os.path.join(mm._get_mmengine_home(), url))


def read_reference(checkpoint: str, map_location: Union[str, torch.device] = "cpu") -> object:
    """What a reference (:func:`is_reference`) holds: fetched (:func:`fetch`) and read as weights
    only, or, for storage backends, :func:`_read_backend`."""
    kind, _ = resolve(checkpoint)
    if kind == "mmengine":
        return _read_backend(checkpoint, map_location)
    path, content = fetch(checkpoint, map_location)
    if content is not None:
        return content
    try:
        return read_file(path, map_location)
    except CheckpointError as err:
        if kind == "file":
            raise CheckpointError(f"checkpoint {checkpoint!r} (mmengine's table maps it to {path!r}): {err}") from None
        raise CheckpointError(f"checkpoint {checkpoint!r} (cached at {path}): {err}; delete the cached file to "
                              "download it again") from None


def _read_backend(checkpoint: str, map_location: Union[str, torch.device]) -> object:
    """A storage-backend reference. mmengine's own ``s3://`` / ``petrel://`` loader unpickles with
    torch's default (no ``weights_only`` before torch 2.6): its bytes are fetched through the same
    file backend and read here, weights only. A scheme registered with
    ``CheckpointLoader.register_scheme`` (or ``pavi://``) is read by that loader: code the user
    installed, which decides how to unpickle (docs/checkpoints.md)."""
    from mmengine.runner.checkpoint import CheckpointLoader, load_from_ceph

    try:
        if CheckpointLoader._get_checkpoint_loader(checkpoint) is not load_from_ceph:
            return CheckpointLoader.load_checkpoint(checkpoint, map_location=map_location, logger="current")
        import tempfile

        from mmengine.fileio import get_file_backend

        data = get_file_backend(checkpoint, backend_args={"backend": "petrel"}).get(checkpoint)
        with tempfile.TemporaryDirectory() as folder:
            local = os.path.join(folder, os.path.basename(urlparse(checkpoint).path) or "checkpoint.pth")
            with open(local, "wb") as f:
                f.write(data)
            try:
                return read_file(local, map_location)
            except CheckpointError as err:
                raise CheckpointError(str(err).replace(repr(local), repr(checkpoint))) from None
    except CheckpointError:
        raise
    except Exception as err:  # any backend's error, never without the reference
        raise CheckpointError(f"checkpoint {checkpoint!r}: mmengine's CheckpointLoader cannot read it "
                              f"({type(err).__name__}: {err})") from err


# ---------------------------------------------------------------- the cache
def fetch(checkpoint: str, map_location: Union[str, torch.device] = "cpu", progress: Optional[bool] = None,
          check_hash: Optional[bool] = None) -> Tuple[str, Optional[object]]:
    """The local file of a URL (cached, downloaded once) or of a named reference.

    A cache hit opens no connection and takes no lock; it is checked against its record first
    (:func:`_usable`). A miss takes ``<name>.lock`` (``fcntl.flock``): one process downloads, the
    others wait within the same deadline and then read its file. No collective: any subset of
    ranks, or processes without a process group, may call this.

    Args:
        progress: a progress bar (torch.hub's tqdm) on stderr; ``None``: where stderr is a terminal.
        check_hash: check the sha256 prefix a file name carries: ``True`` always, ``False`` never,
            ``None`` where its host guarantees it (:func:`expected_hash`).
    Returns:
        ``(path, content)``: the local file, and what it holds where this call downloaded (and so
        already read) it, else ``None``.
    Raises:
        CheckpointError: naming the URL and the remedy, with nothing left in the cache.
    """
    kind, where = resolve(checkpoint)
    if kind == "file":
        return where, None
    if kind != "url":
        raise CheckpointError(f"checkpoint {checkpoint!r}: read by mmengine's CheckpointLoader, not a file to fetch")
    named = f"checkpoint {checkpoint!r}" + ("" if checkpoint == where else f" ({where})")
    path = cached_file(where)
    if os.path.isfile(path) and _usable(named, where, path):
        return path, None
    job = _Fetch(named, where)
    lock = cached_file(where, recorded=False) + ".lock"  # (the cache may change while this waits)
    with job.writing(os.path.dirname(lock)):
        os.makedirs(os.path.dirname(lock), exist_ok=True)
    with job.locked(lock):
        path = cached_file(where)  # another process may have downloaded it (or another URL this name) meanwhile
        if os.path.isfile(path) and _usable(named, where, path, warn=False):
            return path, None
        _remove_stale(path)
        show = sys.stderr.isatty() if progress is None else progress
        return path, job.download(path, map_location, show, expected_hash(where, check_hash))


#: Cached files whose sha256 matched their record in this process: (path, inode, size, mtime).
_VERIFIED = set()


def _usable(named: str, url: str, path: str, warn: bool = True) -> bool:
    """Whether the cached ``path`` is what its record says (size always, sha256 once per process and
    file); a mismatch is warned about and the caller downloads again. A file without a record
    (torch or mmengine downloaded it; unambiguous names only, :func:`cached_file`) is used as is."""
    record = record_of(path)
    if record is None:
        return True
    st = os.stat(path)
    key = (path, st.st_ino, st.st_size, st.st_mtime_ns)
    problem = ""
    if record.get("size") != st.st_size:
        problem = f"it has {st.st_size} bytes, its record {record.get('size')}"
    elif key not in _VERIFIED:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(READ_CHUNK), b""):
                digest.update(chunk)
        if record.get("sha256") not in (None, digest.hexdigest()):
            problem = f"its sha256 is {digest.hexdigest()}, its record's {record.get('sha256')}"
        else:
            _VERIFIED.add(key)
    if problem and warn:
        warnings.warn(f"{named}: the cached file {path} is not the one downloaded from {url} ({problem}): it was "
                      "replaced or damaged; downloading it again", RuntimeWarning, stacklevel=3)
    return not problem


def _remove_stale(path: str) -> None:
    """Staging files of killed downloads of ``path``: ours (:func:`.files.temp_files_of`; only the
    lock's holder downloads ``path``) and torch's / mmengine's ``<path>.<32 hex>.partial`` unwritten
    for :data:`STALE_PARTIAL_S`."""
    folder, name = os.path.split(path)
    partial = re.compile(re.escape(name) + r"\.[0-9a-f]{32}\.partial")
    theirs = [os.path.join(folder, n) for n in os.listdir(folder) if partial.fullmatch(n)]
    for stale in temp_files_of(path) + theirs:
        with contextlib.suppress(OSError):
            if stale not in theirs or time.time() - os.path.getmtime(stale) > STALE_PARTIAL_S:
                os.remove(stale)


# ---------------------------------------------------------------- one download
class _Transient(Exception):
    """A try that may succeed when repeated."""


class _Redirects(HTTPRedirectHandler):
    """urllib's redirects, http(s) only (urllib also follows ftp://), remembered for errors."""

    def __init__(self, named: str) -> None:
        self.named, self.chain = named, []  # type: str, List[str]

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urlparse(newurl).scheme not in ("http", "https"):
            raise CheckpointError(f"{self.named}: {urlparse(req.full_url).netloc} redirected (HTTP {code}) to "
                                  f"{newurl!r}, which is not an http:// or https:// URL; only those are followed. "
                                  "Download the file yourself and pass its local path")
        self.chain.append(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class _DeadlineReads(io.RawIOBase):
    """A response's socket, read with each wait at most ``timeout`` and never past the fetch's
    deadline (``left()`` seconds; ``expired()`` is the error): http.client reads a status line and
    headers a byte at a time if the server sends them so, and skips any number of ``100 Continue``
    answers, bounded by no deadline of its own."""

    def __init__(self, sock: socket.socket, timeout: float, left: Callable[[], float],
                 expired: Callable[[], Exception]) -> None:
        super().__init__()
        self.sock, self.timeout, self.left, self.expired = sock, timeout, left, expired
        self.got = 0  # bytes this answer sent (none: a silent server, a stall rather than a slow one)
        self.raw = sock.makefile("rb", buffering=0)  # (holds the socket open, as http.client's own reader does)

    def readable(self) -> bool:  # noqa: D102
        return True

    def readinto(self, buffer) -> Optional[int]:  # noqa: D102
        left = self.left()
        if left <= 0:
            raise self.expired()
        wait = min(self.timeout, left)
        self.sock.settimeout(max(wait, 0.05))
        try:
            got = self.raw.readinto(buffer)
        except (TimeoutError, socket.timeout):  # (one class from Python 3.10)
            if wait < self.timeout and self.got:  # the deadline cut this wait short: the server was slow, not silent
                raise self.expired() from None
            raise
        self.got += got or 0
        return got

    def close(self) -> None:  # noqa: D102
        if not self.closed:
            self.raw.close()
        super().close()


def _deadline_handlers(reads: Callable[[socket.socket], _DeadlineReads]) -> List[object]:
    """urllib's http and https handlers whose responses read through ``reads(sock)``."""

    def bounded(connection: type) -> type:
        class Response(http.client.HTTPResponse):
            def __init__(self, sock: socket.socket, *args: object, **kwargs: object) -> None:
                super().__init__(sock, *args, **kwargs)
                self.fp.close()
                self.fp = io.BufferedReader(reads(sock))

        return type(connection.__name__, (connection,), dict(response_class=Response))

    class HTTP(HTTPHandler):
        def do_open(self, http_class, req, **kwargs):  # noqa: D102
            return super().do_open(bounded(http_class), req, **kwargs)

    class HTTPS(HTTPSHandler):
        def do_open(self, http_class, req, **kwargs):  # noqa: D102
            return super().do_open(bounded(http_class), req, **kwargs)

    return [HTTP(), HTTPS()]


class _Fetch:
    """One fetch of ``url``: what its errors name, its settings (:func:`download_settings`, read
    before any request) and its deadline, counted from its start: the tries' stalls (each
    ``TIMEOUT`` and the backoffs between them) plus ``received / MIN_SPEED``. Only bytes that
    arrived extend it (``received``: this process's tries so far, or the lock holder's bytes as its
    lock file says, at most what the tries may have), so no declared size, true or false, buys a
    slow server time."""

    def __init__(self, named: str, url: str) -> None:
        settings = download_settings()
        self.named, self.url = named, url
        self.timeout, self.backoff = settings["timeout"], settings["backoff"]
        self.tries = int(settings["retries"]) + 1
        self.speed, self.cap = settings["min_speed"], int(settings["max_bytes"])
        self.grace = self.tries * self.timeout + self.backoff * (2 ** (self.tries - 1) - 1)
        self.start, self.received = time.monotonic(), 0
        self.fd, self.published = -1, 0.0  # the lock file (:meth:`locked`), when :meth:`publish` last wrote it
        self.elsewhere = f"download {url} elsewhere and pass its local path"

    def budget(self, current: int = 0) -> float:
        return self.grace + (self.received + current) / self.speed

    def left(self, current: int = 0) -> float:
        """Seconds left, with ``current`` bytes of the running try on top of :attr:`received`."""
        return self.start + self.budget(current) - time.monotonic()

    def exceeded(self, what: str, current: int = 0) -> CheckpointError:
        return CheckpointError(
            f"{self.named}: {what}, and it did not finish within its deadline of {self.budget(current):.3g} s "
            f"(the tries' {self.grace:g} s + {self.received + current} bytes received / "
            f"$SWIN_BACKBONE_DOWNLOAD_MIN_SPEED={self.speed:g} bytes/s); the server or the network is too slow: "
            f"try again later, lower $SWIN_BACKBONE_DOWNLOAD_MIN_SPEED, or {self.elsewhere}")

    def over_cap(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.named}: {what}. If the file is that large, raise "
                               f"$SWIN_BACKBONE_DOWNLOAD_MAX_BYTES, or {self.elsewhere}")

    @contextlib.contextmanager
    def writing(self, folder: str, received: Optional[int] = None) -> Iterator[None]:
        """Writes into the cache ``folder``: an ``OSError`` becomes an error naming the folder (or
        the limit), the cause and the remedy; ``received``: the bytes downloaded so far."""
        try:
            yield
        except OSError as err:
            after = "" if received is None else f" after {received} bytes"
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                what = (f"the download cache {folder} is full{after} ({err.strerror}); free space there, or point "
                        "$TORCH_HOME at a folder with room (torch.hub.get_dir())")
            elif err.errno == errno.EFBIG:
                what = (f"this process may not write files this large{after} ({err.strerror}: the file size limit, "
                        "ulimit -f); raise the limit")
            else:
                what = (f"cannot write to the download cache {folder}{after} ({type(err).__name__}: "
                        f"{err.strerror or err}); point $TORCH_HOME at a writable folder (torch.hub.get_dir())")
            raise CheckpointError(f"{self.named}: {what}, or {self.elsewhere}") from None

    @contextlib.contextmanager
    def locked(self, lock: str) -> Iterator[None]:
        """Hold an exclusive ``flock`` on ``lock`` (created if need be, never removed: removing a lock
        file others may have open is a race). A waiter polls it, reading the holder's pid and
        received bytes from the file (what the holder's :meth:`publish` writes there, emptied at the
        end), and gives up at the deadline."""
        import fcntl

        with self.writing(os.path.dirname(lock)):
            fd = self.fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            for polls in itertools.count():
                with contextlib.suppress(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                if polls == 0:
                    _log(f"{self.named}: another process is downloading it; waiting for {lock}")
                holder = _json_object(lambda: os.pread(fd, 4096, 0).decode()) or {}
                said = holder.get("received") if type(holder.get("received")) is int else 0
                # the most seen (a read may catch a write half done), at most what the tries may receive
                self.received = max(self.received, min(said, self.tries * self.cap))
                if self.left() <= 0:
                    raise self.exceeded(f"another process (pid {holder.get('pid', '?')}) is downloading it "
                                        f"({said} bytes so far)")
                time.sleep(0.1)
            try:
                yield
            finally:
                with contextlib.suppress(OSError):  # the next holder's waiters start from nothing
                    os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # releases the lock

    def publish(self, received: int, force: bool = False) -> None:
        """Write this process's pid and ``received`` bytes into the held lock file for its waiters
        (every 0.5 s at most, unless ``force``)."""
        if force or time.monotonic() - self.published >= 0.5:
            self.published = time.monotonic()
            with contextlib.suppress(OSError):
                data = json.dumps(dict(pid=os.getpid(), received=received)).encode()
                os.pwrite(self.fd, data, 0)  # (written, then cut: a reader never finds it empty)
                os.ftruncate(self.fd, len(data))

    def download(self, path: str, map_location: Union[str, torch.device], progress: bool, hash_prefix: str) -> object:
        """Download into a staging file of ``path`` (:meth:`get`; what a retry can fix retried within
        the deadline) that must carry ``hash_prefix`` and read as a checkpoint; then write its
        record and rename both into place. Returns what it holds; each error ends in "nothing was
        kept in the cache"."""
        _log(f"{self.named}: downloading to {path}")
        try:
            with atomic_path(path) as staging:
                for attempt in range(self.tries):
                    try:
                        headers, size, sha256 = self.get(path, staging, progress)
                        break
                    except _Transient as err:
                        if attempt + 1 == self.tries:
                            counted = f"{self.tries} {'try' if self.tries == 1 else 'tries'}"
                            raise CheckpointError(f"{self.named}: {err} ({counted}, "
                                                  f"$SWIN_BACKBONE_DOWNLOAD_RETRIES={self.tries - 1})") from None
                        delay = self.backoff * 2 ** attempt
                        if self.left() <= delay:
                            raise self.exceeded(str(err)) from None
                        _log(f"{self.named}: {err}; trying again in {delay:g} s ({attempt + 2} of {self.tries})")
                        time.sleep(delay)
                if hash_prefix and not sha256.startswith(hash_prefix):
                    raise CheckpointError(f"{self.named}: the downloaded file's sha256 is {sha256}, but its name says "
                                          f"it starts with {hash_prefix} (torch's check_hash); the file at the URL is "
                                          "not the one named, or was corrupted on the way")
                try:
                    content = read_file(staging, map_location)
                except CheckpointError as err:
                    detail = str(err).replace(f"checkpoint {staging!r}: ", "", 1)
                    why = "" if ASKS_FOR_CODE in detail else \
                        "; the download was cut off or the URL does not serve a checkpoint file"
                    raise CheckpointError(f"{self.named}: the downloaded file ({size} bytes) is not a readable "
                                          f"checkpoint: {detail}{why}") from None
                record = dict(url=self.url, size=size, sha256=sha256, etag=headers.get("ETag"),
                              last_modified=headers.get("Last-Modified"),
                              downloaded=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
                with self.writing(os.path.dirname(path)):  # the record first: a reader that sees the file sees it
                    atomic_write(path + ".json", json.dumps(record, indent=1))
        except CheckpointError as err:
            err.args = (f"{err}; nothing was kept in the cache",)
            raise
        return content

    def transient(self, err: BaseException, host: str, received: Optional[int] = None) -> Optional[_Transient]:
        """``err`` (urllib's, or the socket's) as a try worth repeating: a timeout or a dropped
        connection; ``None`` for anything else."""
        reason = err.reason if isinstance(err, urllib.error.URLError) else err
        after = "" if received is None else f" after {received} bytes"
        if isinstance(reason, (TimeoutError, socket.timeout)):  # (one class from Python 3.10)
            return _Transient(f"no data from {host} for {self.timeout:g} s ($SWIN_BACKBONE_DOWNLOAD_TIMEOUT); the "
                              f"server or a proxy stalled{after}")
        if isinstance(reason, DROPPED):
            return _Transient(f"the connection to {host} dropped{after} ({type(reason).__name__}: {reason})")
        return None

    def get(self, path: str, staging: str, progress: bool) -> Tuple[dict, int, str]:
        """One GET into ``staging``: ``(headers, size, sha256)``. Each connect and read waits at most
        ``TIMEOUT``, never past the deadline at the start of the try.

        Raises:
            _Transient: a timeout, a dropped or cut-off connection, HTTP 408 / 429 / 5xx.
            CheckpointError: anything else, the deadline and the size cap included.
        """
        redirects = _Redirects(self.named)
        size, expected, answered = 0, None, False  # (only the body's bytes extend the deadline, never headers)

        def at() -> str:  # the host answering now
            return urlparse(redirects.chain[-1] if redirects.chain else self.url).netloc

        def expired() -> CheckpointError:
            return self.exceeded(f"{at()} sent {size} of {expected or '?'} bytes" if answered else
                                 f"{at()} did not send its answer's status line and headers", size)

        def reads(sock: socket.socket) -> _DeadlineReads:
            return _DeadlineReads(sock, self.timeout, lambda: self.left(size), expired)

        try:
            response = build_opener(redirects, *_deadline_handlers(reads)).open(
                Request(_request_url(self.url), headers={"User-Agent": "swin-backbone (torch.hub)"}),
                timeout=max(min(self.timeout, self.left()), 0.05))
        except urllib.error.HTTPError as err:
            answer = f"the server answered HTTP {err.code} {err.reason}" + (
                f" (at {redirects.chain[-1]})" if redirects.chain else "")
            if err.code in RETRY_STATUS:
                raise _Transient(answer) from None
            raise CheckpointError(f"{self.named}: {answer}; expected the checkpoint file") from None
        except http.client.InvalidURL as err:
            raise CheckpointError(f"{self.named}: not a valid URL ({err}); percent-encode what it names") from None
        except (OSError, http.client.HTTPException) as err:  # (urllib's URLError is an OSError)
            transient = self.transient(err, at())
            if transient is not None:
                raise transient from None
            raise CheckpointError(f"{self.named}: cannot reach {at()} ({getattr(err, 'reason', err)}); download the "
                                  f"file elsewhere and pass its local path, or put it at {path}") from err

        folder = os.path.dirname(staging)
        digest, answered = hashlib.sha256(), True
        with response:
            headers = dict(response.headers.items())
            length = response.headers.get("Content-Length", "")
            expected = int(length) if length.isdigit() else None
            if expected is not None and expected > self.cap:
                raise self.over_cap(f"{at()} declares {expected} bytes (Content-Length), more than the download cap "
                                    f"of {self.cap} bytes ($SWIN_BACKBONE_DOWNLOAD_MAX_BYTES); nothing was read")
            with self.writing(folder):
                f = open(staging, "wb")
            self.publish(self.received, force=True)
            bar = torch.hub.tqdm(total=expected, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)
            try:
                while True:
                    if self.left(size) <= 0:  # (a read served from the reader's buffer waits on nothing)
                        raise expired()
                    chunk = response.read1(min(READ_CHUNK, self.cap - size + 1))  # one byte past the cap tells
                    if not chunk:
                        break
                    if size + len(chunk) > self.cap:  # no (or a false) Content-Length; a retry would do the same
                        declared = f"it declared {expected}" if expected is not None else "it declared no size"
                        raise self.over_cap(f"{at()} sent more than the download cap of {self.cap} bytes "
                                            f"($SWIN_BACKBONE_DOWNLOAD_MAX_BYTES; {declared}); the download was cut "
                                            "off there")
                    with self.writing(folder, size):
                        f.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    self.publish(self.received + size)
                    bar.update(len(chunk))
                with self.writing(folder, size):
                    f.flush()
            except (OSError, http.client.HTTPException) as err:  # (the cache's errors are CheckpointErrors here)
                transient = self.transient(err, at(), size)
                if transient is None:
                    raise
                raise transient from None
            finally:
                bar.close()
                self.received += size  # what later tries, and the deadline, count on
                with contextlib.suppress(OSError):  # a failed write's buffered rest: its own error is the one raised
                    f.close()
        if expected is not None and size != expected:
            raise _Transient(f"the connection closed after {size} of {expected} bytes (cut off)")
        return headers, size, digest.hexdigest()
