"""Where a run's files live: a local directory or a Cloud Storage bucket (`gs://…`).

Every workdir file goes through `etils.epath` paths, like orbax's (local: os; `gs://`: fsspec's
gcsfs, or tf.io.gfile with TensorFlow). Disk versus object store is decided here, once:

- Appends (`AppendFile`). An object is written whole: locally each appended line lands at once;
  on an object store `flush` uploads the whole text before each checkpoint save (the training
  loop's order), at close, and at an append FLUSH_EVERY_S after the last upload. A kill loses
  only rows after the last checkpoint, which the resume rewrites (rl/resume.py).
- Writers of local files only (`Mirror`): tensorboardX's event files go to a local temporary
  directory, uploaded likewise (its own gs:// writer re-uploads whole files when collected and
  at exit, waiting out two minutes of retries per file when the store is down).
- Caches only a writer of local files can fill (`local_dir`): a gs:// workdir's task-data
  array_record files (a C++ writer) are built under CACHE.
- Replacing a file whole (`atomic_write`): a temporary file and a rename on a disk; one upload
  on an object store (a reader sees the old object or the new, never a mix).
- Renames (`rename`): atomic on a disk; on an object store a copy of every object, then deletion
  of the old ones. Only checkpoint_steps.set_aside renames; each state a crash there leaves is
  sorted out at the next start.
- Symbolic links, permission bits and `fcntl` locks exist on a disk only. A file is never
  written through a link (`open_file` uses O_NOFOLLOW: `LinkRefused` names the link), so a stray
  link cannot make a run change a file outside its workdir; a linked directory (the workdir,
  `checkpoints/` on another disk) is followed. Object-store run lock: lock.py, storage_gcs.py
  (`read_object`, `create_object`, `replace_object`, `delete_object`).

gcsfs and google-cloud-storage follow STORAGE_EMULATOR_HOST (tests/runs/gcs_test.py runs against
a local emulator). fsspec's listing cache, which would hide objects other processes write
(orbax's TensorStore writers, other hosts, the next run), is off for gs://. Every `gs://` URL
entering this module is checked (storage_gcs.check_url) before any request."""
from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import shutil
import tempfile
import time

import fsspec
from etils import epath

# Re-exported: rl/preflight.py's first request of a gs:// run (the client's, storage_gcs.py).
from stablerl_jax.runs.storage_gcs import check_url

# Listings must show what other writers made (module docstring). Read when the gcsfs
# filesystem is first created, which is after this import in every entry point.
for _protocol in ("gs", "gcs"):
    fsspec.config.conf.setdefault(_protocol, {})["use_listings_cache"] = False

FLUSH_EVERY_S = 30.0  # the longest appended lines wait in memory for an upload
SCHEMES = ("gs",)  # the object stores a workdir may be on
CACHE = os.path.join("~", ".cache", "stablerl_jax")  # `local_dir`'s root


def is_remote(path) -> bool:
    """Whether `path` names an object in a store (`gs://…`), not a local file."""
    return "://" in str(path)


def check_scheme(path, what: str) -> None:
    """A ValueError naming `what` and the fix when `path` is a URI of another store; a
    BadURL when it is a gs:// URL that `check_url` refuses."""
    check_url(path, what)
    scheme = str(path).split("://", 1)[0]
    if is_remote(path) and scheme not in SCHEMES:
        raise ValueError(f"{what} {str(path)!r}: {scheme}:// is not supported; use a local "
                         "path or a gs:// bucket")


def _epath(p) -> epath.Path:
    """`p` as an etils path, a gs:// URL checked first (`check_url`)."""
    check_url(p)
    return epath.Path(p)


def check_local(p, what: str) -> None:
    """A ValueError naming `what` and the fix when `p` is in an object store."""
    check_url(p, what)
    if is_remote(p):
        raise ValueError(f"{what} {str(p)!r}: read from a local disk only; copy it there "
                         f"first (e.g. gcloud storage cp -r {p} DIR) and pass DIR")


def abspath(p: str) -> str:
    """os.path.abspath for a local path; a URI as it is (it is absolute)."""
    check_url(p)
    return str(p) if is_remote(p) else os.path.abspath(p)


def exists(p) -> bool:
    return _epath(p).exists()


def isdir(p) -> bool:
    """A local directory, or a prefix some object lies under."""
    return _epath(p).is_dir()


def isfile(p) -> bool:
    return exists(p) and not isdir(p)


def islink(p) -> bool:
    """A symbolic link (an object store has none)."""
    return not is_remote(p) and os.path.islink(p)


