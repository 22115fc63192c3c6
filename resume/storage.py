"""Narrow storage interface over a run's root: a handful of primitives.

Paths are ``str`` relative to the root, joined with ``/`` (pathlib mangles
``s3://``). Local paths take a POSIX fast path (temp file + fsync + rename for
atomic writes); everything else goes through fsspec, with tenacity retries
around transient errors. Missing files raise ``FileNotFoundError`` untouched,
so callers can tell "not there" from "storage broken".
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import IO, Protocol

import tenacity

from .errors import StorageAccessError, StorageError, UsageError

__all__ = ["FsspecStorage", "LocalStorage", "Storage", "join", "open_storage"]

CHUNK = 8 << 20


def join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p not in ("", "."))


class Storage(Protocol):
    """What the core needs from storage. ``root`` is the run's URL or path."""

    root: str

    def url(self, path: str) -> str: ...
    def exists(self, path: str) -> bool: ...
    def isdir(self, path: str) -> bool: ...
    def listdir(self, path: str) -> list[str]: ...
    def size(self, path: str) -> int: ...
    def read_bytes(self, path: str) -> bytes: ...
    def open_read(self, path: str) -> IO[bytes]: ...
    def write_bytes_atomic(self, path: str, data: bytes) -> None: ...
    def makedirs(self, path: str) -> None: ...
    def delete(self, path: str) -> None: ...
    def rename(self, src: str, dst: str) -> None: ...
    def put_file(self, local: str, path: str) -> None: ...
    def get_file(self, path: str, local: str) -> None: ...
    def sync_dir(self, path: str) -> None:
        """Make the entries of directory ``path`` durable (a no-op where writes are)."""
        ...
    def local_path(self, path: str) -> str | None: ...


class LocalStorage:
    """A local or parallel file system (POSIX semantics)."""

    def __init__(self, root: str) -> None:
        root = root.removeprefix("file://")
        self.root = os.path.abspath(root)

    def url(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    def local_path(self, path: str) -> str | None:
        return self.url(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(self.url(path))

    def isdir(self, path: str) -> bool:
        return os.path.isdir(self.url(path))

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(self.url(path)))

    def size(self, path: str) -> int:
        return os.stat(self.url(path)).st_size

    def read_bytes(self, path: str) -> bytes:
        with open(self.url(path), "rb") as f:
            return f.read()

    def open_read(self, path: str) -> IO[bytes]:
        # Unbuffered (readers bring their own large buffers), read-ahead widened.
        f = open(self.url(path), "rb", buffering=0)  # noqa: SIM115 - the caller closes it
        try:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        return f  # type: ignore[return-value]

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        # The rename is the commit point: a reader sees the old file or the
        # whole new one, never a prefix. fsync file, then the directory, so
        # the rename survives a power loss.
        target = self.url(path)
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        fsync_dir(directory)

    def makedirs(self, path: str) -> None:
        os.makedirs(self.url(path), exist_ok=True)

    def delete(self, path: str) -> None:
        target = self.url(path)
        if os.path.isdir(target):
            shutil.rmtree(target)
        elif os.path.exists(target):
            os.unlink(target)

    def rename(self, src: str, dst: str) -> None:
        os.rename(self.url(src), self.url(dst))

    def sync_dir(self, path: str) -> None:
        fsync_dir(self.url(path))

    def put_file(self, local: str, path: str) -> None:
        target = self.url(path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(local, target)

    def get_file(self, path: str, local: str) -> None:
        shutil.copyfile(self.url(path), local)


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
              FileExistsError)


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

    def read_bytes(self, path: str) -> bytes:
        return self._call(self.fs.cat_file, self.url(path))

    def open_read(self, path: str) -> IO[bytes]:
        return self._call(self.fs.open, self.url(path), "rb")

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        # One PUT: object stores make a single-object write atomic.
        self._call(self.fs.pipe_file, self.url(path), data)

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
