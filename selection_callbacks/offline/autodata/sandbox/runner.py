"""The recipe sandbox: code recipes run in a fresh, kernel-confined interpreter.

:func:`run_code` starts ``python -I child.py`` (spawned, not forked: it holds none of this
process's state) with an environment of single-threaded BLAS settings only (``CHILD_ENV``), sends the
recipe source and the feature table on its stdin and reads its answer from stdout, capped at what a
list of the table's indices can take. After its imports the child can read the interpreter's files and nothing else; it cannot open
sockets, start processes or signal others, and cannot create, write, rename or delete files; its
memory, CPU seconds and wall-clock seconds are bounded by :class:`SandboxLimits`
(:mod:`guard` says how: rlimits, Landlock and seccomp). A recipe that breaks a rule fails
with a :class:`RecipeError` that starts with the rule's category: ``file system:``, ``network:``,
``process:``, ``memory:`` or ``time:``.

Where the kernel lacks Landlock or seccomp, code recipes are refused unless the user trusts them
(``--trust-recipe-code``); they then run with the limits and layers the kernel does have.

Example::

    code = "def select(table, n_tokens, budget, rng):\\n    return budget.take(range(len(n_tokens)), n_tokens)\\n"
    idx = run_code(code, "<recipe code>", table, Budget(docs=10), seed=0, limits=SandboxLimits(wall_seconds=30))
"""

from __future__ import annotations

import functools
import io
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from selection_callbacks.offline.autodata.capped import OutputTooLarge, run_capped
from selection_callbacks.offline.autodata.evaluation import FeatureTable, check_subset
from selection_callbacks.offline.autodata.sandbox import guard
from selection_callbacks.offline.autodata.sandbox.limits import SandboxLimits
from selection_callbacks.offline.autodata.schema import RecipeError
from selection_callbacks.offline.common.corpus import Budget

__all__ = ["MESSAGE_CHARS", "SandboxLimits", "missing_mechanisms", "run_code", "truncate"]

CHILD = Path(__file__).resolve().parent / "child.py"
CHILD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
MESSAGE_CHARS = 2000
N_TOKENS = "__n_tokens__"


@functools.lru_cache(maxsize=1)
def missing_mechanisms() -> tuple[str, ...]:
    """The kernel mechanisms the sandbox needs and this machine lacks (empty when it has them all)."""
    return tuple(guard.missing())


def truncate(message: str, limit: int = MESSAGE_CHARS) -> str:
    """``message`` cut to ``limit`` characters, saying how many were dropped."""
    return message if len(message) <= limit else f"{message[:limit]}… [{len(message) - limit} characters dropped]"


_last_table: list = [None, b""]  # the last table sent and its bytes (held, so its id stays unique)


def _table_bytes(table: FeatureTable) -> bytes:
    """The table as an uncompressed ``.npz`` (columns and ``__n_tokens__``), cached for the last table."""
    if _last_table[0] is not table:
        buffer = io.BytesIO()
        np.savez(buffer, **table.columns(), **{N_TOKENS: table.n_tokens})
        _last_table[:] = [table, buffer.getvalue()]
    return _last_table[1]


def _refuse_without_mechanisms(trust_code: bool) -> tuple[str, ...]:
    """The mechanisms to apply; a RecipeError when some are missing and the code is not trusted."""
    missing = missing_mechanisms()
    if missing and not trust_code:
        raise RecipeError(
            f"code recipes run only in the kernel sandbox, and this kernel lacks {' and '.join(missing)}; "
            "use a term recipe, or pass --trust-recipe-code to run code with your own rights")
    return tuple(m for m in guard.MECHANISMS if m not in missing)


def run_code(source: str, filename: str, table: FeatureTable, budget: Budget, seed: int, limits: SandboxLimits,
             trust_code: bool = False) -> np.ndarray:
    """The indices a code recipe's ``select(table, n_tokens, budget, rng)`` returns, run in the sandbox.

    Raises:
        RecipeError: the sandbox is unavailable (and ``trust_code`` is False), or the recipe broke a
            rule, raised, ran out of time, or returned something other than exactly the budget.
    """
    mechanisms = _refuse_without_mechanisms(trust_code)
    request = {"code": source, "filename": filename, "seed": seed, "mechanisms": mechanisms,
               "budget": {"tokens": budget.tokens, "docs": budget.docs}, "memory_mb": limits.memory_mb,
               "cpu_seconds": limits.cpu_seconds or limits.wall_seconds}
    payload = json.dumps(request).encode() + b"\n" + _table_bytes(table)
    try:
        done = run_capped([sys.executable, "-I", str(CHILD)], payload, limits.wall_seconds,
                          max_stdout=24 * len(table) + 4 * MESSAGE_CHARS, env=CHILD_ENV)
    except subprocess.TimeoutExpired as e:
        raise RecipeError(f"time: timed out after {limits.wall_seconds:g} s of wall-clock time") from e
    except OutputTooLarge as e:
        raise RecipeError(f"the recipe's answer is larger than a list of every document ({e})") from e
    idx = _reply(done.stdout, done.returncode, request["cpu_seconds"])
    check_subset(idx, table.n_tokens, budget)
    return idx.astype(np.int64)


def _reply(stdout: bytes, returncode: int, cpu_seconds: float) -> np.ndarray:
    """The indices of the child's answer, or the RecipeError it (or how it ended) describes."""
    if not stdout.strip():
        raise RecipeError(_death(returncode, cpu_seconds))
    try:
        reply = json.loads(stdout)
        kind, message = reply["kind"], truncate(str(reply.get("message")))
        if kind == "ok":
            return np.asarray(reply["indices"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise RecipeError(f"the recipe's process answered something other than the sandbox's reply ({e})") from e
    if kind == "unavailable":
        raise RecipeError(f"the sandbox could not confine the recipe ({message}); nothing ran")
    category = reply.get("category")
    raise RecipeError((f"{category}: the sandbox stopped the recipe: " if category else "raised ") + message)


def _death(returncode: int, cpu_seconds: float) -> str:
    """Why a child that gave no answer ended, by its exit status."""
    if returncode == -signal.SIGXCPU:
        return f"time: the recipe used its {cpu_seconds:g} s of CPU time (RLIMIT_CPU)"
    if returncode == -signal.SIGKILL:
        return "time or memory: the recipe's process was killed (the CPU hard limit or the out-of-memory killer)"
    if returncode == -signal.SIGXFSZ:
        return "file system: the recipe tried to grow a file (RLIMIT_FSIZE)"
    if returncode == -signal.SIGSYS:
        return "process: the recipe made a system call of another ABI (seccomp)"
    if returncode < 0:
        return f"the recipe's process died of signal {-returncode}"
    return f"the recipe's process died (exit code {returncode})"