def lexists(p) -> bool:
    """Something is at `p`, a dangling link included."""
    return os.path.lexists(p) if not is_remote(p) else exists(p)


def writable(p) -> bool:
    """Whether this process may create files in the local directory `p`. An object
    store's permissions show at the first write, which the run lock is."""
    return is_remote(p) or os.access(p, os.W_OK)


def local_dir(p: str) -> str:
    """`p` for a local path; for an object store's, CACHE/<scheme>/<bucket>/<path>: the home of
    caches only a writer of local files can fill (module docstring)."""
    check_url(p)
    if not is_remote(p):
        return p
    scheme, rest = str(p).split("://", 1)
    return os.path.join(os.path.expanduser(CACHE), scheme, rest)


def fetch_dir(p: str) -> str:
    """`p` for a local directory; for an object store's, a local copy under `local_dir(p)` made
    once (`.fetched` last: a cut-short copy is redone) for memory-mapped reads (Hugging Face)."""
    if not is_remote(p):
        return p
    dst = local_dir(p)
    done = os.path.join(dst, ".fetched")
    if not os.path.exists(done):
        if not isdir(p):
            raise FileNotFoundError(f"{p}: no such directory")
        os.makedirs(dst, exist_ok=True)
        copytree(p, dst)
        open(done, "w").close()
    return dst


def makedirs(p) -> None:
    """Create a local directory and its parents (an object store has none to create)."""
    check_url(p)
    if not is_remote(p):
        os.makedirs(p, exist_ok=True)


def listdir(p) -> list[str]:
    """Sorted names in a directory; [] for an object store's empty directory (empty prefix)."""
    try:
        return sorted(c.name for c in _epath(p).iterdir())
    except FileNotFoundError:
        if is_remote(p):
            return []
        raise


def read_text(p) -> str:
    return _epath(p).read_text(encoding="utf-8")


def read_bytes(p) -> bytes:
    return _epath(p).read_bytes()


class LinkRefused(ValueError):
    """A file a run writes is a symbolic link (module docstring)."""


def open_no_follow(path, flags) -> int:
    """os.open, never via a symbolic link (`LinkRefused`); the opener of files written here."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise LinkRefused(
            f"{path} is a symbolic link (to {os.readlink(path)!r}); a run never writes "
            "through a link, which could change a file outside its workdir: remove the "
            "link (or link the other way round)") from None


def open_file(p, mode: str = "r"):
    """`open` for either kind of path; a local file opened to write is never written through a
    symbolic link (`LinkRefused`). An object opened to write ('w', 'wb') is a seekable in-memory
    file, uploaded whole if its `with` block exits cleanly; no appends (`AppendFile`)."""
    check_url(p)
    if not is_remote(p):
        return open(p, mode, opener=None if mode in ("r", "rb") else open_no_follow)
    if "r" in mode:
        return _epath(p).open(mode)
    if "a" in mode or "+" in mode:
        raise ValueError(f"{p}: an object cannot be opened with mode {mode!r}")
    return _upload(p, binary="b" in mode)


@contextlib.contextmanager
def _upload(p, binary: bool):
    buf = io.BytesIO() if binary else io.StringIO()
    yield buf
    data = buf.getvalue()
    _epath(p).write_bytes(data if binary else data.encode("utf-8"))


def write_text(p, text: str) -> None:
    """Write a whole file (an object is one upload: there is no partial one)."""
    with open_file(p, "w") as f:
        f.write(text)


def write_bytes(p, data: bytes) -> None:
    with open_file(p, "wb") as f:
        f.write(data)


def copy(src, dst) -> None:
    """Copy a file, either side local or an object."""
    if is_remote(src) or is_remote(dst):
        write_bytes(dst, read_bytes(src))
        return
    with open(src, "rb") as fin, open_file(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout)


def copytree(src, dst) -> None:
    """Copy a directory's files into `dst` (merged with what is there)."""
    if not (is_remote(src) or is_remote(dst)):
        shutil.copytree(src, dst, dirs_exist_ok=True, copy_function=copy)
        return
    makedirs(dst)
    for name in listdir(src):
        (copytree if isdir(os.path.join(src, name)) else copy)(os.path.join(src, name),
                                                               os.path.join(dst, name))


def atomic_write(p, text: str) -> None:
    """Replace the file `p` by `text` atomically (module docstring); a link at `p` is refused
    (`LinkRefused`) and a leftover temporary file removed, never written through."""
    if is_remote(p):
        write_text(p, text)
        return
    if os.path.islink(p):  # the rename would replace the link, its target gone stale
        open_no_follow(p, os.O_WRONLY)  # raises LinkRefused
    tmp = str(p) + ".tmp"
    if os.path.lexists(tmp):  # a crash's leftover; never write through a link there
        os.remove(tmp)
    with open(tmp, "x") as f:
        f.write(text)
    os.replace(tmp, p)


