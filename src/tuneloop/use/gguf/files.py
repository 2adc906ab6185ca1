"""The export's two files, written so that nothing of the user's is lost and nothing torn is left.

Each is written under a hidden temporary name beside its final path (`.tmp-NAME-XXXX`, a name only an export
makes), fsynced, and renamed into place after both are complete; SIGTERM and SIGHUP during the write are turned
into an exception, so the temporaries go too. An export holds an OS lock on `.NAME.lock` beside the file
(WritingLock) from before it loads the model until its files are in place: a second export of the same file is
refused, and a temporary found while holding it is one whose writer is gone (a kill -9 leaves one, which the next
export of the same name removes) — never one still being written. An existing output is replaced only with --overwrite and only if tuneloop wrote it *and* nothing else
changed it since: the GGUF's `tuneloop.export` key records the file type, tensor count and tensor bytes it was
written with (llama-quantize copies every key, but not those numbers), and the Modelfile's first line holds the
hash of the rest (an edited Modelfile is the user's).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import signal
import tempfile
from pathlib import Path

from tuneloop import run_files
from tuneloop.errors import UserError

MARKER_KEY = "tuneloop.export"  # "VERSION file_type=N tensors=N bytes=N"
WRITTEN_BY = "# Written by tuneloop export"
TEMP_PREFIX = ".tmp-"


def modelfile_path(output: Path) -> Path:
    return output.with_suffix(".Modelfile")


def gguf_marker(version: str, file_type: int, tensors: int, tensor_bytes: int) -> str:
    return f"{version} file_type={file_type} tensors={tensors} bytes={tensor_bytes}"


def is_our_gguf(path: Path) -> bool:
    """The marker is there and the file still has the type, tensors and bytes it records."""
    try:
        import gguf

        reader = gguf.GGUFReader(path)
        recorded = dict(part.split("=", 1) for part in reader.fields[MARKER_KEY].contents().split()[1:])
        return (int(recorded["file_type"]) == int(reader.fields["general.file_type"].contents())
                and int(recorded["tensors"]) == len(reader.tensors)
                and int(recorded["bytes"]) == sum(int(tensor.n_bytes) for tensor in reader.tensors))
    except Exception:  # not a GGUF, a damaged one, one without (or with a foreign) marker: not ours to replace
        return False


def modelfile_text(body: str) -> str:
    """The Modelfile: its first line says who wrote it and the hash of what follows."""
    return f"{WRITTEN_BY} (sha256 {hashlib.sha256(body.encode()).hexdigest()[:16]} of the lines below)\n{body}"


def is_our_modelfile(path: Path) -> bool:
    try:
        first, _, body = path.read_text(encoding="utf-8").partition("\n")
    except (OSError, UnicodeDecodeError):
        return False
    return first == modelfile_text(body).partition("\n")[0]


def check_outputs(output: Path, overwrite: bool) -> None:
    """An existing output is replaced only with --overwrite, and only if it is unchanged since tuneloop wrote it."""
    for path, ours in ((output, is_our_gguf), (modelfile_path(output), is_our_modelfile)):
        if not path.exists() and not path.is_symlink():
            continue
        if not overwrite:
            raise UserError(f"export: {path} exists; add --overwrite to replace it (only a file tuneloop exported "
                            "is replaced), or choose another --output")
        if path.is_dir() or path.is_symlink() or not ours(path):
            raise UserError(f"export: {path} exists and is not a file tuneloop exported (or it changed since); "
                            "--overwrite never replaces another program's file: choose another --output, or move it "
                            "yourself")


def make_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"export: cannot make the folder {folder} ({error.strerror or error}); choose another "
                        "--output") from None


def stale_temporaries(output: Path) -> list[Path]:
    """The temporaries of the same names beside `output` (only an export makes `.tmp-NAME-XXXX` beside NAME): what
    a killed export left, once WritingLock is held."""
    names = (output.name, modelfile_path(output).name)
    return [path for name in names for path in output.parent.glob(f"{TEMP_PREFIX}{name}-*") if path.is_file()]


def lock_path(output: Path) -> Path:
    return output.with_name(f".{output.name}.lock")


class WritingLock:
    """`output` written by one export at a time: an OS lock (flock) on `.NAME.lock` beside it, held while the
    export's temporaries exist and released when it ends or its process dies. Its holder writes who it is into the
    file, for the message a second export gets, and removes the file while still holding it; a taker that opened
    the file just before then finds the locked file gone from the path and opens the new one."""

    def __init__(self, output: Path):
        self.output, self.path = output, lock_path(output)
        self.descriptor = None
        self.unguarded = False  # a file system that gives no locks: who else writes is not known

    @property
    def held(self) -> bool:
        return self.descriptor is not None

    def take(self) -> None:
        """Refused when another export holds it. Where the folder does not exist yet nothing is taken: called
        again once the export made it."""
        import fcntl

        if self.held or self.unguarded or not self.output.parent.is_dir():
            return
        while True:
            try:
                descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as error:
                raise UserError(f"export: cannot write in {self.output.parent} ({error.strerror or error}); nothing "
                                "was written: choose another --output") from None
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(descriptor)
                os.close(descriptor)
                who = (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('since', '?')}"
                       if holder else "a process that has not said who it is yet")
                raise UserError(f"export: another export is writing {self.output} ({who}); wait for it to end, or "
                                "choose another --output") from None
            except OSError:  # (no locks on this file system: the export goes on unguarded)
                if _holder(descriptor) == {}:
                    self.path.unlink(missing_ok=True)  # (the empty file just made: a lock file here locks nothing)
                os.close(descriptor)
                self.unguarded = True
                return
            if _same_file(descriptor, self.path):
                break
            os.close(descriptor)  # its holder removed it as we opened it: the one at the path now is the lock
        holder = _holder(descriptor)
        if holder is None:  # (what the lock file holds: nothing yet, or who held it)
            os.close(descriptor)
            raise UserError(f"export: {self.path} is not a lock file tuneloop export wrote; move it away, or "
                            "choose another --output")
        self.descriptor = descriptor
        import socket
        import time

        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                          "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)

    def release(self) -> None:
        if self.descriptor is not None:
            self.path.unlink(missing_ok=True)  # (before the lock goes: see the class)
            os.close(self.descriptor)
            self.descriptor = None


def _holder(descriptor: int) -> dict | None:
    """Who the lock file says holds it ({} for an empty file: one just made); None for a file that is no lock."""
    data = os.pread(descriptor, 4096, 0)
    if not data:
        return {}
    try:
        holder = json.loads(data)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) and "pid" in holder else None


def _same_file(descriptor: int, path: Path) -> bool:
    try:
        at_path = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(descriptor)
    return (opened.st_dev, opened.st_ino) == (at_path.st_dev, at_path.st_ino)


@contextlib.contextmanager
def interrupted_by_termination():
    """SIGTERM / SIGHUP raise SystemExit(128 + signal) during the export, so its temporaries and lock file are
    removed on the way out; the handlers before are restored after."""
    import threading

    def stop(number, frame):
        raise SystemExit(128 + number)

    if threading.current_thread() is not threading.main_thread():  # (only the main thread may set handlers)
        yield
        return
    previous = {number: signal.signal(number, stop) for number in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def write_temporary(path: Path, write) -> tuple[Path, object]:
    """(the complete, fsynced temporary beside `path`, what `write(temporary)` returned)."""
    temp = None
    try:
        handle, name = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{path.name}-", dir=path.parent)
        os.close(handle)
        temp = Path(name)
        result = write(temp)
        with open(temp, "rb") as written:
            os.fsync(written.fileno())
        mask = os.umask(0)
        os.umask(mask)
        temp.chmod(0o666 & ~mask)  # mkstemp's file is private; an exported model is for a server to read
        return temp, result
    except OSError as error:
        if temp is not None:
            temp.unlink(missing_ok=True)
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(f"export: the disk filled while writing {path}; nothing was written (free some space, "
                            "or choose another --output)") from None
        # numpy's tofile says a short write without an errno ("N requested and M written"): a full disk or a quota
        raise UserError(f"export: cannot write {path} ({error.strerror or error}); nothing was written (a full disk, "
                        "a file-size limit or a read-only folder? free some space, or choose another --output)"
                        ) from None
    except BaseException:
        if temp is not None:
            temp.unlink(missing_ok=True)
        raise


def publish(pairs: list[tuple[Path, Path]]) -> None:
    """Each (temporary, final path) renamed into place, in order; the folder's entries then on disk."""
    placed = []
    for temp, path in pairs:
        try:
            os.replace(temp, path)
        except OSError as error:
            done = f"; {', '.join(map(str, placed))} is in place" if placed else "; nothing was written"
            raise UserError(f"export: cannot put {path} in place ({error.strerror or error}){done}") from None
        placed.append(path)
    for folder in {path.parent for _, path in pairs}:
        run_files.fsync_folder_entry(folder)
