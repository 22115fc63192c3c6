"""Narrow storage interface over a run's root: a handful of primitives.

Paths are ``str`` relative to the root, joined with ``/`` (pathlib mangles
``s3://``). Local paths take a POSIX fast path (temp file + fsync + rename for
atomic writes); everything else goes through fsspec, with tenacity retries
around transient errors. Missing files raise ``FileNotFoundError`` untouched,
so callers can tell "not there" from "storage broken".

Every file under a run is untrusted input: another job, another user or a
broken host may have written it. So the primitives open regular files only,
follow no symbolic link below the run's root (the root itself may be one),
refuse a path that leaves the run (``..``), open without blocking (a FIFO is
refused, never waited on) and check a file's size before reading it when the
caller gives a ``limit``. A refusal raises ``UnsafePathError``: a damaged
checkpoint, never an outage (``is_damage``). ``delete`` and ``rename`` act on
a symbolic link itself, never on what it points to.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Callable
from typing import IO, Protocol

import tenacity

from .errors import OversizedFileError, StorageAccessError, StorageError, UnsafePathError, UsageError

__all__ = ["MANIFEST_CAP", "SMALL_FILE_CAP", "FsspecStorage", "LocalStorage", "Storage", "is_damage",
           "join", "open_storage"]

CHUNK = 8 << 20

SMALL_FILE_CAP = 1 << 20
"""The most bytes read from a run's small control files: LATEST, run.json, lease.json,
control requests and answers, a rank's JSON state. Their real size is a few KiB."""

MANIFEST_CAP = 64 << 20
"""The most bytes read from a manifest."""


def join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p not in ("", "."))


# OSErrors that say a file or directory is damaged (or was replaced by something else), not
# that storage is unreachable: a checkpoint holding one is passed over, never retried for.
_DAMAGE_ERRNOS = frozenset({errno.ELOOP, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG, errno.ENXIO,
                            errno.ENODEV, errno.EINVAL, errno.EFBIG, errno.EOVERFLOW, errno.ENOENT})


def is_damage(exc: BaseException) -> bool:
    """Whether an error reading a checkpoint means the checkpoint is damaged (restore falls back)
    rather than that storage failed (EIO, timeouts, 5xx, access denied: try again)."""
    if isinstance(exc, UnsafePathError):
        return True
    if isinstance(exc, StorageError):
        return False
    return isinstance(exc, OSError) and exc.errno in _DAMAGE_ERRNOS


class Storage(Protocol):
    """What the core needs from storage. ``root`` is the run's URL or path.

    ``read_bytes`` and ``open_read`` open regular files only; with ``limit``, a file larger
    than ``limit`` bytes raises ``OversizedFileError`` before any of it is read. ``isdir``,
    ``exists`` and ``listdir`` see a symbolic link as what it is, not as its target.
    """

    root: str

    def url(self, path: str) -> str: ...
    def exists(self, path: str) -> bool: ...
    def isdir(self, path: str) -> bool: ...
    def listdir(self, path: str) -> list[str]: ...
    def size(self, path: str) -> int: ...
    def sizes(self, path: str) -> dict[str, int]:
        """The sizes of the regular files directly in the directory ``path``, from one listing
        (links, special files and directories are left out: ``size`` says what each is)."""
        ...
    def read_bytes(self, path: str, *, limit: int | None = None) -> bytes: ...
    def open_read(self, path: str) -> IO[bytes]: ...
    def write_bytes_atomic(self, path: str, data: bytes) -> None: ...
    def append_bytes(self, path: str, data: bytes, *, limit: int) -> None:
        """Add ``data`` at the end of the regular file ``path`` (made if missing). A link or
        special file there is refused (UnsafePathError); a file past ``limit`` bytes is not
        added to (OversizedFileError)."""
        ...
    def makedirs(self, path: str) -> None: ...
    def delete(self, path: str) -> None: ...
    def rename(self, src: str, dst: str) -> None: ...
    def put_file(self, local: str, path: str) -> None: ...
    def get_file(self, path: str, local: str) -> None: ...
    def sync_dir(self, path: str) -> None:
        """Make the entries of directory ``path`` durable (a no-op where writes are)."""
        ...
    def local_path(self, path: str) -> str | None: ...


