"""The recipe sandbox: code recipes that try to leave it are stopped with a RecipeError naming the
rule, with no effect, while well-behaved recipes in the same search succeed; the sandbox reproduces
the in-process term recipe; it is refused where the kernel lacks it unless trusted; the agent's
answer is size-capped and may not name a program file."""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from selection_callbacks.offline.autodata.evaluation import apply_recipe_inline, feature_table, run_recipe
from selection_callbacks.offline.autodata.proposers import AgentProposer
from selection_callbacks.offline.autodata.sandbox import runner as sandbox
from selection_callbacks.offline.autodata.sandbox.limits import SandboxLimits
from selection_callbacks.offline.autodata.schema import RecipeError, load_recipe, validate_recipe
from selection_callbacks.offline.autodata.search import Search, TrialStore, build_parser
from selection_callbacks.offline.common.corpus import Budget
from selection_callbacks.offline.common.features import feature_bank
from tests.offline.test_autodata import GOOD, TINY_SEARCH, Scripted, budget_of, corpora  # noqa: F401 - corpora: fixture
from tests.offline.test_offline_features import TINY_BANK

SECRET = "sandbox-secret-4711"
SELECT = "def select(table, n_tokens, budget, rng):\n"
GOOD_CODE = {"name": "good code", "code": "import numpy as np\n" + SELECT +
             "    return budget.take(np.argsort(-table['dsir'], kind='stable'), n_tokens)\n"}


def attacks(folder, port: int) -> dict[str, tuple[str, str]]:
    """name → (the body of select that tries one thing, the error the search must record)."""
    return {
        "environment": (f"    return os.environ[{'SANDBOX_SECRET'!r}]\n", "raised KeyError: 'SANDBOX_SECRET'"),
        "tcp socket": (f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n", "network:"),
        "write": ("    open('written.txt', 'w').write('x')\n", "file system:"),
        "delete": (f"    os.remove({str(folder / 'victim.txt')!r})\n", "file system:"),
        "subprocess": (f"    subprocess.run(['touch', {str(folder / 'spawned')!r}])\n", "process:"),
        "fork": (f"    if os.fork() == 0:\n        open({str(folder / 'forked')!r}, 'w')\n        os._exit(0)\n",
                 "process:"),
        "memory": ("    return np.ones((512 << 20) // 8)\n", "memory:"),
        "cpu": ("    while True:\n        pass\n", "time: the recipe used its 1 s of CPU time"),
        "ctypes syscall": ("    libc = ctypes.CDLL(None, use_errno=True)\n"
                           "    if libc.syscall(41, socket.AF_INET, socket.SOCK_STREAM, 0) < 0:\n"
                           "        raise OSError(ctypes.get_errno(), 'socket(2) by syscall')\n", "network:"),
    }


@pytest.fixture(scope="module")
def attacked(corpora, tmp_path_factory):  # noqa: F811 - the imported fixture
    """One search: a good term recipe, a good code recipe, then every attack, then the good ones again."""
    pool, target = corpora
    folder = tmp_path_factory.mktemp("sandbox")
    (folder / "victim.txt").write_text("keep me")
    listener = socket.create_server(("127.0.0.1", 0))
    cases = attacks(folder, listener.getsockname()[1])
    header = "import ctypes, os, socket, subprocess\nimport numpy as np\n" + SELECT
    recipes = [GOOD, GOOD_CODE, *({"name": n, "code": header + body} for n, (body, _) in cases.items()),
               {**GOOD, "name": "good again", "rule": {"kind": "gumbel", "temperature": 0.5}}, GOOD_CODE]
    cfg = dataclasses.replace(TINY_SEARCH, trials=len(recipes), batch=3, recipe_timeout=30.0, recipe_cpu_seconds=1.0,
                              recipe_memory_mb=256)
    cwd, os.environ["SANDBOX_SECRET"] = os.getcwd(), SECRET
    os.chdir(folder)
    try:
        Search(pool, target, budget_of(pool), cfg, folder / "search", Scripted(recipes), progress=False).run()
    finally:
        os.chdir(cwd)
        del os.environ["SANDBOX_SECRET"]
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):
        listener.accept()  # nobody connected
    listener.close()
    trials = {t["recipe"]["name"]: t for t in TrialStore(folder / "search" / "trials.jsonl").load()}
    return folder, cases, trials, len(recipes)


