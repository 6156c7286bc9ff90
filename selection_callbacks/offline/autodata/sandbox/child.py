"""The sandbox child: runs one code recipe confined by the kernel and answers with its indices.

Started as ``python -I child.py`` with an empty environment (but single-threaded BLAS) by
:mod:`selection_callbacks.offline.autodata.sandbox.runner`, which writes the request on stdin: one JSON
line (``code``, ``filename``, ``seed``, ``budget``, ``memory_mb``, ``cpu_seconds``,
``mechanisms``) and then the feature table as an ``.npz`` (no pickles). The child imports what it
needs, confines itself with :func:`guard.confine` (read-only interpreter files, nothing
else), runs ``select(table, n_tokens, budget, rng)`` and writes one JSON line on its original stdout::

    {"kind": "ok", "indices": [...]}
    {"kind": "error", "category": "network" | "process" | "file system" | "memory" | null, "message": ...}
    {"kind": "unavailable", "message": ...}       # a layer could not be applied; nothing ran

The recipe's own prints go to /dev/null. Error messages name the exception and the frames
(file, line, function) without source lines, at most TRACE_CHARS characters.

Example (what the parent does)::

    printf '%s\\n' '{"code": "...", ...}' | cat - table.npz | env -i python -I child.py
"""

import io
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import guard  # noqa: E402
import numpy as np  # noqa: E402 - imported before the sandbox closes the file system

del sys.path[0]  # recipes import from the interpreter's folders only

N_TOKENS = "__n_tokens__"
SEED_SALT = 0xA07D
TRACE_CHARS = 1500


class Budget:
    """The search's budget as recipes see it: ``docs`` documents or at least ``tokens`` tokens.

    Attributes:
        tokens: token budget B (or None).
        docs: document budget N (or None).
    """

    def __init__(self, tokens: int | None = None, docs: int | None = None) -> None:
        self.tokens, self.docs = tokens, docs

    def take(self, order, n_tokens: np.ndarray) -> np.ndarray:
        """The shortest prefix of ``order`` that meets the budget (ValueError when none does)."""
        order = np.asarray(order, dtype=np.int64)
        cum = np.cumsum(n_tokens[order])
        need = self.docs if self.docs is not None else int(np.searchsorted(cum, self.tokens)) + 1
        if need > order.size:
            raise ValueError(f"{order.size} documents cannot meet a budget of {self.describe()}")
        return order[:need]

    def describe(self) -> str:
        return f"{self.docs} documents" if self.docs is not None else f"{self.tokens} tokens"


def category(error: BaseException) -> str | None:
    """The sandbox rule an exception (or one it was raised from) ran into, by its errno; None if none."""
    seen = error
    while seen is not None:
        if isinstance(seen, MemoryError):
            return "memory"
        if isinstance(seen, OSError) and seen.errno in guard.CATEGORY_OF_ERRNO:
            return guard.CATEGORY_OF_ERRNO[seen.errno]
        seen = seen.__cause__ or seen.__context__
    return None


def describe(error: BaseException) -> str:
    """``Type: message`` and the innermost frames as ``file:line in function``, no source lines."""
    frames = [f"{frame.f_code.co_filename}:{line} in {frame.f_code.co_name}"
              for frame, line in traceback.walk_tb(error.__traceback__)]
    text = f"{type(error).__name__}: {error}" + "".join(f"\n  at {frame}" for frame in frames[-4:])
    return text[:TRACE_CHARS]


def run(request: dict, columns: dict, n_tokens: np.ndarray) -> list:
    """The recipe's answer as a list (what :func:`json.dumps` can write)."""
    scope = {"__name__": "autodata_recipe"}
    exec(compile(request["code"], request["filename"], "exec"), scope)
    if not callable(scope.get("select")):
        raise ValueError("the program defines no select(table, n_tokens, budget, rng)")
    rng = np.random.default_rng([request["seed"], SEED_SALT])
    out = np.asarray(scope["select"](columns, n_tokens.copy(), Budget(**request["budget"]), rng))
    if out.dtype.kind not in "iu":
        raise TypeError(f"a recipe must return document indices, got an array of {out.dtype}")
    return out.tolist()


def main() -> None:
    """Read the request, confine this process, run the recipe, answer on the original stdout."""
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    request = json.loads(sys.stdin.buffer.readline())
    with np.load(io.BytesIO(sys.stdin.buffer.read()), allow_pickle=False) as z:
        columns = {name: z[name] for name in z.files}
    n_tokens = columns.pop(N_TOKENS)
    try:
        guard.confine(guard.interpreter_paths(), request["memory_mb"] << 20,
                              request["cpu_seconds"], tuple(request["mechanisms"]))
    except OSError as e:
        reply = {"kind": "unavailable", "message": str(e)}
    else:
        try:
            reply = {"kind": "ok", "indices": run(request, columns, n_tokens)}
        except BaseException as e:  # noqa: BLE001 - everything a recipe raises is a failed trial
            reply = {"kind": "error", "category": category(e), "message": describe(e)}
    answer.write(json.dumps(reply) + "\n")
    answer.flush()


if __name__ == "__main__":
    main()