def check_size(url: str, size: int, limit: int | None) -> None:
    """``OversizedFileError`` when ``size`` exceeds ``limit`` (None: no cap)."""
    if limit is not None and size > limit:
        raise OversizedFileError(f"{url}: size: expected at most {limit} bytes, actual {size} "
                                 "(not read)")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "a special file"


def _refuse_odd(fd: int, name: str, where: str, expected: str) -> None:
    """UnsafePathError if ``name`` (under ``fd``; ``where`` its URL) is a symbolic link, a FIFO,
    a device or a socket; else nothing (the caller raises its own error)."""
    try:
        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
    except OSError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise UnsafePathError(f"{where}: expected {expected}, actual {_kind(mode)} "
                              f"({'not followed' if stat.S_ISLNK(mode) else 'not read'})")


def _regular_size(where: str, st: os.stat_result) -> int:
    """The size of a regular file (``where`` its URL); IsADirectoryError for a directory
    (damage, like ENOENT), UnsafePathError for anything else."""
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "expected a regular file, actual a directory", where)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(f"{where}: expected a regular file, actual {_kind(st.st_mode)} (not read)")
    return st.st_size


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


class LocalStorage:
    """A local or parallel file system (POSIX semantics).

    Every path is walked from the root one directory at a time (``O_NOFOLLOW``, ``dir_fd``),
    so no symbolic link below the root is followed, whatever the component.
    """

    def __init__(self, root: str) -> None:
        root = root.removeprefix("file://")
        self.root = os.path.abspath(root)

    def url(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    def local_path(self, path: str) -> str | None:
        return self.url(path)

    # -- the walk: every component below the root, no symlink followed ----------------------

    def _parts(self, path: str) -> list[str]:
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise UnsafePathError(f"{self.url(path)}: expected a path inside the run, actual one "
                                  "with '..'")
        return parts

    def _open_parent(self, path: str, *, create: bool = False) -> tuple[int, str]:
        """(an fd of the directory holding ``path``'s last component, that component); the
        caller closes the fd. A symbolic link on the way raises UnsafePathError."""
        parts = self._parts(path)
        return self._open_dir(parts[:-1], create=create), (parts[-1] if parts else ".")

    def _open_dir(self, parts: list[str], *, create: bool = False) -> int:
        """An fd of the directory ``parts`` below the root (made with ``create``)."""
        if create:
            os.makedirs(self.root, exist_ok=True)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root may be a link
        for i, part in enumerate(parts):
            fd = self._descend(fd, part, "/".join(parts[: i + 1]), create)  # closes the parent's fd
        return fd

    def _descend(self, fd: int, part: str, prefix: str, create: bool) -> int:
        """The fd of directory ``part`` under ``fd``; ``fd`` is closed, whatever happens."""
        try:
            if create:
                try:
                    os.mkdir(part, dir_fd=fd)
                except FileExistsError:
                    pass
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                _refuse_odd(fd, part, self.url(prefix), "a directory")
            raise
        finally:
            os.close(fd)
        return child

    def _lstat(self, path: str) -> os.stat_result:
        """The entry at ``path`` itself (a link is a link); UnsafePathError for a link on the way."""
        if not self._parts(path):
            return os.stat(self.root)
        fd, name = self._open_parent(path)
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
        finally:
            os.close(fd)

    def _open_file(self, path: str, limit: int | None = None) -> int:
        """An fd of the regular file at ``path``, opened without blocking (a FIFO never waits)."""
        fd, name = self._open_parent(path)
        try:
            try:
                f = os.open(name, _FILE_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno != errno.ENOENT:  # ELOOP: a link; ENXIO: a socket
                    _refuse_odd(fd, name, self.url(path), "a regular file")
                raise
        finally:
            os.close(fd)
        try:
            check_size(self.url(path), _regular_size(self.url(path), os.fstat(f)), limit)
            os.set_blocking(f, True)
        except BaseException:
            os.close(f)
            raise
        return f

    # -- reading --------------------------------------------------------------------------

    def exists(self, path: str) -> bool:
        try:
            self._lstat(path)
        except (FileNotFoundError, NotADirectoryError, UnsafePathError):
            return False
        return True

    def isdir(self, path: str) -> bool:
        """A real directory (a symbolic link to one is not)."""
        try:
            return stat.S_ISDIR(self._lstat(path).st_mode)
        except (FileNotFoundError, NotADirectoryError, UnsafePathError):
            return False

    def listdir(self, path: str) -> list[str]:
        fd = self._open_dir(self._parts(path))
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)

    def size(self, path: str) -> int:
        """The size of the regular file at ``path`` (a link or special file is refused)."""
        return _regular_size(self.url(path), self._lstat(path))

    def sizes(self, path: str) -> dict[str, int]:
        fd = self._open_dir(self._parts(path))
        try:
            out = {}
            with os.scandir(fd) as entries:
                for entry in entries:
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        out[entry.name] = st.st_size
            return out
        finally:
            os.close(fd)

    def read_bytes(self, path: str, *, limit: int | None = None) -> bytes:
        fd = self._open_file(path, limit)
        with os.fdopen(fd, "rb") as f:
            data = f.read() if limit is None else f.read(limit + 1)
        check_size(self.url(path), len(data), limit)  # it grew after the fstat
        return data

    def open_read(self, path: str) -> IO[bytes]:
        # Unbuffered (readers bring their own large buffers), read-ahead widened.
        f = os.fdopen(self._open_file(path), "rb", buffering=0)
        try:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        return f  # type: ignore[return-value]

    # -- writing --------------------------------------------------------------------------

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        # The rename is the commit point: a reader sees the old file or the
        # whole new one, never a prefix. fsync file, then the directory, so
        # the rename survives a power loss. Parents are walked (and made) without
        # following a link: nothing is written through one.
        dfd, name = self._open_parent(path, create=True)
        try:
            tmp = f".tmp-{name}-{os.getpid()}-{os.urandom(4).hex()}"
            fd = os.open(tmp, _NEW_FILE_FLAGS | os.O_EXCL, 0o600, dir_fd=dfd)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                _unlink_quietly(tmp, dfd)
                raise
            _fsync_fd(dfd)
        finally:
            os.close(dfd)

    def append_bytes(self, path: str, data: bytes, *, limit: int) -> None:
        # POSIX append: one short write lands whole, even with another writer.
        dfd, name = self._open_parent(path, create=True)
        try:
            try:
                fd = os.open(name, _NEW_FILE_FLAGS | os.O_APPEND | os.O_NONBLOCK, 0o644, dir_fd=dfd)
            except OSError:
                _refuse_odd(dfd, name, self.url(path), "a regular file")
                raise
        finally:
            os.close(dfd)
        with os.fdopen(fd, "ab") as f:
            check_size(self.url(path), _regular_size(self.url(path), os.fstat(fd)), limit)
            f.write(data)

    def makedirs(self, path: str) -> None:
        os.close(self._open_dir(self._parts(path), create=True))

    def delete(self, path: str) -> None:
        """Remove the entry at ``path``: a directory with everything under it, a link as a link
        (never what it points to). Missing is fine."""
        try:
            dfd, name = self._open_parent(path)
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=dfd)  # fd-based: never follows a link inside
            else:
                os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        finally:
            os.close(dfd)

    def rename(self, src: str, dst: str) -> None:
        """Rename the entry itself (a link stays a link; its target is untouched)."""
        sfd, sname = self._open_parent(src)
        try:
            dfd, dname = self._open_parent(dst)
            try:
                os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
            finally:
                os.close(dfd)
        finally:
            os.close(sfd)

    def sync_dir(self, path: str) -> None:
        fsync_dir(self.url(path))

    def put_file(self, local: str, path: str) -> None:
        dfd, name = self._open_parent(path, create=True)
        try:
            fd = os.open(name, _NEW_FILE_FLAGS | os.O_TRUNC, 0o666, dir_fd=dfd)
        finally:
            os.close(dfd)
        with open(local, "rb") as src, os.fdopen(fd, "wb") as dst:
            shutil.copyfileobj(src, dst, CHUNK)

    def get_file(self, path: str, local: str) -> None:
        with self.open_read(path) as src, open(local, "wb") as dst:
            shutil.copyfileobj(src, dst, CHUNK)


