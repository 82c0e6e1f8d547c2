"""Checkpoint references that are not local paths: what mmengine's ``CheckpointLoader`` accepts.

=================================== ==================================================================
``http://`` / ``https://`` URL       downloaded once into ``torch.hub.get_dir()/checkpoints``
                                     (``$TORCH_HOME/hub/...``, the folder mmengine's and torch's
                                     ``load_url`` use), read from there afterwards with no network
``torchvision://NAME``              mmengine's table of torchvision's weights (``modelzoo://``: the
                                     old spelling), then as a URL
``open-mmlab://NAME``               mmengine's OpenMMLab table (``$MMENGINE_HOME/open_mmlab.json``
                                     overrides it; deprecated names followed), then as a URL or a file
                                     under ``$MMENGINE_HOME``
``mmcls://NAME``                    mmengine's mmcls table, then as a URL
other prefixes of ``CheckpointLoader`` storage backends (``s3://``, ``petrel://``, ``pavi://``, any
                                     scheme registered with ``CheckpointLoader.register_scheme``):
                                     mmengine's loader reads it; conversion and report are ours
=================================== ==================================================================

The cache (docs/checkpoints.md, "The download cache"):

- **A cached file holds the URL it was asked for.** Each download records its source beside
  it (``<name>.json``: URL, size, sha256, ETag). A URL is cached under its file name, as torch
  and mmengine name it, unless that name is ambiguous (a query string, no extension, a generic
  hub name, an mmengine run name such as ``epoch_12.pth``) or already records another URL:
  then under ``<sha256(url)[:12]>-<name>``. A file without a record (torch or mmengine
  downloaded it) is used for the unambiguous names only.
- **One download per file** across threads, processes, ranks and jobs sharing the cache:
  ``fcntl.flock`` on ``<name>.lock`` around check -> download -> rename. No collective: it
  works before a process group exists and when only some ranks read.
- **It finishes or fails:** a per-read timeout, retries with backoff for what a retry can fix
  (a timeout, a dropped connection, HTTP 408 / 429 / 5xx), and one overall deadline from a
  minimum throughput, ``TIMEOUT + min(size, MAX_BYTES) / MIN_SPEED`` (:func:`download_settings`),
  which processes waiting on the lock share; then an error naming the URL and the remedy. A size
  cap, ``MAX_BYTES``, refuses a larger ``Content-Length`` before the body and cuts off a stream
  that sends more (no retry): a server cannot make a download endless or fill the disk.
- **A cached file is checked against its record** before use: its size always, its sha256 once
  per process and file; a mismatch is warned about and the file downloaded again.
- The download goes to a staging file beside the cached one (:func:`.files.atomic_path`, a name
  no other file's staging can match), is checked (``Content-Length``, a sha256 prefix the name
  carries where its publisher guarantees it, readable as a checkpoint) and only then renamed
  into place: nothing half-written or foreign reaches the cache.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import json
import os
import re
import socket
import time
import urllib.error
import warnings
from typing import Dict, Iterator, List, Optional, Tuple, Union
from urllib.parse import quote, urlparse, urlsplit, urlunsplit
from urllib.request import HTTPRedirectHandler, Request, build_opener

import torch

from .base import CheckpointError
from .files import atomic_path, atomic_write, read_file, temp_files_of

try:  # POSIX; elsewhere downloads are not serialised across processes
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

URL_PREFIXES = ("http://", "https://")
#: mmengine's name tables: prefix -> (what the names are, how to get a name's URL).
NAMED_PREFIXES = ("torchvision://", "modelzoo://", "open-mmlab://", "openmmlab://", "mmcls://")
#: File names that many sources share (Hugging Face hub files, other frameworks' run names):
#: never cached under the bare name.
GENERIC_NAMES = ("model.safetensors", "pytorch_model.bin", "model.bin", "model.pth", "model.pt", "checkpoint.pth",
                 "model_final.pth", "latest.pth")
#: mmengine's CheckpointHook names (``epoch_12.pth``, ``iter_160000.pth``, ``best_coco_bbox_mAP_epoch_36.pth``):
#: every experiment has them.
RUN_NAME = re.compile(r"^(?:(?:epoch|iter)_\d+|best_.+)\.pth$")
#: A sha256 prefix in a file name, as torch's ``HASH_REGEX`` (``swin_t-704ceda3.pth``), 8 hex digits at least.
HASH_IN_NAME = re.compile(r"-([0-9a-f]{8,64})\.[A-Za-z0-9]+$")
#: Hosts whose file names' hash prefixes are guaranteed (torchvision loads them with
#: ``check_hash=True``); OpenMMLab's are not (mim dropped its check, open-mmlab/mim#11).
HASHED_HOSTS = ("download.pytorch.org",)

#: Settings from the environment: name -> (default, what it is).
SETTINGS = {
    "SWIN_BACKBONE_DOWNLOAD_TIMEOUT": (60.0, "seconds without a byte from the server before a try fails"),
    "SWIN_BACKBONE_DOWNLOAD_RETRIES": (3, "tries after the first on a timeout, a dropped connection, HTTP 5xx / 429"),
    "SWIN_BACKBONE_DOWNLOAD_BACKOFF": (1.0, "seconds before the first retry, doubled for each further one"),
    "SWIN_BACKBONE_DOWNLOAD_MIN_SPEED": (100000.0, "bytes per second a download must average: it, and the wait "
                                                   "for another process's download, ends after TIMEOUT + "
                                                   "min(size, MAX_BYTES) / MIN_SPEED seconds"),
    # 8 GiB: well above the largest Swin checkpoints users download (Swin-L / SwinV2-L backbones,
    # Swin-L Mask R-CNN / UPerNet with optimizer state: about 0.8-2.5 GB), and a bound on what a
    # server that declares no size, or a huge one, can make a download last and write to disk.
    "SWIN_BACKBONE_DOWNLOAD_MAX_BYTES": (8 * 1024 ** 3, "bytes a download may have: a larger Content-Length is "
                                                        "refused before the body, a longer stream cut off"),
}
#: Settings that must be > 0 (the others may be 0).
POSITIVE_SETTINGS = ("SWIN_BACKBONE_DOWNLOAD_TIMEOUT", "SWIN_BACKBONE_DOWNLOAD_MIN_SPEED",
                     "SWIN_BACKBONE_DOWNLOAD_MAX_BYTES")
#: HTTP answers worth another try (a Retry-After header is honoured, up to :data:`MAX_RETRY_AFTER`).
RETRY_STATUS = (408, 429, 500, 502, 503, 504)
MAX_RETRY_AFTER = 60.0
#: A torch / mmengine ``.partial`` file not written to for this long belongs to a dead download.
STALE_PARTIAL_S = 3600
READ_CHUNK = 1 << 20
#: A URL's file name longer than this is cached under a hashed, shortened name (file systems
#: allow 255 bytes, and the staging and record files add to it).
MAX_NAME = 120
#: How often a process waiting on another's download looks at the lock (seconds).
LOCK_POLL_S = 0.1


def is_reference(checkpoint: str) -> bool:
    """``checkpoint`` names something other than a local path (it has a ``scheme://``)."""
    return "://" in checkpoint


def cache_dir() -> str:
    """Where URLs are cached: ``torch.hub.get_dir()/checkpoints`` (``$TORCH_HOME/hub/checkpoints``),
    the folder torch's and mmengine's ``load_url`` use."""
    return os.path.join(torch.hub.get_dir(), "checkpoints")


def download_settings() -> Dict[str, float]:
    """``{'timeout': s, 'retries': n, 'backoff': s, 'min_speed': bytes/s, 'max_bytes': n}`` from
    :data:`SETTINGS` (environment variables, else the defaults); a value that is not a number
    (an integer for ``RETRIES`` and ``MAX_BYTES``) >= 0, or > 0 for :data:`POSITIVE_SETTINGS`, is a
    :class:`CheckpointError` naming the variable."""
    out = {}
    for var, (default, what) in SETTINGS.items():
        raw = os.environ.get(var, "")
        try:
            value = type(default)(raw) if raw.strip() else default
        except ValueError:
            value = -1
        positive = var in POSITIVE_SETTINGS
        if not value >= 0 or (positive and value == 0) or value == float("inf"):
            kind = ("an integer" if isinstance(default, int) else "a number") + (" > 0" if positive else " >= 0")
            raise CheckpointError(f"${var}: expected {kind} ({what}; default {default}), got {raw!r}")
        out[var[len("SWIN_BACKBONE_DOWNLOAD_"):].lower()] = value
    return out


# ---------------------------------------------------------------- names and records
def _url_hash(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:12]


def _name(url: str) -> str:
    """The file name a URL ends in (checked: a URL a cache file can be named after). Non-ASCII
    letters are kept (as torch names the file; :func:`_request_url` percent-encodes them for the
    request); a name never holds a ``/``, and ``.`` / ``..`` are refused."""
    bad = next((i for i, c in enumerate(url) if c.isspace() or ord(c) < 32 or ord(c) == 127
                or 0xD800 <= ord(c) <= 0xDFFF), None)
    if bad is not None:
        raise CheckpointError(f"checkpoint {url!r}: not a valid URL: it contains {url[bad]!r} at position {bad}; "
                              "percent-encode spaces, control characters and undecodable bytes (a space is %20)")
    parsed = urlparse(url)
    if not parsed.hostname:
        raise CheckpointError(f"checkpoint {url!r}: not a valid URL: it names no host; expected "
                              "http(s)://HOST/PATH/FILE")
    name = parsed.path.rsplit("/", 1)[-1]
    if not name or name in (".", ".."):
        raise CheckpointError(f"checkpoint {url!r}: the URL names no file (its path ends in {'/' + name!r}); "
                              "expected the URL of a checkpoint file")
    return name


def _request_url(url: str) -> str:
    """``url`` as it is sent: non-ASCII characters of its path and query percent-encoded as UTF-8,
    as browsers send them (``/é.pth`` -> ``/%C3%A9.pth``; HTTP request lines are ASCII); an ASCII
    URL unchanged, a non-ASCII host left to http.client (IDNA)."""
    if url.isascii():
        return url
    parts = urlsplit(url)

    def encode(text: str) -> str:
        return re.sub(r"[^\x00-\x7f]+", lambda m: quote(m.group(), safe=""), text)

    return urlunsplit((parts.scheme, parts.netloc, encode(parts.path), encode(parts.query), ""))


def _utf8_tail(name: str, limit: int) -> str:
    """The longest end of ``name`` of at most ``limit`` UTF-8 bytes (file systems count bytes)."""
    while len(name.encode()) > limit:
        name = name[1:]
    return name


def is_ambiguous(url: str) -> bool:
    """Whether ``url``'s file name may well name other files too: a query string
    (``uc?id=...``), no extension (``.../files/123/content``), a generic hub name
    (:data:`GENERIC_NAMES`) or an mmengine run name (:data:`RUN_NAME`)."""
    name = _name(url)
    return (bool(urlparse(url).query) or "." not in name or name.lower() in GENERIC_NAMES or bool(RUN_NAME.match(name))
            or len(name.encode()) > MAX_NAME)


def record_of(path: str) -> Optional[dict]:
    """The source record (``<path>.json``: url, size, sha256, ...) of a cached file, or ``None``
    where there is none or it is unreadable (whether it describes the file: :func:`_check_cached`)."""
    try:
        with open(path + ".json") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _base_file(url: str) -> str:
    """The cache path ``url`` starts from: its file name, or for ambiguous names the hashed one."""
    return os.path.join(cache_dir(), _hashed_name(url) if is_ambiguous(url) else _name(url))


def _hashed_name(url: str) -> str:
    """``<sha256(url)[:12]>-<name>``, the name's end kept where it is longer than :data:`MAX_NAME` bytes."""
    return f"{_url_hash(url)}-{_utf8_tail(_name(url), MAX_NAME)}"


def cached_file(url: str) -> str:
    """The cache path of ``url``: its file name, as torch's ``load_state_dict_from_url`` names it
    (so a file mmengine downloaded is found, and the reverse), or ``<sha256(url)[:12]>-<name>``
    where the name is ambiguous (:func:`is_ambiguous`) or the file there records another URL."""
    path = _base_file(url)
    if os.path.basename(path) == _name(url):
        record = record_of(path) if os.path.isfile(path) else None
        if record is not None and record.get("url") != url:
            path = os.path.join(cache_dir(), _hashed_name(url))
    return path


def expected_hash(url: str, check_hash: Optional[bool] = None) -> str:
    """The sha256 prefix a download of ``url`` must have, or '': the one its name carries
    (``name-<hex>.ext``, :data:`HASH_IN_NAME`) where ``check_hash`` is true, or (``None``) where
    its host guarantees it (:data:`HASHED_HOSTS`: torchvision's weights)."""
    m = HASH_IN_NAME.search(_name(url))
    if m is None or check_hash is False:
        return ""
    return m.group(1) if check_hash or urlparse(url).hostname in HASHED_HOSTS else ""


# ---------------------------------------------------------------- references
def resolve(checkpoint: str) -> Tuple[str, str]:
    """``(kind, where)`` for a reference: ``('url', URL)``, ``('file', local path)`` (an
    ``open-mmlab://`` name mapped to a file under ``$MMENGINE_HOME``) or ``('mmengine', ref)``
    (a storage backend that mmengine's ``CheckpointLoader`` reads).

    Raises:
        CheckpointError: a name mmengine's tables do not have, or a scheme nothing knows.
    """
    if checkpoint.startswith(URL_PREFIXES):
        return "url", checkpoint
    if checkpoint.startswith(NAMED_PREFIXES):
        return _named(checkpoint)
    from mmengine.runner.checkpoint import CheckpointLoader

    # only the catch-all '' (local files: ours once swin_backbone is imported) matches: no scheme knows it
    if not any(prefix and re.match(prefix, checkpoint) for prefix in CheckpointLoader._schemes):
        known = "http://, https://, torchvision://, open-mmlab://, mmcls://"
        raise CheckpointError(
            f"checkpoint {checkpoint!r}: unknown scheme {checkpoint.split('://')[0] + '://'!r}; expected a local "
            f"path, a URL or a prefix of mmengine's CheckpointLoader ({known}, s3://, petrel://, pavi://, or one "
            "registered with CheckpointLoader.register_scheme)"
        )
    return "mmengine", checkpoint


def _named(checkpoint: str) -> Tuple[str, str]:
    """A ``torchvision://`` / ``open-mmlab://`` / ``mmcls://`` name through mmengine's tables."""
    from mmengine.runner import checkpoint as mm

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
        close = sorted(k for k in table if name.split(".")[0].split("_")[0] in k)[:8]
        raise CheckpointError(
            f"checkpoint {checkpoint!r}: {name!r} is not in mmengine's {prefix}:// table ({len(table)} names"
            + (f"; similar: {', '.join(close)}" if close else "") + ")"
        )
    url = table[name]
    if url.startswith(URL_PREFIXES):
        return "url", url
    return "file", os.path.join(mm._get_mmengine_home(), url)  # open-mmlab: a file under $MMENGINE_HOME


# ---------------------------------------------------------------- fetching
class _Deadline:
    """One fetch's time budget, shared by the wait for another process's download and its own
    tries: what the retries allow for stalls (each try's ``TIMEOUT`` and the backoffs between)
    plus ``min(size, MAX_BYTES) / MIN_SPEED`` seconds, from the start (``size``: the
    ``Content-Length`` where known, also another process's as its lock file says, else the bytes
    received so far). ``cap``: ``MAX_BYTES``, also what :func:`_get` lets a download have."""

    def __init__(self, settings: Dict[str, float]) -> None:
        self.start = time.monotonic()
        tries = int(settings["retries"]) + 1
        self.grace = tries * settings["timeout"] + settings["backoff"] * (2 ** (tries - 1) - 1)
        self.speed = settings["min_speed"]
        self.cap = int(settings["max_bytes"])
        self.size: Optional[int] = None

    def counted(self, received: int = 0) -> int:
        """The bytes the budget allows for: the declared size, else ``received``, at most the cap."""
        return max(0, min(self.size if self.size is not None else received, self.cap))

    def budget(self, received: int = 0) -> float:
        return self.grace + self.counted(received) / self.speed

    def left(self, received: int = 0) -> float:
        return self.start + self.budget(received) - time.monotonic()

    def exceeded(self, named: str, url: str, what: str, received: int = 0) -> CheckpointError:
        size = f"{self.size} bytes" if self.size is not None else f"{received} bytes so far"
        if self.counted(received) == self.cap < (self.size if self.size is not None else received):
            size = f"{self.cap} bytes ($SWIN_BACKBONE_DOWNLOAD_MAX_BYTES, not the {size})"
        return CheckpointError(
            f"{named}: {what}, and it did not finish within its deadline of {self.budget(received):.3g} s "
            f"(the tries' {self.grace:g} s + {size} / $SWIN_BACKBONE_DOWNLOAD_MIN_SPEED={self.speed:g} bytes/s); "
            f"the server or the network is too slow: try again later, lower $SWIN_BACKBONE_DOWNLOAD_MIN_SPEED, or "
            f"download {url} elsewhere and pass its local path (nothing was kept in the cache)")


def fetch(checkpoint: str, map_location: Union[str, torch.device] = "cpu", progress: Optional[bool] = None,
          check_hash: Optional[bool] = None) -> Tuple[str, Optional[object]]:
    """The local file of a URL (cached, downloaded once) or of a named reference.

    A cache hit opens no connection and takes no lock (a read-only cache serves hits); it is
    checked against its record first (:func:`_usable`). A miss takes ``<name>.lock``
    (``fcntl.flock``): one process downloads, the others wait (within the same deadline) and
    then read its file. No collective is involved: any subset of ranks, or processes without a
    process group, may call this.

    Args:
        check_hash: check the sha256 prefix a file name carries (``name-<hex>.pth``): ``True``
            always, ``False`` never, ``None`` where its host guarantees it (:func:`expected_hash`).
    Returns:
        ``(path, content)``: the local file, and what it holds where this call downloaded (and
        therefore already read) it, else ``None``.
    Raises:
        CheckpointError: unreachable host, an HTTP error, a stalled, too slow or cut-off download
            (after the retries, within the deadline), a wrong hash, a file that is not a checkpoint
            (nothing left in the cache), a full or unwritable cache folder, an invalid URL, or a
            reference that is not a URL / name; each names the URL and what to do.
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
    settings = download_settings()
    deadline = _Deadline(settings)
    base = _base_file(where)
    _writable(named, where, os.path.dirname(base), os.makedirs, os.path.dirname(base), exist_ok=True)
    with _locked(named, where, base + ".lock", deadline) as publish:
        path = cached_file(where)  # another process may have downloaded it (or another URL this name) meanwhile
        if os.path.isfile(path) and _usable(named, where, path, warn=False):
            return path, None
        _remove_stale(path)
        return path, _download(named, where, path, map_location, progress, expected_hash(where, check_hash),
                               settings, deadline, publish)


#: Cached files whose sha256 matched their record in this process: (path, inode, size, mtime).
_VERIFIED = set()


def _usable(named: str, url: str, path: str, warn: bool = True) -> bool:
    """Whether the cached ``path`` is what its record says (size always, sha256 once per process
    and file); a mismatch is warned about (the caller downloads again). A file without a record
    (torch or mmengine downloaded it; unambiguous names only, :func:`cached_file`) is used as is."""
    record = record_of(path)
    if record is None:
        if not os.path.exists(path + ".json"):
            return True
        problem = f"its record {path}.json is unreadable"
    else:
        st = os.stat(path)
        key = (path, st.st_ino, st.st_size, st.st_mtime_ns)
        problem = ""
        if record.get("size") != st.st_size:
            problem = f"it has {st.st_size} bytes, its record {record.get('size')}"
        elif key not in _VERIFIED:
            digest = _sha256(path)
            if record.get("sha256") not in (None, digest):
                problem = f"its sha256 is {digest}, its record's {record.get('sha256')}"
            else:
                _VERIFIED.add(key)
    if problem and warn:
        warnings.warn(f"{named}: the cached file {path} is not the one downloaded from {url} ({problem}): it was "
                      "replaced or damaged; downloading it again", RuntimeWarning, stacklevel=3)
    return not problem


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(READ_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _writable(named: str, url: str, folder: str, call, *args, **kwargs):
    """``call(*args, **kwargs)``; an ``OSError`` is a :class:`CheckpointError` saying the cache
    folder cannot be written (e.g. a read-only shared ``$TORCH_HOME``, a full disk)."""
    try:
        return call(*args, **kwargs)
    except OSError as err:
        raise _unwritable(named, url, folder, err) from None


def _unwritable(named: str, url: str, folder: str, err: OSError, received: Optional[int] = None) -> CheckpointError:
    after = f" after {received} bytes" if received is not None else ""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return CheckpointError(
            f"{named}: the download cache {folder} is full{after} ({err.strerror}); free space there, or point "
            f"$TORCH_HOME at a folder with room (torch.hub.get_dir()) (nothing was kept in the cache)")
    if err.errno == errno.EFBIG:
        return CheckpointError(
            f"{named}: this process may not write files this large{after} ({err.strerror}: the file size limit, "
            f"ulimit -f); raise the limit, or download {url} elsewhere and pass its local path (nothing was kept in "
            "the cache)")
    if err.errno == errno.ENAMETOOLONG:
        return CheckpointError(
            f"{named}: the file system of the download cache {folder} refuses the file name ({err.strerror}); "
            f"download {url} elsewhere and pass its local path")
    return CheckpointError(
        f"{named}: cannot write to the download cache {folder} ({type(err).__name__}: {err.strerror or err}); "
        f"point $TORCH_HOME at a writable folder (torch.hub.get_dir()), or download {url} elsewhere and pass its "
        "local path")


class _Publish:
    """What the lock's holder tells the processes waiting on it (in the lock file): its pid, the
    size it expects and the bytes it has, so that they share its deadline."""

    def __init__(self, fd: Optional[int]) -> None:
        self.fd, self.last = fd, 0.0

    def __call__(self, size: Optional[int], received: int, force: bool = False) -> None:
        now = time.monotonic()
        if self.fd is None or (not force and now - self.last < 0.5):
            return
        self.last = now
        try:
            data = json.dumps(dict(pid=os.getpid(), size=size, received=received)).encode()
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, data, 0)
        except OSError:  # another user's lock file, opened read-only: the waiters use their own deadline
            pass


def _holder(fd: int) -> dict:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode())
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return info if isinstance(info, dict) else {}


@contextlib.contextmanager
def _locked(named: str, url: str, lock: str, deadline: _Deadline) -> Iterator[_Publish]:
    """Hold an exclusive ``flock`` on ``lock`` (created if need be, never removed: removing a
    lock file that others may have open is a race). Waiting for it is logged once and ends at
    ``deadline`` (the holder's expected size and progress, read from the lock file, set it)."""
    if fcntl is None:  # pragma: no cover
        yield _Publish(None)
        return
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        writable = True
    except OSError as err:
        try:  # another user's lock file: a read-only descriptor locks as well
            fd, writable = os.open(lock, os.O_RDONLY), False
        except OSError:
            raise _unwritable(named, url, os.path.dirname(lock), err) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            from mmengine.logging import print_log

            print_log(f"{named}: another process is downloading it; waiting for {lock}", logger="current")
            _wait(named, url, fd, deadline)
        yield _Publish(fd if writable else None)
    finally:
        os.close(fd)  # releases the lock


def _wait(named: str, url: str, fd: int, deadline: _Deadline) -> None:
    while True:
        time.sleep(LOCK_POLL_S)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        holder = _holder(fd)
        if isinstance(holder.get("size"), int):
            deadline.size = holder["size"]
        received = holder.get("received") if isinstance(holder.get("received"), int) else 0
        if deadline.left(received) <= 0:
            raise deadline.exceeded(named, url, f"another process (pid {holder.get('pid', '?')}) is downloading it "
                                                f"({received} bytes so far)", received)


def _remove_stale(path: str) -> None:
    """Staging files of downloads that died (killed processes): ours (:func:`.files.temp_files_of`,
    exactly ``path``'s; only one process downloads ``path`` at a time, the lock's holder) and
    torch's / mmengine's ``<path>.<32 hex>.partial`` nobody has written to for :data:`STALE_PARTIAL_S`."""
    now = time.time()
    folder, name = os.path.split(path)
    partial = re.compile(re.escape(name) + r"\.[0-9a-f]{32}\.partial")
    try:
        theirs = [os.path.join(folder, n) for n in os.listdir(folder) if partial.fullmatch(n)]
    except OSError:
        theirs = []
    for stale in temp_files_of(path) + theirs:
        try:
            if stale in theirs and now - os.path.getmtime(stale) <= STALE_PARTIAL_S:
                continue
            os.remove(stale)
        except OSError:
            pass


class _Transient(Exception):
    """A try that may succeed when repeated: ``what`` says what happened."""

    def __init__(self, what: str, retry_after: Optional[float] = None) -> None:
        super().__init__(what)
        self.what, self.retry_after = what, retry_after


def _download(where: str, url: str, path: str, map_location: Union[str, torch.device], progress: Optional[bool],
              hash_prefix: str, settings: Dict[str, float], deadline: _Deadline, publish: _Publish) -> object:
    """Download ``url`` to ``path`` through a staging file that must be complete, carry the
    expected hash and read as a checkpoint; then write its record and rename it into place.
    Only what a retry can fix is retried (:class:`_Transient`), within ``deadline``."""
    from mmengine.logging import print_log

    show = os.isatty(0) if progress is None else progress
    print_log(f"{where}: downloading to {path}", logger="current")
    tries = int(settings["retries"]) + 1
    with atomic_path(path) as staging:
        for attempt in range(tries):
            try:
                headers, size, sha256 = _get(where, url, path, staging, settings["timeout"], show, deadline,
                                             publish)
                break
            except _Transient as err:
                if attempt + 1 == tries:
                    raise CheckpointError(f"{where}: {err.what} ({_tries(tries)}); nothing was kept in the "
                                          "cache") from None
                delay = err.retry_after if err.retry_after is not None else settings["backoff"] * 2 ** attempt
                if deadline.left() <= delay:
                    raise deadline.exceeded(where, url, err.what) from None
                print_log(f"{where}: {err.what}; trying again in {delay:g} s ({attempt + 2} of {tries})",
                          logger="current")
                time.sleep(delay)
        if hash_prefix and not sha256.startswith(hash_prefix):
            raise CheckpointError(f"{where}: the downloaded file's sha256 is {sha256}, but its name says it starts "
                                  f"with {hash_prefix} (torch's check_hash); the file at the URL is not the one "
                                  "named, or was corrupted on the way (nothing was kept in the cache)")
        try:
            content = read_file(staging, map_location)
        except CheckpointError as err:
            from .files import ASKS_FOR_CODE

            detail = str(err)
            detail = detail.split(": ", 1)[1] if detail.startswith(f"checkpoint {staging!r}: ") else detail
            why = "" if ASKS_FOR_CODE in detail else "; the download was cut off or the URL does not serve a " \
                                                     "checkpoint file"
            raise CheckpointError(f"{where}: the downloaded file ({size} bytes) is not a readable checkpoint: "
                                  f"{detail}{why} (nothing was kept in the cache)") from None
        record = dict(url=url, size=size, sha256=sha256, etag=headers.get("ETag"),
                      last_modified=headers.get("Last-Modified"),
                      downloaded=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        # The record first: a reader that sees the file sees its record (both are renamed into place).
        _writable(where, url, os.path.dirname(path), atomic_write, path + ".json", json.dumps(record, indent=1))
    return content


def _tries(n: int) -> str:
    return "1 try" if n == 1 else f"{n} tries, $SWIN_BACKBONE_DOWNLOAD_RETRIES={n - 1}"


class _Redirects(HTTPRedirectHandler):
    """urllib's redirects, http(s) only (urllib also follows ftp://), each one remembered for errors."""

    def __init__(self, named: str) -> None:
        self.named, self.chain = named, []  # type: str, List[str]

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urlparse(newurl).scheme not in ("http", "https"):
            raise CheckpointError(f"{self.named}: {urlparse(req.full_url).netloc} redirected (HTTP {code}) to "
                                  f"{newurl!r}, which is not an http:// or https:// URL; only those are followed. "
                                  "Download the file yourself and pass its local path")
        self.chain.append(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _socket_of(response) -> Optional[socket.socket]:
    raw = getattr(getattr(response, "fp", None), "raw", None)
    return getattr(raw, "_sock", None)


def _get(where: str, url: str, path: str, staging: str, timeout: float, progress: bool, deadline: _Deadline,
         publish: _Publish) -> Tuple[dict, int, str]:
    """One GET of ``url`` into ``staging``, the staging file of ``path`` (``timeout``: seconds each connect / read may wait,
    never past ``deadline``).

    Returns:
        ``(headers, size, sha256 hex digest)``.
    Raises:
        _Transient: a timeout, a dropped or cut-off connection, HTTP 408 / 429 / 5xx.
        CheckpointError: another HTTP error, an unreachable host, a redirect off http(s), an
            invalid URL, a full or unwritable cache, the deadline.
    """
    redirects = _Redirects(where)
    host = urlparse(url).netloc

    def at() -> str:  # the host answering now, and how it was reached
        return urlparse(redirects.chain[-1]).netloc + f" (redirected from {host})" if redirects.chain else host

    def stalled() -> str:
        return (f"no data from {at()} for {timeout:g} s ($SWIN_BACKBONE_DOWNLOAD_TIMEOUT); the server or a proxy "
                "stalled")

    folder = os.path.dirname(staging)
    size = 0
    f = _writable(where, url, folder, open, staging, "wb")
    try:
        try:
            opener = build_opener(redirects)
            response = opener.open(Request(_request_url(url), headers={"User-Agent": "swin-backbone (torch.hub)"}),
                                   timeout=max(min(timeout, deadline.left()), 0.05))
        except urllib.error.HTTPError as err:
            answer = f"the server answered HTTP {err.code} {err.reason}" + (
                f" (at {redirects.chain[-1]})" if redirects.chain else "")
            if err.code in RETRY_STATUS:
                raise _Transient(answer, _retry_after(err.headers.get("Retry-After"))) from None
            raise CheckpointError(f"{where}: {answer}; expected the checkpoint file") from None
        except urllib.error.URLError as err:
            if isinstance(err.reason, (socket.timeout, TimeoutError)):
                raise _Transient(stalled()) from None
            if isinstance(err.reason, (ConnectionResetError, ConnectionAbortedError, http.client.HTTPException)):
                raise _Transient(f"the connection to {at()} dropped ({err.reason!r})") from None
            raise CheckpointError(f"{where}: cannot reach {at()} ({err.reason}); download the file elsewhere and "
                                  f"pass its local path, or put it at {path}") from err
        except (http.client.InvalidURL, UnicodeError) as err:
            raise CheckpointError(f"{where}: not a valid URL ({err}); percent-encode what it names") from None
        except (socket.timeout, TimeoutError):
            raise _Transient(stalled()) from None
        except (http.client.HTTPException, ConnectionError) as err:
            raise _Transient(f"the connection to {at()} dropped ({type(err).__name__}: {err})") from None
        with response:
            headers = dict(response.headers.items())
            length = response.headers.get("Content-Length")
            expected = int(length) if length and length.isdigit() else None
            cap = deadline.cap
            if expected is not None and expected > cap:
                raise CheckpointError(
                    f"{where}: {at()} declares {expected} bytes (Content-Length), more than the download cap of "
                    f"{cap} bytes ($SWIN_BACKBONE_DOWNLOAD_MAX_BYTES); nothing was read. If the file is that "
                    f"large, raise $SWIN_BACKBONE_DOWNLOAD_MAX_BYTES, or download {url} elsewhere and pass its "
                    "local path (nothing was kept in the cache)")
            if expected is not None:
                deadline.size = expected
            publish(expected, 0, force=True)
            digest = hashlib.sha256()
            bar = _progress(expected) if progress else None
            read = getattr(response, "read1", response.read)  # read1: what has arrived, so a stall counts it
            sock = _socket_of(response)
            try:
                while True:
                    left = deadline.left(size)
                    if left <= 0:
                        raise deadline.exceeded(where, url, f"{at()} sent {size} of {expected or '?'} bytes", size)
                    if sock is not None:
                        sock.settimeout(max(min(timeout, left), 0.05))
                    chunk = read(min(READ_CHUNK, cap - size + 1))  # one byte past the cap tells a longer stream
                    if not chunk:
                        break
                    if size + len(chunk) > cap:  # a stream with no (or a false) Content-Length: no retry
                        declared = f"it declared {expected}" if expected is not None else "it declared no size"
                        raise CheckpointError(
                            f"{where}: {at()} sent more than the download cap of {cap} bytes "
                            f"($SWIN_BACKBONE_DOWNLOAD_MAX_BYTES; {declared}); the download was cut off there. "
                            f"If the file is that large, raise $SWIN_BACKBONE_DOWNLOAD_MAX_BYTES, or download {url} "
                            "elsewhere and pass its local path (nothing was kept in the cache)")
                    try:
                        f.write(chunk)
                    except OSError as err:
                        raise _unwritable(where, url, folder, err, size) from None
                    digest.update(chunk)
                    size += len(chunk)
                    publish(expected, size)
                    if bar is not None:
                        bar.update(len(chunk))
            except (socket.timeout, TimeoutError):
                if deadline.left(size) <= 0.05:
                    raise deadline.exceeded(where, url, f"{at()} sent {size} of {expected or '?'} bytes",
                                            size) from None
                raise _Transient(f"{stalled()} after {size} bytes") from None
            except http.client.IncompleteRead as err:
                size += len(err.partial)
                raise _Transient(f"the connection closed after {size} of {expected} bytes (cut off)") from None
            except (http.client.HTTPException, ConnectionError) as err:
                raise _Transient(f"the connection to {at()} dropped after {size} bytes ({type(err).__name__})") \
                    from None
            finally:
                if bar is not None:
                    bar.close()
        try:
            f.flush()
        except OSError as err:
            raise _unwritable(where, url, folder, err, size) from None
    finally:
        try:
            f.close()
        except OSError:  # (a failed write's buffered rest: the write's own error is the one raised)
            pass
    if expected is not None and size != expected:
        raise _Transient(f"the connection closed after {size} of {expected} bytes (cut off)")
    return headers, size, digest.hexdigest()


def _retry_after(value: Optional[str]) -> Optional[float]:
    """Seconds of a ``Retry-After`` header (its number form), capped at :data:`MAX_RETRY_AFTER`."""
    try:
        return min(max(float(value), 0.0), MAX_RETRY_AFTER) if value is not None else None
    except ValueError:
        return None


def _progress(total: Optional[int]):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024)


def read_reference(checkpoint: str, map_location: Union[str, torch.device] = "cpu") -> object:
    """What a reference (:func:`is_reference`) holds: fetched (:func:`fetch`) and read as
    weights only, or, for storage backends, :func:`_read_backend`."""
    kind, where = resolve(checkpoint)
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
    """A storage-backend reference. mmengine's own ``s3://`` / ``petrel://`` loader unpickles
    with torch's default (no ``weights_only`` before torch 2.6): its bytes are fetched through
    the same file backend and read here, weights only. A scheme registered with
    ``CheckpointLoader.register_scheme`` (or ``pavi://``) is read by that loader: code the
    user installed, which decides how to unpickle (docs/checkpoints.md)."""
    from mmengine.runner.checkpoint import CheckpointLoader, load_from_ceph

    try:
        if CheckpointLoader._get_checkpoint_loader(checkpoint) is load_from_ceph:
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
        return CheckpointLoader.load_checkpoint(checkpoint, map_location=map_location, logger="current")
    except CheckpointError:
        raise
    except Exception as err:  # any backend's error, never without the reference
        raise CheckpointError(f"checkpoint {checkpoint!r}: mmengine's CheckpointLoader cannot read it "
                              f"({type(err).__name__}: {err})") from err
