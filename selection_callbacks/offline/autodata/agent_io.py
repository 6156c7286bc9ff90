"""The agent proposer's exchange with its command: a size-capped answer, validated before anything runs.

:func:`run_agent` runs the command with the search state on stdin and returns its stdout, at most
``max_bytes`` of it (a longer answer kills the command); its stderr goes to a log for the user.
:func:`parse_recipe` turns the answer into a recipe object and refuses one that names a ``program``
file (an agent gives inline ``code``, which runs in the sandbox).

Example::

    answer = run_agent("python agent.py", b'{"trial": 0}', timeout=60.0, max_bytes=1 << 20)
    recipe = parse_recipe(answer)
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from selection_callbacks.offline.autodata.capped import OutputTooLarge, run_capped

__all__ = ["ProposalError", "parse_recipe", "run_agent"]


class ProposalError(RuntimeError):
    """A proposer could not produce a recipe (agent command failed, printed no JSON, timed out)."""


def run_agent(command: str, state: bytes, timeout: float, max_bytes: int, stderr_log: Path | None = None,
              label: str = "") -> bytes:
    """The stdout of shell ``command`` run with ``state`` on stdin; its stderr appended to ``stderr_log``.

    Raises:
        ProposalError: it timed out, printed more than ``max_bytes`` or exited with an error.
    """
    try:
        done = run_capped(command, state, timeout, max_bytes, shell=True)
    except subprocess.TimeoutExpired as e:
        raise ProposalError(f"agent command timed out after {timeout:g} s") from e
    except OutputTooLarge as e:
        _keep(stderr_log, f"{label}: stopped, {e}", e.stderr)
        raise ProposalError(f"agent printed {e}, more than a recipe may take (agent_max_bytes = {max_bytes}); "
                            "print one JSON recipe") from e
    stderr = _keep(stderr_log, f"{label}: exit {done.returncode}", done.stderr)
    if done.returncode != 0:
        raise ProposalError(f"agent command exited with {done.returncode}: {stderr.strip()[-500:]}")
    return done.stdout


def _keep(stderr_log: Path | None, header: str, stderr: bytes) -> str:
    """Append a header and ``stderr`` to the log (when there is one and stderr is not empty); the text."""
    text = stderr.decode(errors="replace")
    if stderr_log is not None and text:
        with stderr_log.open("a") as log:
            log.write(f"--- {header}\n{text}\n")
    return text


def parse_recipe(answer: bytes) -> dict:
    """The recipe object an agent printed (not yet validated against the schema).

    Raises:
        ProposalError: the answer is not one JSON object, or it names a ``program`` file.
    """
    try:
        recipe = json.loads(answer)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProposalError(f"agent printed no JSON recipe ({e}): {answer.strip()[:300]!r}") from e
    if not isinstance(recipe, dict):
        raise ProposalError(f"agent printed {type(recipe).__name__}, not a recipe object")
    if "program" in recipe:
        raise ProposalError("an agent may not name a program file; give the recipe's source inline as \"code\"")
    return recipe