@pytest.mark.parametrize("name", list(attacks(Path("."), 0)))
def test_an_attack_fails_with_the_rule_it_broke_and_has_no_effect(attacked, name) -> None:
    folder, cases, trials, _ = attacked
    trial = trials[name]
    assert trial["status"] == "failed" and trial["score"] is None
    assert trial["error"].startswith("recipe failed: " + cases[name][1]), trial["error"]
    assert SECRET not in trial["error"] and len(trial["error"]) < 2500
    assert not any((folder / f).exists() for f in ("written.txt", "spawned", "forked"))
    assert (folder / "victim.txt").read_text() == "keep me"


def test_good_recipes_in_the_attacked_search_succeed(attacked) -> None:
    folder, _, trials, n = attacked
    assert len(TrialStore(folder / "search" / "trials.jsonl").load()) == n
    good = [t for name, t in trials.items() if name.startswith("good")]
    assert {t["status"] for t in good} == {"ok"} and len(good) == 3 and all(np.isfinite(t["score"]) for t in good)
    assert (folder / "search" / "best_recipe.json").exists()


@pytest.fixture(scope="module")
def table(corpora):  # noqa: F811 - the imported fixture
    pool, target = corpora
    return feature_table(feature_bank(pool, target, TINY_BANK, progress=False), pool)


def test_the_sandbox_child_sees_no_inherited_environment(table, monkeypatch) -> None:
    monkeypatch.setenv("SANDBOX_SECRET", SECRET)
    code = "import os\n" + SELECT + "    raise ValueError(sorted(set(os.environ) - {'LC_CTYPE'}))\n"  # PEP 538 sets it
    with pytest.raises(RecipeError, match=r"raised ValueError: \['MKL_NUM_THREADS', 'OMP_NUM_THREADS', "
                                          r"'OPENBLAS_NUM_THREADS'\]"):
        run_recipe(validate_recipe({"code": code}), table, Budget(docs=10), 0, timeout=30.0)


SHIPPED_AS_CODE = """import numpy as np

def z(x):
    finite = np.isfinite(x)
    med = np.median(x[finite])
    scale = 1.4826 * np.median(np.abs(x[finite] - med))
    if not scale > 0:
        scale = float(np.std(x[finite]))
    return np.tanh(np.nan_to_num((x - med) / scale if scale > 0 else np.zeros_like(x), nan=0.0, posinf=0.0, neginf=0.0))

def select(table, n_tokens, budget, rng):
    perm = rng.permutation(len(n_tokens))
    if budget.docs is not None:
        n_back = int(round(0.177 * budget.docs))
    else:
        n_back = int(np.searchsorted(np.cumsum(n_tokens[perm]), 0.177 * budget.tokens))
    backbone, rest = perm[:n_back], np.sort(perm[n_back:])
    cell = np.unique(table["length_bin"][:, None], axis=0, return_inverse=True)[1].reshape(-1)
    u = z(table["distinct_2"])
    s = np.zeros(len(n_tokens))
    cell_mean = (np.bincount(cell, weights=u) / np.maximum(np.bincount(cell), 1))[cell]
    for w, v in ((-0.028, cell_mean), (-2.109, np.abs(z(table["bpb_final"]))), (0.696, z(table["distinct_avg"])),
                 (0.475, z(table["delta"]))):
        s += w * v
    cut = np.quantile(s[rest], 0.701)
    above, below = rng.permutation(rest[s[rest] >= cut]), rest[s[rest] < cut]
    return budget.take(np.concatenate([backbone, above, below[np.argsort(-s[below], kind="stable")]]), n_tokens)
"""


