"""MkDocs hooks: the site's generated pages and the repository links of every page.

- ``methods/<name>.md``: each online method's card, read from ``selection_callbacks/methods/<name>/README.md``,
  and ``offline/<name>.md``: each offline selector's, from ``selection_callbacks/offline/<name>/README.md``
  (a card is written once, beside its code, and shown on GitHub and in the site alike);
- ``benchmarks/<comparison>.md`` and ``.png``: per cited comparison, a table of its methods (final val bpb,
  Δ against random with the 95% paired-t interval, p, share of the oracle's gain) and a plot of val bpb
  against update tokens (the seeds' mean per method), both computed from its committed ``results.json``,
  followed by the comparison's README;
- the README's tables: ``<!-- method-table -->``, ``<!-- pool-table -->``, ``<!-- size-table -->`` and
  ``<!-- horizon-table -->`` become the tables ``docs/method_table.py`` renders into the README;
- the command reference: ``<!-- cli-help -->`` in ``cli.md`` becomes the ``--help`` of every
  ``selection-callbacks`` subcommand.

Pages are written with links relative to where their source lives in the repository, so they also
resolve on GitHub. Each link is mapped into the site: a docs page or card to its page, a cited
comparison's folder or README to its generated page; a link to any other repository file becomes the
file's path in code type, since the site does not carry it; a link to a path the repository lacks is left
as written, so strict mode fails on it, and an image the site lacks (plots are not committed) is left out.
"""

from __future__ import annotations

import importlib.util
import io
import json
import posixpath
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
CARDS = ("random", "high_loss", "oracle", "rho", "classact", "opus", "greats")
OFFLINE_CARDS = ("dsir", "warmup_delta", "policy", "datamask", "autodata", "oracle")
COMPARISONS = (
    "default-adamw", "default-adamw-5seeds", "default-adamw-rescaled", "default-muon", "default-muon-5seeds",
    "packages-adamw", "packages-adamw-5seeds", "packages-muon-5seeds", "llama-adamw", "default-adamw-bpe4k",
    "default-muon-refresh", "default-muon-nosketch", "default-muon-late-layers", "default-muon-moments",
    "default-muon-mirrored", "opus-adamw-signal", "cpu-tiny-muon",
)
"""Comparisons the cards and pages cite; each gets a generated page (its folder holds results.json)."""
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
SOURCES: dict[str, str] = {}  # site page → its source's path in the repository


