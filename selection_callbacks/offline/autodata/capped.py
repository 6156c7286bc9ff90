"""Run a command with bounded output: stdin written, stdout read up to a cap, stderr kept up to a cap.

The agent proposer and the recipe sandbox read untrusted processes through :func:`run_capped`: an
answer larger than the cap ends the process at once (its process group is killed) instead of being
read into memory, and a wall-clock deadline bounds the whole exchange.

Example::

    done = run_capped(["cat"], b"hello", timeout=5.0, max_stdout=1 << 20)
    assert done.stdout == b"hello" and done.returncode == 0
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass

__all__ = ["Finished", "OutputTooLarge", "run_capped"]

CHUNK = 1 << 16


class OutputTooLarge(RuntimeError):
    """The command printed more than the cap on stdout (it has been killed).

    Attributes:
        stderr: what it had printed on stderr by then (up to its cap).
    """

    def __init__(self, message: str, stderr: bytes = b"") -> None:
        super().__init__(message)
        self.stderr = stderr


@dataclass(frozen=True)
class Finished:
    """A command that ran to its end.

    Attributes:
        returncode: its exit status (negative: the signal that ended it).
        stdout: everything it printed (at most the cap).
        stderr: the first ``max_stderr`` bytes of its stderr.
    """

    returncode: int
    stdout: bytes
    stderr: bytes


def run_capped(args: str | list[str], stdin: bytes, timeout: float, max_stdout: int, max_stderr: int = 1 << 16,
               **popen) -> Finished:
    """Run ``args`` (``popen``: more :class:`subprocess.Popen` arguments) in its own process group.

    Raises:
        subprocess.TimeoutExpired: it did not finish within ``timeout`` seconds (it has been killed).
        OutputTooLarge: it printed more than ``max_stdout`` bytes on stdout.
    """
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, **popen)
    deadline = time.monotonic() + timeout
    try:
        out, err = _exchange(proc, stdin, deadline, max_stdout, max_stderr)
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return Finished(proc.returncode, out, err)
    except subprocess.TimeoutExpired as e:
        raise subprocess.TimeoutExpired(args, timeout) from e
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group outlives its leader when a child holds the pipe
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()


def _exchange(proc: subprocess.Popen, data: bytes, deadline: float, max_stdout: int,
              max_stderr: int) -> tuple[bytes, bytes]:
    """Write ``data`` to stdin while reading stdout and stderr, until both close or the deadline."""
    sel = selectors.DefaultSelector()
    out, err, view, sent = bytearray(), bytearray(), memoryview(data), 0
    os.set_blocking(proc.stdin.fileno(), False)
    if data:
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired(proc.args, 0)
        for key, _ in sel.select(left):
            if key.fileobj is proc.stdin:
                try:
                    sent += os.write(key.fd, view[sent:sent + CHUNK])
                except BrokenPipeError:
                    sent = len(data)
                if sent >= len(data):
                    sel.unregister(proc.stdin)
                    proc.stdin.close()
                continue
            chunk = os.read(key.fd, CHUNK)
            if not chunk:
                sel.unregister(key.fileobj)
            elif key.data is out:
                out += chunk
                if len(out) > max_stdout:
                    raise OutputTooLarge(f"more than {max_stdout} bytes on stdout", bytes(err))
            else:
                err += chunk[: max(0, max_stderr - len(err))]
    return bytes(out), bytes(err)
