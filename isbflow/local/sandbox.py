"""Hiding one folder from this process and every process it starts, with Linux Landlock.

:func:`hide` makes the files under a folder (the embedded ISB service's ``<data dir>/nats/``:
the admin's and every role's password, the users block, the JetStream store) unreadable and
unwritable by this process and by everything it starts afterwards (a Spark driver's JVM, its
Python workers), and nothing else changes for them. It cannot be undone: call it in a process of
its own (``isbflow pipeline run``), once its own credentials are in memory.

Landlock has no rule that denies: a process restricts itself to what its rules grant. So the
rights :data:`HIDDEN` names are granted beneath every *sibling* of every folder on the way from
``/`` to the hidden folder (files directly in those folders get them too), and not on those
folders themselves. Consequences:

- the hidden folder's files cannot be opened for reading or writing, truncated, removed,
  renamed, linked elsewhere or replaced, and nothing can be created in it; folders are still
  listed and their entries stat'ed everywhere (names are not secret), programs run as before;
- an entry made *after* the restriction directly in one of those folders (say a new
  ``<data dir>/tables``) gets none of these rights: the caller names in ``keep`` every folder
  it will use, and the first folder of each below one of those folders is made beforehand;
- when the system's temporary folder is one of those folders (a data dir under ``/tmp``), a
  private temporary folder is made in it first and becomes this process's ``TMPDIR``
  (:attr:`Hidden.temp`, removed at exit; a JVM started later needs ``-Djava.io.tmpdir`` too);
- with Landlock ABI 6 (Linux 6.12), signals to processes outside the restriction (the ISB
  service, other drivers) are refused; with any version, so is ``ptrace`` and
  ``/proc/<pid>/environ`` of such processes.

Where the kernel has no Landlock (before Linux 5.19, which brought ABI 2; or disabled), a
warning is logged once and nothing is restricted. ``ISBFLOW_SANDBOX=off`` turns it off.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: the environment variable that turns :func:`hide` off (``off``)
ENV = "ISBFLOW_SANDBOX"

# linux/landlock.h; the system calls have the same numbers on every architecture
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
WRITE_FILE, READ_FILE, REMOVE_FILE = 1 << 1, 1 << 2, 1 << 5
MAKE_CHAR, MAKE_DIR, MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = (1 << n for n in range(6, 13))
REFER, TRUNCATE = 1 << 13, 1 << 14
SCOPE_SIGNAL = 1 << 1
#: the rights taken away under the hidden folder (by ABI: TRUNCATE from 3), granted everywhere else.
#: Executing, listing folders and removing empty ones are not restricted
HIDDEN = (READ_FILE | WRITE_FILE | REMOVE_FILE | MAKE_CHAR | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO
          | MAKE_BLOCK | MAKE_SYM | REFER | TRUNCATE)
#: the rights that apply to a file (the others are a folder's)
FILE_RIGHTS = READ_FILE | WRITE_FILE | TRUNCATE
#: the first ABI used: with ABI 1, moving a file between folders is refused whatever the rules
MIN_ABI = 2


class SandboxError(Exception):
    """The restriction could not be applied; the message says why and how to turn it off."""


@dataclass(frozen=True)
class Hidden:
    """What :func:`hide` did: the folder hidden, the Landlock ABI used, and the private temporary
    folder this process now uses (None: the system's, which is not above the hidden folder)."""

    folder: Path
    abi: int
    temp: Path | None = None


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_warned = False


def _syscall(*args) -> int:
    r = _libc.syscall(*args)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return r


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: no Landlock, or it is disabled)."""
    try:
        return _syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except OSError as e:
        if e.errno in (errno.ENOSYS, errno.EOPNOTSUPP):
            return 0
        raise


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning(message)


def _chain(folder: Path) -> list[Path]:
    """The folders from ``/`` down to ``folder``'s parent."""
    return list(reversed(folder.parents))


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _make_first_below(path: Path, chain: list[Path], folder: Path) -> None:
    """Make the folder below the deepest of ``chain`` that ``path`` goes through, unless it exists or is
    on the way to ``folder`` (mode 0700)."""
    path = _real(path)
    if path == folder or folder in path.parents:
        return
    on_way = set(chain) | {folder}
    for p in [path, *path.parents]:
        if p.parent in on_way and p not in on_way:
            try:
                p.mkdir(mode=0o700)
            except FileExistsError:
                pass
            return