def renames_atomically(p) -> bool:
    """Whether a directory at `p` is renamed in one step (a disk) or object by object
    (an object store; orbax then writes checkpoints in place)."""
    return not is_remote(p)


def rename(src, dst) -> None:
    """Rename a file or directory (on an object store: copy, then delete, not atomic; gcsfs's
    own rename first tries a move request not every store takes, logging an error per object)."""
    if not is_remote(src):
        os.rename(src, dst)
        return
    if lexists(dst):
        raise FileExistsError(f"{dst} exists; not renaming {src} there")
    fs, _ = fsspec.core.url_to_fs(str(src))
    fs.copy(str(src), str(dst), recursive=True)
    fs.rm(str(src), recursive=True)


def rmtree(p) -> None:
    """Delete a directory tree and everything under a prefix; nothing if absent."""
    if exists(p):
        _epath(p).rmtree()


class AppendFile:
    """A text file appended line by line (`append`) or replaced whole (module docstring)."""

    def __init__(self, p: str):
        self.path, self.remote = str(p), is_remote(p)
        self._parts: list[str] | None = None  # the object's text, read at first use
        self._dirty, self._uploaded = False, time.monotonic()

    def append(self, text: str) -> None:
        if not self.remote:
            with open_file(self.path, "a") as f:
                f.write(text)
            return
        if self._parts is None:
            self._parts = [read_text(self.path)] if exists(self.path) else []
        self._parts.append(text)
        self._dirty = True
        if time.monotonic() - self._uploaded >= FLUSH_EVERY_S:
            self.flush()

    def flush(self) -> None:
        """Upload what was appended since the last upload (nothing to do locally)."""
        if self.remote and self._dirty:
            text = "".join(self._parts)
            write_text(self.path, text)
            self._parts, self._dirty, self._uploaded = [text], False, time.monotonic()

    def replace(self, text: str) -> None:
        """The file is `text` from now on (`atomic_write`)."""
        atomic_write(self.path, text)
        if self.remote:
            self._parts, self._dirty, self._uploaded = [text], False, time.monotonic()


class Mirror:
    """A directory a local-file writer fills: `local` is `p` on a disk, else a temporary
    directory whose grown files (append-only) `sync` uploads whole; `close` syncs, removes it."""

    def __init__(self, p: str):
        self.path = str(p)
        self.local = tempfile.mkdtemp(prefix="stablerl-") if is_remote(p) else self.path
        self._sent: dict[str, int] = {}
        self._synced = time.monotonic()

    def sync(self, older_than_s: float = 0.0) -> None:
        """Upload what grew, if the last sync is at least `older_than_s` seconds old."""
        if self.local == self.path or time.monotonic() - self._synced < older_than_s:
            return
        self._synced = time.monotonic()
        for name in sorted(os.listdir(self.local)):
            size = os.path.getsize(os.path.join(self.local, name))
            if self._sent.get(name) != size:
                copy(os.path.join(self.local, name), os.path.join(self.path, name))
                self._sent[name] = size

    def close(self) -> None:
        self.sync()
        if self.local != self.path:
            shutil.rmtree(self.local, ignore_errors=True)


class _ObjectLogHandler(logging.Handler):
    """Logs to an object, re-uploaded whole per record (few: a failed save's orbax errors)."""

    def __init__(self, p: str):
        super().__init__()
        self.path, self._text = p, None

    def emit(self, record) -> None:
        try:
            if self._text is None:
                self._text = read_text(self.path) if exists(self.path) else ""
            self._text += self.format(record) + "\n"
            write_text(self.path, self._text)
        except Exception:  # noqa: BLE001 (logging's contract: report, never raise)
            self.handleError(record)


class _FileHandler(logging.FileHandler):
    """logging's file handler, opening its file never through a link (`open_file`)."""

    def _open(self):
        return open(self.baseFilename, self.mode, encoding=self.encoding, errors=self.errors,
                    opener=open_no_follow)


def log_handler(p: str) -> logging.Handler:
    """A logging handler appending to the file `p` (created at the first record; a symbolic link
    there is refused when the handler is made)."""
    if is_remote(p):
        return _ObjectLogHandler(p)
    if os.path.islink(p):
        open_no_follow(p, os.O_WRONLY)
    return _FileHandler(p, encoding="utf-8", delay=True)