def method_table():
    """docs/method_table.py (paired intervals, per-seed deltas), loaded by path."""
    spec = importlib.util.spec_from_file_location("method_table", ROOT / "docs" / "method_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def on_files(files, config):
    cards = [("methods", name) for name in CARDS] + [("offline", name) for name in OFFLINE_CARDS]
    for kind, name in cards:
        source = f"selection_callbacks/{kind}/{name}/README.md"
        files.append(File.generated(config, f"{kind}/{name}.md", content=(ROOT / source).read_text()))
        SOURCES[f"{kind}/{name}.md"] = source
    table = method_table()
    for name in COMPARISONS:
        results = json.loads((ROOT / "bench" / "results" / name / "results.json").read_text())
        readme = next(p for p in (ROOT / "bench/results" / name / f for f in ("README.md", "report.md")) if p.exists())
        page = comparison_page(name, results, readme.read_text(), table)
        files.append(File.generated(config, f"benchmarks/{name}.md", content=page))
        files.append(File.generated(config, f"benchmarks/{name}.png", content=curves_png(name, results)))
        SOURCES[f"benchmarks/{name}.md"] = str(readme.relative_to(ROOT))
    return files


def comparison_page(name: str, results: dict, readme: str, table) -> str:
    """The generated table and plot, then the comparison's README without its title."""
    title, _, body = readme.partition("\n")
    rows = ["| method | seeds | final val bpb | Δ vs random, 95% CI | p | share of its oracle's gain |",
            "|---|---:|---:|---:|---:|---:|"]
    methods = results["methods"]
    for method, entry in methods.items():
        finals = [r["final_val_bpb"] for r in entry["runs"]]
        diffs = table.deltas(results, method)
        mean, half = table.paired_interval(diffs)
        oracle = table.ORACLE[bool(entry.get("offline"))]
        share = mean / table.paired_interval(table.deltas(results, oracle))[0] if oracle in methods else float("nan")
        rows.append(f"| {method} | {len(finals)} | {sum(finals) / len(finals):.4f} | {mean:+.4f} ± {half:.4f} | "
                    f"{p_value(diffs)} | {'—' if method == 'random' or share != share else f'{share:.0%}'} |")
    return (f"{title if title.startswith('# ') else '# ' + name}\n\n"
            f"Computed from `bench/results/{name}/results.json` when the site is built.\n\n" + "\n".join(rows) +
            f"\n\n![val bpb against update tokens, mean over seeds]({name}.png)\n\n{body.lstrip()}")


def p_value(diffs: list[float]) -> str:
    """Two-sided paired t-test p of per-seed differences ('—' when undefined)."""
    from scipy import stats

    if len(diffs) < 2 or max(diffs) == min(diffs):
        return "—"
    return f"{stats.ttest_1samp(diffs, 0.0).pvalue:.3f}"


def curves_png(name: str, results: dict) -> bytes:
    """Val bpb against update tokens, the seeds' mean per method (evaluations shared by every seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.set_prop_cycle(color=plt.cm.tab20.colors)
    for method, entry in results["methods"].items():
        curves = [np.asarray(r["curve"], dtype=float) for r in entry["runs"]]
        n = min(len(c) for c in curves)
        mean = np.mean([c[:n, 2] for c in curves], axis=0)
        style = {"color": "black", "lw": 2.2} if method == "random" else {"lw": 1.2, "ls": "--" if entry.get("offline") else "-"}
        ax.plot(curves[0][:n, 0] / 1e6, mean, label=method, **style)
    ax.set(xlabel="update tokens (millions)", ylabel="val bpb", title=f"{name}: online solid, offline dashed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def on_page_markdown(markdown, page, config, files):
    source = SOURCES.get(page.file.src_uri, f"docs/{page.file.src_uri}")
    if "-table -->" in markdown:  # the README's tables, their root-relative links seen from docs/
        renders = method_table().TABLES
        for name, render in renders.items():
            if f"<!-- {name}-table -->" in markdown:
                markdown = markdown.replace(f"<!-- {name}-table -->", render().replace("](", "](../"))
        unknown = re.findall(r"<!-- [\w-]+-table -->", markdown)
        if unknown:
            raise ValueError(f"{page.file.src_uri}: no table is rendered for {unknown}; use one of "
                             f"{[f'<!-- {name}-table -->' for name in renders]}")
    if "<!-- cli-help -->" in markdown:
        markdown = markdown.replace("<!-- cli-help -->", cli_help())
    out, fenced = [], False
    for line in markdown.split("\n"):
        fenced ^= line.lstrip().startswith("```")
        out.append(line if fenced else LINK.sub(lambda m: mapped(m, source, page.file.src_uri, files), line))
    return "\n".join(out)


def mapped(match: re.Match, source: str, page: str, files) -> str:
    """One markdown link, pointed at its page in the site or turned into the repository path in code type."""
    image, text, target = match.groups()
    if re.match(r"[a-z]+:", target) or target.startswith("#"):
        return match.group(0)
    path, _, anchor = target.partition("#")
    if files.get_file_from_path(posixpath.normpath(posixpath.join(posixpath.dirname(page), path))) is not None:
        return match.group(0)  # a page or file of the site itself
    repo = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
    site = site_page(repo, files)
    if site is not None:
        link = posixpath.relpath(site, posixpath.dirname(page) or ".")
        return f"{image}[{text}]({link}{'#' + anchor if anchor else ''})"
    if image:  # plots are redrawn from results.json, not committed: an image the site lacks is left out
        return ""
    if not (ROOT / repo).exists():
        return match.group(0)  # a link to nothing: strict mode reports it
    shown = f"`{repo}`"
    return shown if text.strip("`") in (repo, path, posixpath.basename(repo)) else f"{text} ({shown})"


def site_page(repo: str, files) -> str | None:
    """The site page that shows repository file ``repo``, or None."""
    if repo.startswith("docs/") and files.get_file_from_path(repo[len("docs/"):]) is not None:
        return repo[len("docs/"):]
    card = re.fullmatch(r"selection_callbacks/(methods|offline)/(\w+)(?:/README\.md)?", repo)
    if card and card.group(2) in (CARDS if card.group(1) == "methods" else OFFLINE_CARDS):
        return f"{card.group(1)}/{card.group(2)}.md"
    comparison = re.fullmatch(r"bench/results/([\w.-]+)(?:/(?:README|report)\.md)?", repo)
    if comparison and comparison.group(1) in COMPARISONS:
        return f"benchmarks/{comparison.group(1)}.md"
    return None


def cli_help() -> str:
    """Every ``selection-callbacks`` subcommand's ``--help``, nested subcommands included."""
    from selection_callbacks.cli import build_parser

    sections: list[str] = []

    def walk(parser, name: str) -> None:
        sections.append(f"### `{name}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
        action = getattr(parser, "_subcommands_action", None)
        for sub, child in (action._name_parser_map.items() if action else ()):
            walk(child, f"{name} {sub}")

    walk(build_parser(), "selection-callbacks")
    return "\n".join(sections)