@pytest.mark.parametrize("budget", [Budget(docs=60), "tokens"])
def test_the_shipped_recipe_as_code_selects_the_same_subset_in_the_sandbox(table, budget) -> None:
    budget = Budget(tokens=int(table.n_tokens.sum()) // 3) if budget == "tokens" else budget
    shipped = load_recipe("autodata_best")
    assert shipped["terms"][0]["weight"] == -0.028 and shipped["rule"] == {"kind": "threshold", "quantile": 0.701}
    for seed in (0, 3):
        in_process = apply_recipe_inline(shipped, table, budget, seed)
        sandboxed = run_recipe(validate_recipe({"code": SHIPPED_AS_CODE}), table, budget, seed, timeout=30.0)
        np.testing.assert_array_equal(sandboxed, in_process)


def test_code_is_refused_where_the_kernel_lacks_the_sandbox_unless_trusted(table, monkeypatch) -> None:
    table_budget = table, Budget(docs=5)
    recipe = validate_recipe({"code": "import numpy as np\n" + SELECT + "    return np.arange(budget.docs)\n"})
    monkeypatch.setattr(sandbox, "missing_mechanisms", lambda: ("landlock",))
    with pytest.raises(RecipeError, match="this kernel lacks landlock; use a term recipe, or pass --trust-recipe-code"):
        run_recipe(recipe, *table_budget, 0, timeout=30.0)
    np.testing.assert_array_equal(run_recipe(recipe, *table_budget, 0, timeout=30.0, trust_code=True), np.arange(5))
    term = validate_recipe({"terms": [{"feature": "dsir"}]})
    assert run_recipe(term, *table_budget, 0).size == 5  # term recipes are data: never refused


def test_errors_are_bounded_and_wall_clock_time_is_limited(table) -> None:
    budget = Budget(docs=5)
    huge = validate_recipe({"code": SELECT + "    raise ValueError('x' * 10**6)\n"})
    with pytest.raises(RecipeError, match="raised ValueError: xxx") as err:
        run_recipe(huge, table, budget, 0, timeout=30.0)
    assert len(str(err.value)) < 2500
    sleeps = validate_recipe({"code": "import time\n" + SELECT + "    time.sleep(60)\n"})
    start = time.perf_counter()
    with pytest.raises(RecipeError, match="time: timed out after 3 s of wall-clock time"):
        run_recipe(sleeps, table, budget, 0, timeout=3.0, limits=SandboxLimits(cpu_seconds=1.0))
    assert time.perf_counter() - start < 40  # killed at its limit, not waited out: far below the recipe's 60 s sleep


AGENT = r"""
import json, sys
state = json.load(sys.stdin)
print(f"agent thinking about trial {state['trial']}", file=sys.stderr)
if state["trial"] == 1:
    sys.stdout.write("x" * 100_000_000)
elif state["trial"] == 2:
    print(json.dumps({"name": "peek", "program": "/etc/passwd"}))
else:
    print(json.dumps({"name": "agent", "terms": [{"feature": "dsir", "weight": 1 + state["trial"]}]}))
"""


def test_an_agent_that_prints_too_much_or_names_a_program_fails_its_trial_only(corpora, tmp_path) -> None:  # noqa: F811
    pool, target = corpora
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    command = f"{sys.executable} {script}"
    start = time.perf_counter()
    with pytest.raises(Exception, match="agent printed more than 1048576 bytes on stdout"):
        AgentProposer(command, timeout=60.0).propose([], 1, np.random.default_rng(0))
    assert time.perf_counter() - start < 40  # stopped at the cap, not left blocked on its pipe until the 60 s timeout
    cfg = dataclasses.replace(TINY_SEARCH, trials=4, batch=1, proposer="agent", agent_command=command)
    Search(pool, target, budget_of(pool), cfg, tmp_path / "search", progress=False).run()
    trials = TrialStore(tmp_path / "search" / "trials.jsonl").load()
    assert [t["status"] for t in trials] == ["ok", "failed", "failed", "ok"]
    assert "agent printed more than 1048576 bytes on stdout" in trials[1]["error"] and len(trials[1]["error"]) < 500
    assert "may not name a program file" in trials[2]["error"]
    assert [t["recipe"]["terms"][0]["weight"] for t in (trials[0], trials[3])] == [1.0, 4.0]
    log = (tmp_path / "search" / "agent_stderr.log").read_text()
    assert all(f"agent thinking about trial {t}" in log for t in range(4))


def test_the_search_command_takes_trust_recipe_code() -> None:
    parser = build_parser()
    base = ["search", "--pool", "p", "--target", "t", "--budget-tokens", "5", "--out-dir", "o"]
    assert parser.parse_args([*base, "--trust-recipe-code"]).search.trust_recipe_code is True
    assert parser.parse_args(base).search.trust_recipe_code is False