def _private_temp(chain: list[Path]) -> Path | None:
    """A private temporary folder, now this process's ``TMPDIR``, when the system's is on ``chain``."""
    system = _real(Path(tempfile.gettempdir()))
    if system not in chain:
        return None
    temp = Path(tempfile.mkdtemp(prefix="isbflow-", dir=system))  # 0700
    os.environ["TMPDIR"] = str(temp)
    tempfile.tempdir = str(temp)
    atexit.register(shutil.rmtree, temp, True)
    return temp


def _add(ruleset: int, path: Path, access: int, follow: bool = False) -> None:
    """Grant ``access`` beneath ``path`` (its file rights only, for a file); a path gone or a symlink is skipped."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if stat.S_ISLNK(st.st_mode):
            return
        if not stat.S_ISDIR(st.st_mode):
            access &= FILE_RIGHTS
        attr = _PathBeneathAttr(access, fd)
        _syscall(_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH), ctypes.byref(attr),
                 ctypes.c_uint32(0))
    finally:
        os.close(fd)


def hide(folder: str | os.PathLike, *, keep: Iterable[str | os.PathLike] = (),
         readable: Iterable[str | os.PathLike] = ()) -> Hidden | None:
    """Restrict this process and what it starts from then on (module docstring): nothing under
    ``folder`` can be read, written, removed, moved or created, except the files (or folders)
    ``readable`` names under it, which can be read. ``keep``: folders this process will use,
    made beforehand where they would be out of reach (module docstring).

    Returns what it did, or None: ``ISBFLOW_SANDBOX=off``, ``folder`` does not exist, or the
    kernel has no Landlock (a warning is logged once). :class:`SandboxError` when the kernel
    refuses the restriction for another reason."""
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "false", "no"):
        return None
    folder = _real(Path(folder))
    if not folder.is_dir() or folder == folder.parent:
        return None
    abi = landlock_abi()
    if abi < MIN_ABI:
        _warn_once(f"the kernel has no Landlock (ABI 2, Linux 5.19 or later): user code in this process can read "
                   f"the ISB service's passwords under {folder}; run drivers on such a kernel, or as an OS "
                   f"user that cannot read {folder} ({ENV}=off silences this)")
        return None
    handled = HIDDEN if abi >= 3 else HIDDEN & ~TRUNCATE
    chain = _chain(folder)
    for path in keep:
        _make_first_below(Path(path), chain, folder)
    temp = _private_temp(chain)
    attr = _RulesetAttr(handled, 0, SCOPE_SIGNAL if abi >= 6 else 0)
    try:
        ruleset = _syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
                           ctypes.c_uint32(0))
    except OSError as e:
        raise SandboxError(f"Landlock refused a ruleset ({e}); {ENV}=off runs without it") from None
    try:
        on_way = [*chain[1:], folder]
        for parent, next_one in zip(chain, on_way, strict=True):
            with os.scandir(parent) as entries:
                for entry in entries:
                    if entry.name != next_one.name:
                        _add(ruleset, Path(entry.path), handled)
        for path in readable:
            p = _real(Path(path))
            if folder in p.parents:
                _add(ruleset, p, READ_FILE, follow=True)
        if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        _syscall(_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
    except OSError as e:
        raise SandboxError(f"could not hide {folder} with Landlock ({e}); {ENV}=off runs without it") from None
    finally:
        os.close(ruleset)
    return Hidden(folder, abi, temp)


def forget_env(names: Iterable[str]) -> list[str]:
    """Take the variables ``names`` out of this process's environment, and their values out of the
    block ``/proc/<pid>/environ`` shows (the environment the process started with, which any
    process of the same user can read, a restricted one too); the names it found. Processes
    started afterwards do not get them. Call it once their values are read."""
    found = [n for n in names if n in os.environ]
    for name in found:
        del os.environ[name]
    if not found:
        return found
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (fields 50 and 51)
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            block = bytearray(mem.read(end - start))
            offset = 0
            for entry in bytes(block).split(b"\0"):
                name, sep, value = entry.partition(b"=")
                if sep and name.decode(errors="replace") in found:
                    at = offset + len(name) + 1
                    block[at:at + len(value)] = b"\0" * len(value)
                offset += len(entry) + 1
            mem.seek(start)
            mem.write(bytes(block))
    except (OSError, ValueError, IndexError) as e:
        log.warning("could not clear %s from this process's start environment (%s): processes of the same "
                    "user can read them in /proc/%d/environ", ", ".join(found), e, os.getpid())
    return found
