"""Selections fingerprint: each online method's default config trained for a few steps, its final val bpb.

    python -m bench.harness.selections --pool P --target T --val V --out bench/results/selections.json

Every method trains the same seed on the same superbatch stream at one thread, so the val bpb after
``--steps`` steps is a deterministic function of the selections the method made: a refactor that
leaves every value unchanged bit for bit left every selection unchanged. ``--check FILE`` compares
against an earlier fingerprint and exits 1 on any difference.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from jsonargparse import ArgumentParser

from bench.harness.train_child import ROOT, fit_command, thread_env

# name → (method config, optimizer, extra selection arguments)
FINGERPRINTED: dict[str, tuple[str, str, list[str]]] = {
    "random": ("random", "adamw", []),
    "high_loss": ("high_loss", "adamw", []),
    "oracle": ("oracle", "adamw", []),
    "rho": ("rho", "adamw", []),
    "rho_window16": ("rho_windows", "adamw", []),
    "classact": ("classact", "adamw", []),
    "classact_report": ("classact_report", "adamw", []),
    "opus": ("opus", "adamw", []),
    "opus_muon": ("opus", "muon", []),
    "greats": ("greats", "adamw", []),
}


def command(name: str, args, run_dir: Path) -> list[str]:
    method, optimizer, extra = FINGERPRINTED[name]
    configs = ["configs/scale/cpu-tiny.yaml", f"configs/tuned/cpu-tiny-{optimizer}.yaml", f"configs/method/{method}.yaml"]
    cmd = fit_command(configs, 0, args.pool, args.target, args.val, args.steps, args.steps, run_dir)
    return cmd + ["--model.optimizer", optimizer, "--ledger.enabled", "false", *extra]


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pool", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--methods", default=",".join(FINGERPRINTED), help="comma-separated names of FINGERPRINTED")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--runs", default="runs/selections", help="folder of the runs")
    p.add_argument("--out", default=None, help="JSON file the fingerprint is written to")
    p.add_argument("--check", default=None, help="an earlier fingerprint: exit 1 where a value differs")
    args = p.parse_args(argv)
    env = thread_env(1)
    values: dict[str, float] = {}
    for name in args.methods.split(","):
        run_dir = Path(args.runs) / name
        subprocess.run(command(name, args, run_dir), cwd=ROOT, env=env, check=True, capture_output=True)
        values[name] = json.loads((run_dir / "metrics.json").read_text())["curve"][-1][2]
        print(f"{name}: val bpb {values[name]!r}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(values, indent=1) + "\n")
    if args.check:
        before = json.loads(Path(args.check).read_text())
        moved = {k: (before.get(k), v) for k, v in values.items() if before.get(k) != v}
        for k, (b, v) in moved.items():
            print(f"MOVED {k}: {b!r} -> {v!r}")
        if moved:
            raise SystemExit(1)
    return values


if __name__ == "__main__":
    main()
