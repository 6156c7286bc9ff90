"""Kernel confinement of the calling process: resource limits, no capabilities, Landlock and seccomp.

The sandbox child (:mod:`child`) imports this module by path, with the standard library
only, and calls :func:`confine` after its own imports and before it runs a recipe. Each layer is a
kernel mechanism, so nothing the recipe does in Python (ctypes included) lifts it:

- rlimits: address space (``RLIMIT_AS``), CPU seconds (``RLIMIT_CPU``: SIGXCPU, then SIGKILL one
  second later), no core files, no file growth, few open files;
- capabilities: the permitted, effective and inheritable sets are emptied (root loses its
  overrides), and ``no_new_privs`` is set;
- Landlock: every file-system right the kernel's ABI knows is handled, and only reading files and
  listing folders beneath ``readable`` is allowed, so the process cannot create, write, truncate,
  rename or delete anything; from ABI 4 TCP bind/connect are denied, from ABI 6 signals and
  abstract unix sockets outside the sandbox;
- seccomp (a deny list, all threads): sockets fail with ENONET; fork, vfork, clone without
  CLONE_THREAD, exec, signals, ptrace, rlimit changes, priority and memory-placement changes (which
  may name other processes), namespaces, mounts, io_uring, bpf and other privileged calls fail
  with EPERM; clone3 with ENOSYS (threads fall back to clone); metadata
  writes (chmod, chown, xattrs, times, truncate) with EACCES; a foreign syscall ABI kills the process.

The errno tells the child which category a denied action belongs to (:data:`CATEGORY_OF_ERRNO`).

Example::

    import guard
    guard.confine(guard.interpreter_paths(), memory_bytes=1 << 30, cpu_seconds=10,
                          mechanisms=("landlock", "seccomp"))
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import platform
import resource
import struct
import sys
import time

__all__ = ["CATEGORY_OF_ERRNO", "MECHANISMS", "confine", "interpreter_paths", "landlock_abi", "missing"]

MECHANISMS = ("landlock", "seccomp")
NR = {"capset": 126, "seccomp": 317, "landlock_create_ruleset": 444, "landlock_add_rule": 445,
      "landlock_restrict_self": 446}
CATEGORY_OF_ERRNO = {errno.ENONET: "network", errno.EPERM: "process", errno.EACCES: "file system",
                     errno.EXDEV: "file system", errno.EROFS: "file system", errno.ENOMEM: "memory"}

NETWORK_CALLS = (41, 42, 43, 49, 50, 53, 288)  # socket connect accept bind listen socketpair accept4
PROCESS_CALLS = (
    57, 58, 59, 322, 62, 200, 234, 129, 297, 424, 434, 438,  # fork vfork execve(at) kill tkill tgkill sigqueue pidfd
    101, 310, 311, 160, 302, 272, 308, 165, 166, 155, 161,  # ptrace process_vm setrlimit prlimit unshare setns mounts
    321, 298, 323, 425, 426, 427, 248, 249, 250, 135, 172, 173,  # bpf perf userfaultfd io_uring keys personality io
    169, 246, 320, 175, 313, 176, 167, 168, 170, 171, 164, 227,  # reboot kexec modules swap hostname clocks
    159, 305, 163, 303, 304, 300, 428, 429, 430, 431, 432, 433, 442, 179, 319,  # adjtime acct handles fanotify fs
    141, 142, 144, 203, 251, 314, 256, 279, 312, 440, 448,  # priorities, affinity, pages, kcmp of other processes
)
FILE_CALLS = (90, 91, 92, 93, 94, 268, 452, 260, 188, 189, 190, 197, 198, 199, 463, 466, 469,  # chmod chown xattr
              132, 235, 261, 280, 76, 77, 285)  # utime(s) futimesat utimensat truncate ftruncate fallocate
CLONE, CLONE3, CLONE_THREAD = 56, 435, 0x10000
AUDIT_ARCH_X86_64, X32_SYSCALL_BIT = 0xC000003E, 0x40000000
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
LD_ABS_W, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
READ_FILE, READ_DIR = 1 << 2, 1 << 3
FS_RIGHTS_BY_ABI = ((5, (1 << 16) - 1), (3, (1 << 15) - 1), (2, (1 << 14) - 1), (1, (1 << 13) - 1))

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _syscall(name: str, *args) -> int:
    """``syscall(NR[name], *args)``; an OSError naming the call when it fails."""
    result = _libc.syscall(ctypes.c_long(NR[name]), *args)
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{name}: {os.strerror(code)}")
    return result


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0 when Landlock is absent or disabled)."""
    if platform.machine() != "x86_64":
        return 0
    return max(int(_libc.syscall(ctypes.c_long(NR["landlock_create_ruleset"]), None, ctypes.c_size_t(0), 1)), 0)