def _unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def _fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError:
        pass


def fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
              FileExistsError, UnsafePathError)


# CredentialRetrievalError (an instance metadata endpoint throttling thousands of
# ranks) is transient and stays retried.
_CREDENTIAL_ERRORS = ("NoCredentialsError", "PartialCredentialsError", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken")


def is_credential_error(exc: BaseException) -> bool:
    return type(exc).__name__ in _CREDENTIAL_ERRORS or any(
        name in str(exc) for name in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "signature we calculated"))


def is_transient(exc: BaseException) -> bool:
    """Errors worth retrying: I/O and connection trouble, not "missing" or "denied"."""
    if isinstance(exc, _PERMANENT) or is_credential_error(exc):
        return False
    return isinstance(exc, (OSError, ConnectionError, TimeoutError))


class FsspecStorage:
    """Any fsspec file system (s3://, gs://, memory://, ...).

    Every primitive is retried on transient errors (``attempts`` tries with
    exponential backoff); ``sleep`` is injectable so tests do not sleep.
    """

    def __init__(self, root: str, *, attempts: int = 5, max_wait: float = 10.0,
                 sleep: Callable[[float], None] | None = None, fs=None) -> None:
        import fsspec

        if fs is None:
            fs, _ = fsspec.core.url_to_fs(root)
        self.fs = fs
        self.root = root.rstrip("/")
        retry_kwargs: dict = {
            "retry": tenacity.retry_if_exception(is_transient),
            "stop": tenacity.stop_after_attempt(attempts),
            # Jittered, so thousands of ranks throttled together do not retry in step.
            "wait": tenacity.wait_random_exponential(multiplier=0.2, max=max_wait),
            "reraise": True,
        }
        if sleep is not None:
            retry_kwargs["sleep"] = sleep
        self._retrying = tenacity.Retrying(**retry_kwargs)

    def _call(self, fn, *args, **kwargs):
        try:
            return self._retrying(fn, *args, **kwargs)
        except PermissionError as e:
            raise StorageAccessError(f"{self.root}: access: expected permission to {_verb(fn)}, actual "
                                     f"denied ({e})") from e
        except _PERMANENT:
            raise
        except Exception as e:
            if is_credential_error(e):
                raise StorageAccessError(
                    f"{self.root}: credentials: expected valid ones (environment, e.g. AWS_ACCESS_KEY_ID / "
                    f"AWS_SECRET_ACCESS_KEY, or fsspec's configuration), actual {type(e).__name__}: {e}") from e
            raise StorageError(f"{self.root}: storage operation {fn.__name__} failed after "
                               f"retries: {type(e).__name__}: {e}") from e

    def url(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def local_path(self, path: str) -> str | None:
        return None

    def exists(self, path: str) -> bool:
        return bool(self._call(self.fs.exists, self.url(path)))

    def isdir(self, path: str) -> bool:
        return bool(self._call(self.fs.isdir, self.url(path)))

    def listdir(self, path: str) -> list[str]:
        self.fs.invalidate_cache(self.url(path))
        try:
            entries = self._call(self.fs.ls, self.url(path), detail=False)
        except FileNotFoundError:
            # Object stores have no empty directories: a prefix with nothing under
            # it is an empty listing, unless the bucket itself is missing.
            bucket = self.root.split("://", 1)[-1].split("/", 1)[0]
            if "://" in self.root and not self._call(self.fs.exists, bucket):
                raise
            return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries})

    def size(self, path: str) -> int:
        return int(self._call(self.fs.size, self.url(path)))

    def sizes(self, path: str) -> dict[str, int]:
        self.fs.invalidate_cache(self.url(path))
        try:
            entries = self._call(self.fs.ls, self.url(path), detail=True)
        except FileNotFoundError:
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e["size"]) for e in entries
                if e.get("type") == "file" and e.get("size") is not None}

    def read_bytes(self, path: str, *, limit: int | None = None) -> bytes:
        """An object store has no links or FIFOs; with ``limit`` the size is checked first and
        no more than that size is fetched (a range past the end is an error on some servers)."""
        if limit is None:
            return self._call(self.fs.cat_file, self.url(path))
        size = self.size(path)
        check_size(self.url(path), size, limit)
        if size == 0:
            return self._call(self.fs.cat_file, self.url(path))
        return self._call(self.fs.cat_file, self.url(path), start=0, end=size)

    def open_read(self, path: str) -> IO[bytes]:
        return self._call(self.fs.open, self.url(path), "rb")

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        # One PUT: object stores make a single-object write atomic.
        self._call(self.fs.pipe_file, self.url(path), data)

    def append_bytes(self, path: str, data: bytes, *, limit: int) -> None:
        """An object cannot grow: it is read (at most ``limit`` bytes) and written again whole."""
        try:
            old = self.read_bytes(path, limit=limit)
        except FileNotFoundError:
            old = b""
        self.write_bytes_atomic(path, old + data)

    def makedirs(self, path: str) -> None:
        self._call(self.fs.makedirs, self.url(path), exist_ok=True)

    def delete(self, path: str) -> None:
        # The objects under the prefix (or the object itself), named one by one: a recursive
        # rm also names the "directory" key, which some S3-compatible servers fail on.
        target = self.url(path)
        self.fs.invalidate_cache(target)
        objects = self._call(self.fs.find, target)
        if objects:
            self._call(self.fs.rm, objects)

    def rename(self, src: str, dst: str) -> None:
        """Object stores have no rename: every object under ``src`` is copied, then removed
        (named one by one, as in ``delete``). FileNotFoundError when nothing is there."""
        source, target = self.url(src), self.url(dst)
        self.fs.invalidate_cache(source)
        objects = self._call(self.fs.find, source)
        if not objects:
            raise FileNotFoundError(source)
        prefix = self.fs._strip_protocol(source)
        for obj in objects:
            self._call(self.fs.copy, obj, target + obj[len(prefix):])
        self.delete(src)

    def sync_dir(self, path: str) -> None:
        pass  # an object store's PUT is durable when it returns

    def put_file(self, local: str, path: str) -> None:
        """Upload a local file in one request (multipart for large ones), retried as a whole."""
        self._call(self.fs.put_file, local, self.url(path))

    def get_file(self, path: str, local: str) -> None:
        """Download a whole file to ``local``, retried as a whole."""
        self._call(self.fs.get_file, self.url(path), local)


def _verb(fn: Callable) -> str:
    return getattr(fn, "__name__", "access").lstrip("_")


def open_storage(url: str) -> LocalStorage | FsspecStorage:
    """The storage for a run URL: POSIX fast path for local paths, fsspec otherwise."""
    if "://" not in url or url.startswith("file://"):
        return LocalStorage(url)
    protocol = url.split("://", 1)[0]
    try:
        return FsspecStorage(url)
    except ImportError as e:
        from fsspec.registry import known_implementations

        package = known_implementations.get(protocol, {}).get("class", "").split(".")[0] or "?"
        raise UsageError(f"{url}: run URL: protocol {protocol!r} expected its fsspec package installed, "
                         f"actual missing (pip install {package})") from e
    except ValueError as e:
        raise UsageError(f"{url}: run URL: expected a local path or a URL whose protocol fsspec knows "
                         f"(s3, gs, az, ...), actual {protocol!r} ({e})") from e
