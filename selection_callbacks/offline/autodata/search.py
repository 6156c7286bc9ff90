"""AutoData: search over selection recipes with proxy-training feedback (Lin et al., AutoData).

Loop, one trial t at a time (``batch`` trials propose together and train in parallel workers)::

    recipe_t = proposer(history)                     # evolution | random | agent command
    S_t      = recipe_t(feature table, budget B)     # terms in-process, code in the sandbox; exactly B
    score_t  = target bpb of a fresh proxy GPT trained on S_t for trial_tokens tokens
    history ← history + [trial_t]                    # appended to <out>/trials.jsonl

Every trial uses the same proxy seed (common random numbers), so scores differ by subset, not by
initialisation. A proposal that is not a valid recipe, or a recipe that raises, times out or
returns the wrong size, is recorded as a failed trial and the search goes on. Trials persist as
they finish, so a killed search resumes from ``trials.jsonl`` (``search.json`` holds the settings
it was started with; resuming with others is an error). At the end, the ``final_top`` best recipes
are retrained under ``final_seeds`` more proxy seeds and the best mean (winner's curse discounted)
is exported to ``<out>/best_recipe.json``; ``report.md`` and ``score_vs_trial.png`` summarise.

    selection-callbacks autodata search --pool data/default/pool.jsonl \
        --target data/default/target.jsonl --budget-tokens 2048001 --trials 40 --out-dir runs/autodata
    selection-callbacks autodata search ... --proposer agent --agent-command "python agent.py"
    (code recipes run in the kernel sandbox: docs/autodata-sandbox.md; ``--trust-recipe-code``
    runs them where the kernel lacks it)
    selection-callbacks autodata report runs/autodata runs/autodata-random
    selection-callbacks select autodata --recipe runs/autodata/best_recipe.json ...

(``python -m selection_callbacks.offline.autodata`` and ``python -m selection_callbacks.offline.select``
take the same arguments.)

The selector ``autodata`` applies one recipe (a file, or a preset of the package's ``offline/autodata/presets/``) to
a pool. Selectors read the pool and the target split only; val is never read here.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
from jsonargparse import ActionSubCommands, ArgumentParser, Namespace
from tqdm.auto import tqdm

from selection_callbacks.core.arguments import add_pool_arguments, command_parser
from selection_callbacks.offline.autodata import schema
from selection_callbacks.offline.autodata.evaluation import FeatureTable, feature_table, run_recipe
from selection_callbacks.offline.autodata.proposers import ProposalError, Proposer, make_proposer
from selection_callbacks.offline.autodata.report import write_report
from selection_callbacks.offline.autodata.sandbox.limits import SandboxLimits
from selection_callbacks.offline.autodata.schema import RecipeError, load_recipe, recipe_features, validate_recipe
from selection_callbacks.offline.autodata.surrogate import SubsetProfile
from selection_callbacks.offline.common.corpus import Budget, Corpus, Selection, SelectionError, load_corpus
from selection_callbacks.offline.common.features import FeatureConfig, feature_bank
from selection_callbacks.offline.common.proxy_reward import ProxyReward
from selection_callbacks.offline.common.proxy_train import ProxyConfig


@dataclass
class AutoDataConfig:
    """The ``autodata`` selector: apply one recipe.

    Attributes:
        recipe: a recipe JSON file or a preset name (``<name>.json`` in the package's
            ``offline/autodata/presets/``; the search's exported winner ships as ``autodata_best``).
        timeout: wall-clock seconds a code recipe may run.
        cpu_seconds: CPU seconds a code recipe may use (None = ``timeout``).
        memory_mb: memory (MiB) a code recipe may allocate.
        trust_recipe_code: run a code recipe even where the kernel lacks the sandbox's mechanisms.
        bank: the feature bank the recipe reads.
    """

    recipe: str = "autodata_best"
    timeout: float = 60.0
    cpu_seconds: float | None = None
    memory_mb: int = 2048
    trust_recipe_code: bool = False
    bank: FeatureConfig = field(default_factory=FeatureConfig)


def select_autodata(
    pool: Corpus, target: Corpus, budget: Budget, seed: int, cfg: AutoDataConfig, progress: bool = True
) -> Selection:
    """The recipe's subset of the pool for ``budget`` (a failing recipe is an error here, naming why)."""
    return apply_recipe(feature_table(feature_bank(pool, target, cfg.bank, progress=progress), pool), budget, seed, cfg)


def apply_recipe(table: FeatureTable, budget: Budget, seed: int, cfg: AutoDataConfig) -> Selection:
    """``cfg.recipe`` run on a feature table (a failing recipe is an error here, naming why)."""
    recipe = load_recipe(cfg.recipe)
    try:
        limits = SandboxLimits(cfg.timeout, cfg.cpu_seconds, cfg.memory_mb)
        idx = run_recipe(recipe, table, budget, seed, cfg.timeout, limits, cfg.trust_recipe_code)
    except RecipeError as e:
        raise SelectionError(f"recipe {cfg.recipe!r} failed: {e}") from e
    return Selection(idx, {"recipe": recipe})


@dataclass
class SearchConfig:
    """Settings of one search.

    Attributes:
        trials: trials to run in total (a resumed search counts the ones on disk).
        proposer: ``evolution`` (built in, offline), ``random`` (prior draws) or ``agent``.
        agent_command: shell command of the agent proposer (JSON history on stdin, recipe on stdout).
        agent_timeout: seconds the agent may take per proposal.
        agent_max_bytes: the most the agent may print per proposal (a longer answer fails the trial).
        n_init: evolution: trials before children are proposed (uniform, presets, prior draws).
        seed_presets: evolution: run the paper's presets early and let them compete as parents.
        batch: trials proposed together from the same history (results do not depend on ``workers``).
        workers: parallel proxy-training processes.
        seed: proposal and selection seed.
        proxy_seed: the proxies' seed, shared by every trial.
        trial_tokens: training tokens of each trial's proxy.
        proxy: the proxy's shape and optimiser.
        reward_windows: evenly spaced target windows a trial is scored on; None = all.
        recipe_timeout: wall-clock seconds a code recipe may take to select.
        recipe_cpu_seconds: CPU seconds a code recipe may use (None = ``recipe_timeout``).
        recipe_memory_mb: memory (MiB) a code recipe may allocate.
        trust_recipe_code: run code recipes even where the kernel lacks the sandbox's mechanisms
            (they then run with the user's rights).
        final_top: best recipes retrained at the end with more proxy seeds (0 = skip).
        final_seeds: extra proxy seeds of that retraining.
        bank: the feature bank.
    """

    trials: int = 40
    proposer: str = "evolution"
    agent_command: str | None = None
    agent_timeout: float = 300.0
    agent_max_bytes: int = 1 << 20
    n_init: int = 8
    seed_presets: bool = True
    batch: int = 2
    workers: int = 2
    seed: int = 0
    proxy_seed: int = 0
    trial_tokens: int = 1 << 20
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    reward_windows: int | None = None
    recipe_timeout: float = 60.0
    recipe_cpu_seconds: float | None = None
    recipe_memory_mb: int = 2048
    trust_recipe_code: bool = False
    final_top: int = 3
    final_seeds: int = 2
    bank: FeatureConfig = field(default_factory=FeatureConfig)

    def identity(self) -> dict[str, Any]:
        """What a resumed search must share with the original (``trials``, ``workers``, the agent's
        output cap and the sandbox's CPU, memory and trust settings may change)."""
        d = asdict(self)
        for free in ("trials", "workers", "agent_max_bytes", "recipe_cpu_seconds", "recipe_memory_mb",
                     "trust_recipe_code"):
            d.pop(free)
        return d


class TrialStore:
    """Trials as JSON lines, one per finished trial, flushed and fsynced; a torn last line is dropped."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        trials = []
        lines = self.path.read_text().splitlines()
        for n, line in enumerate(lines):
            try:
                trials.append(json.loads(line))
            except json.JSONDecodeError:
                if n != len(lines) - 1:
                    raise ValueError(f"{self.path}: line {n + 1} is corrupt (only a torn last line is expected)") from None
        if len(trials) < len(lines):  # rewrite without the torn line so appends stay line-aligned
            self.path.write_text("".join(json.dumps(t) + "\n" for t in trials))
        if [t["trial"] for t in trials] != list(range(len(trials))):
            raise ValueError(f"{self.path}: trials are not numbered 0..{len(trials) - 1}")
        return trials

    def append(self, trial: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(trial) + "\n")
            f.flush()
            os.fsync(f.fileno())


def subset_hash(ids: np.ndarray) -> str:
    """sha256 of the sorted chosen document ids (two recipes with one subset share it)."""
    return hashlib.sha256("\n".join(sorted(map(str, ids))).encode()).hexdigest()[:16]


def _bpb(reward: float) -> float:
    return -reward / math.log(2)


class Search:
    """One AutoData search in ``out_dir`` (see the module docstring)."""

    def __init__(self, pool: Corpus, target: Corpus, budget: Budget, cfg: SearchConfig, out_dir: Path,
                 proposer: Proposer | None = None, progress: bool = True) -> None:
        budget.check(pool)
        if budget.tokens is not None and budget.tokens <= cfg.proxy.seq_len:
            raise SelectionError(f"a budget of {budget.tokens} tokens is less than one proxy window ({cfg.proxy.seq_len + 1})")
        self.pool, self.target, self.budget, self.cfg, self.progress = pool, target, budget, cfg, progress
        self.out = Path(out_dir)
        self.store = TrialStore(self.out / "trials.jsonl")
        self.settings = {"pool": pool.path, "target": target.path, "budget": asdict(budget), **cfg.identity()}
        self.check_settings()
        self.table: FeatureTable = feature_table(feature_bank(pool, target, cfg.bank, progress=progress), pool)
        context = {"budget": asdict(budget), "feature_summary": self.feature_summary()}
        self.proposer = proposer or make_proposer(
            cfg.proposer, cfg.agent_command, cfg.agent_timeout, context, cfg.n_init, cfg.seed_presets,
            SubsetProfile(self.table, budget, cfg.seed), cfg.agent_max_bytes, self.out / "agent_stderr.log",
        )
        self.limits = SandboxLimits(cfg.recipe_timeout, cfg.recipe_cpu_seconds, cfg.recipe_memory_mb)

    def check_settings(self) -> None:
        path = self.out / "search.json"
        if path.exists():
            before = json.loads(path.read_text())
            if before != json.loads(json.dumps(self.settings)):
                diff = sorted(k for k in set(before) | set(self.settings) if before.get(k) != self.settings.get(k))
                raise SystemExit(f"{self.out} holds a search with other settings ({diff}); use another --out-dir")
        else:
            self.out.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.settings, indent=1))

    def feature_summary(self) -> dict[str, dict[str, float]]:
        return {n: {"median": float(np.nanmedian(x)), "q10": float(np.nanquantile(x, 0.1)),
                    "q90": float(np.nanquantile(x, 0.9))} for n, x in self.table.numeric.items()}

    def propose_and_select(self, history: list[dict[str, Any]], trial: int) -> tuple[dict[str, Any], np.ndarray | None]:
        """A trial record without its score, and its subset (None when the trial already failed)."""
        rng = np.random.default_rng([self.cfg.seed, trial, 0xA0])
        record: dict[str, Any] = {"trial": trial, "proposer": self.proposer.name, "status": "failed", "error": None,
                                  "recipe": None, "subset_hash": None, "documents": None, "tokens": None,
                                  "score": None, "seconds": {}}
        start = time.perf_counter()
        try:
            raw = self.proposer.propose(history, trial, rng)
        except (ProposalError, OSError) as e:
            record["error"] = f"proposal failed: {e}"
            return record, None
        record["seconds"]["propose"] = round(time.perf_counter() - start, 3)
        try:
            recipe = validate_recipe(raw)
        except RecipeError as e:
            record["recipe"], record["error"] = raw, f"invalid recipe: {e}"
            return record, None
        record["recipe"] = recipe
        record["features"] = sorted(recipe_features(recipe))
        start = time.perf_counter()
        try:
            idx = self.select(recipe)
        except RecipeError as e:
            record["error"] = f"recipe failed: {e}"
            return record, None
        finally:
            record["seconds"]["select"] = round(time.perf_counter() - start, 3)
        record.update(subset_hash=subset_hash(self.pool.ids[idx]), documents=int(idx.size),
                      tokens=int(self.pool.n_tokens[idx].sum()))
        return record, idx

    def select(self, recipe: dict) -> np.ndarray:
        """The subset of a validated recipe (code in the sandbox under the search's limits)."""
        return run_recipe(recipe, self.table, self.budget, self.cfg.seed, self.cfg.recipe_timeout, self.limits,
                          self.cfg.trust_recipe_code)

    def run(self) -> dict[str, Any]:
        """Run (or resume) the trials, the final retraining and the export; returns the best trial."""
        cfg = self.cfg
        history = self.store.load()
        if history and self.progress:
            print(f"[autodata] resuming {self.out}: {len(history)} trials on disk")
        bar = tqdm(total=cfg.trials, initial=min(len(history), cfg.trials), desc=f"autodata: {self.proposer.name}",
                   unit="trial", disable=not self.progress)
        with ProxyReward(self.pool, self.target, cfg.proxy, cfg.trial_tokens, cfg.reward_windows, cfg.workers) as reward:
            while len(history) < cfg.trials:
                first = len(history)
                batch = [self.propose_and_select(history, t) for t in range(first, min(first + cfg.batch, cfg.trials))]
                todo = [(r, idx) for r, idx in batch if idx is not None]
                start = time.perf_counter()
                rewards = reward([idx for _, idx in todo], [cfg.proxy_seed] * len(todo)) if todo else []
                train_seconds = (time.perf_counter() - start) / max(len(todo), 1)  # amortised over the batch
                for (record, _), r in zip(todo, rewards):
                    record.update(status="ok", score=_bpb(float(r)))
                    record["seconds"]["train"] = round(train_seconds, 2)
                for record, _ in batch:
                    self.store.append(record)
                    history.append(record)
                    bar.update(1)
                ok = [h["score"] for h in history if h["status"] == "ok"]
                bar.set_postfix(best=f"{min(ok):.4f}" if ok else "-")
            bar.close()
            final = self.finalise(history, reward)
        write_report([self.out])
        return final

    def finalise(self, history: list[dict[str, Any]], reward: ProxyReward) -> dict[str, Any]:
        """Retrain the best recipes under more proxy seeds; export the best mean as best_recipe.json."""
        path = self.out / "final.json"
        ok = sorted((h for h in history if h["status"] == "ok"), key=lambda h: h["score"])
        if not ok:
            raise SelectionError(f"no trial of {self.out} succeeded; see the errors in trials.jsonl")
        if path.exists() and json.loads(path.read_text()).get("trials") == len(history):
            final = json.loads(path.read_text())
        else:
            top, seen = [], set()
            for h in ok:
                if h["subset_hash"] not in seen:
                    top.append(h)
                    seen.add(h["subset_hash"])
                if len(top) == max(1, self.cfg.final_top):
                    break
            seeds = [self.cfg.proxy_seed + 1 + k for k in range(self.cfg.final_seeds)]
            rows = []
            for h in top:
                scores = [h["score"]]
                if seeds:
                    idx = self.select(h["recipe"])
                    scores += [_bpb(float(r)) for r in reward([idx] * len(seeds), seeds)]
                rows.append({"trial": h["trial"], "scores": scores, "mean": float(np.mean(scores)), "recipe": h["recipe"]})
            rows.sort(key=lambda r: r["mean"])
            final = {"trials": len(history), "proxy_seeds": [self.cfg.proxy_seed, *seeds], "top": rows, "best": rows[0]}
            path.write_text(json.dumps(final, indent=1))
        best = final["best"]
        export = {**best["recipe"], "name": f"autodata best (trial {best['trial']}, {self.out.name})"}
        (self.out / "best_recipe.json").write_text(json.dumps(export, indent=1))
        if self.progress:
            print(f"[autodata] best: trial {best['trial']}, target bpb {best['mean']:.4f} over "
                  f"{len(best['scores'])} proxy seeds -> {self.out / 'best_recipe.json'}")
        return final


def build_parser(parent: ActionSubCommands | None = None, name: str = "autodata") -> ArgumentParser:
    """The ``autodata`` command (search, report, schema), standalone or as subcommand ``name`` of ``parent``."""
    description = __doc__.split("\n\n")[0]
    p = command_parser("python -m selection_callbacks.offline.autodata", description, parent, name)
    sub = p.add_subcommands(dest="command", required=True)
    s = ArgumentParser(description="run or resume a search")
    add_pool_arguments(s, "the split trials are scored on (never the val split)",
                       "each recipe selects ≥ this many tokens (fewest documents)",
                       "each recipe selects exactly this many documents")
    s.add_argument("--out-dir", required=True, help="trials.jsonl, final.json, best_recipe.json, report")
    s.add_argument("--progress", type=bool, default=True, help="progress bar and resume/best messages")
    s.add_argument("--trust-recipe-code", "--trust_recipe_code", dest="trust_recipe_code", action="store_true",
                   help="run code recipes even where the kernel lacks the sandbox (Landlock, seccomp): with your rights")
    s.add_class_arguments(SearchConfig, None, skip={"trust_recipe_code"})
    sub.add_subcommand("search", s, help="run or resume a search")
    r = ArgumentParser(description="leaderboard, feature usage and score-vs-trial plot of searches")
    r.add_argument("dirs", nargs="+", help="search folders; the first one's leaderboard and usage are shown")
    r.add_argument("--out", default=None, help="folder for report.md and the plot (default: the first search)")
    sub.add_subcommand("report", r, help="write the report of one or more searches")
    sub.add_subcommand("schema", ArgumentParser(description="print the recipe schema"), help="print the recipe schema")
    return p


def run(ns: Namespace) -> Any:
    """Run the command an instantiated ``build_parser()`` namespace names: a search, a report or the schema."""
    if ns.command == "schema":
        print(schema.__doc__)
        return None
    if ns.command == "report":
        return write_report([Path(d) for d in ns.report.dirs], ns.report.out)
    a = ns.search
    cfg = SearchConfig(**{f.name: a[f.name] for f in fields(SearchConfig)})
    budget = Budget(tokens=a.budget_tokens, docs=a.budget_docs)
    search = Search(load_corpus(a.pool, "pool"), load_corpus(a.target, "target"), budget, cfg, Path(a.out_dir),
                    progress=a.progress)
    return search.run()


def main(argv: list[str] | None = None) -> Any:
    """``python -m selection_callbacks.offline.autodata``: parse ``argv`` and run its command."""
    parser = build_parser()
    return run(parser.instantiate(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