def missing() -> list[str]:
    """The MECHANISMS this kernel (or this machine's syscall ABI) cannot provide."""
    gaps = [] if landlock_abi() >= 1 else ["landlock"]
    if platform.machine() != "x86_64":
        return gaps + ["seccomp"]
    # seccomp(SET_MODE_FILTER, 0, NULL) fails with EFAULT exactly when filters are supported
    probe = _libc.syscall(ctypes.c_long(NR["seccomp"]), 1, 0, None)
    if probe != -1 or ctypes.get_errno() != errno.EFAULT:
        gaps.append("seccomp")
    return gaps


def interpreter_paths() -> list[str]:
    """Folders holding the interpreter, its libraries and the shared objects this process has mapped."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable))}
    with open("/proc/self/maps") as maps:
        paths |= {os.path.dirname(line.split()[-1]) for line in maps if ".so" in line.split()[-1]}
    real = {os.path.realpath(p) for p in paths if os.path.isdir(p)}
    return sorted(real | {p for p in paths if os.path.isdir(p)})


def limit_resources(memory_bytes: int, cpu_seconds: float, open_files: int = 64) -> None:
    """Address space = what the process maps now + ``memory_bytes``; CPU = used + ``cpu_seconds``."""
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + memory_bytes, mapped + memory_bytes))
    cpu = math.ceil(time.process_time() + cpu_seconds)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))


def drop_privileges() -> None:
    """Empty the capability sets (x86_64: the system-call numbers here are its) and set no_new_privs
    (needed by Landlock and seccomp without root)."""
    if platform.machine() == "x86_64":
        header = struct.pack("=Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        _syscall("capset", ctypes.create_string_buffer(header, 8), ctypes.create_string_buffer(24))
    if _libc.prctl(38, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")


def restrict_files(readable: list[str]) -> None:
    """Landlock: read-only beneath ``readable``, nothing else (TCP and signal scopes where the ABI has them).

    Raises:
        OSError: Landlock is unavailable, or the process has more than one thread (Landlock binds
            the calling thread only).
    """
    abi = landlock_abi()
    if abi < 1:
        raise OSError(errno.ENOSYS, "Landlock is not available in this kernel")
    if len(os.listdir("/proc/self/task")) != 1:
        raise OSError(errno.EBUSY, "Landlock needs a single-threaded process; set OPENBLAS_NUM_THREADS=1")
    fs = next(rights for version, rights in FS_RIGHTS_BY_ABI if abi >= version)
    attr = struct.pack("=QQQ", fs, 0b11 if abi >= 4 else 0, 0b11 if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = _syscall("landlock_create_ruleset", ctypes.create_string_buffer(attr[:size], size),
                       ctypes.c_size_t(size), 0)
    try:
        for path in readable:
            rights = READ_FILE | READ_DIR if os.path.isdir(path) else READ_FILE
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = struct.pack("=Qi", rights, fd)
                _syscall("landlock_add_rule", ruleset, 1, ctypes.create_string_buffer(rule, 12), 0)
            finally:
                os.close(fd)
        _syscall("landlock_restrict_self", ruleset, 0)
    finally:
        os.close(ruleset)


def _filter() -> bytes:
    """The seccomp BPF program (see the module docstring)."""
    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    prog = [op(LD_ABS_W, 4), op(JEQ, AUDIT_ARCH_X86_64, 1, 0), op(RET, RET_KILL_PROCESS),
            op(LD_ABS_W, 0), op(JGE, X32_SYSCALL_BIT, 0, 1), op(RET, RET_KILL_PROCESS)]
    denied = [(nr, errno.ENONET) for nr in NETWORK_CALLS] + [(nr, errno.EPERM) for nr in PROCESS_CALLS]
    denied += [(nr, errno.EACCES) for nr in FILE_CALLS] + [(CLONE3, errno.ENOSYS)]
    for nr, code in denied:
        prog += [op(JEQ, nr, 0, 1), op(RET, RET_ERRNO | code)]
    prog += [op(JEQ, CLONE, 0, 3), op(LD_ABS_W, 16), op(JSET, CLONE_THREAD, 1, 0),
             op(RET, RET_ERRNO | errno.EPERM), op(RET, RET_ALLOW)]
    return b"".join(prog)


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def restrict_calls() -> None:
    """Install the seccomp filter on every thread of the process (SECCOMP_FILTER_FLAG_TSYNC)."""
    code = _filter()
    buffer = ctypes.create_string_buffer(code, len(code))
    program = _Program(len(code) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    _syscall("seccomp", 1, 1, ctypes.byref(program))


def confine(readable: list[str], memory_bytes: int, cpu_seconds: float,
            mechanisms: tuple[str, ...] = MECHANISMS) -> None:
    """Apply every layer: rlimits, no privileges, then the kernel ``mechanisms`` asked for.

    Args:
        readable: folders (or files) the process may still read.
        memory_bytes: address space the process may add to what it maps now.
        cpu_seconds: CPU seconds the process may still use.
        mechanisms: a subset of MECHANISMS (all of them unless the user trusts the code).

    Raises:
        OSError: a layer could not be applied (the caller must not run the recipe then).
    """
    limit_resources(memory_bytes, cpu_seconds)
    drop_privileges()
    if "landlock" in mechanisms:
        restrict_files(readable)
    if "seccomp" in mechanisms:
        restrict_calls()
