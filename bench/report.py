"""Results: the JSON record, a Markdown page fragment, PNG plots, and the targets verdict.

Every figure is also given as a ratio to this project's system of the same
kind (`systems.REFERENCE`: in-process libraries against `Volume`, mounts and
local disk against the FUSE mount), so "0.25x" reads "a quarter of ours".
Warm epochs are the headline; cold epochs are shown beside them. Where a
system ran several warm epochs (short ones, workload 1), a target takes their
median.

`publish()` writes one run into docs/: the JSON, the plots, and its facts,
verdicts and every table into docs/benchmarks-results.md, generated whole, so
the docs show one run, reproducible from its JSON. The hand-written
docs/benchmarks.md says what is measured and how, and quotes no run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
from collections import defaultdict

from .systems import REFERENCE, all_systems

log = logging.getLogger(__name__)

PAGE = "benchmarks.md"                # hand-written: what is measured, no run's figures
RESULTS_PAGE = "benchmarks-results.md"  # generated whole: every table of the run
RESULTS_JSON = "benchmarks-results.json"
# The headline metric per workload: MB/s for streaming, items/s otherwise.
HEADLINE = {"small-files": ("items_per_s", "files/s"), "large-seq": ("mb_per_s", "MB/s"),
            "random": ("items_per_s", "reads/s"), "metadata": ("items_per_s", "ops/s"),
            "shared": ("items_per_s", "files/s")}
FSSPEC_CACHES = ("fsspec-simplecache", "fsspec-blockcache", "fsspec-filecache")
WARM_SPEED = 0.8   # workload 5: a new client "runs at warm speed" at >= 80% of the warm rate


def _key(row: dict) -> tuple:
    """Where a row sits: workload 5 measures client 0 restarted (epoch 3) once
    per round, and each round's new clients have their own index."""
    return (row["workload"], row["config"], row["system"], row["epoch"], row.get("client", 0),
            row.get("round", 0))


def _index(rows: list[dict]) -> dict:
    """(workload, config, system, epoch, client, round) -> row."""
    return {_key(r): r for r in rows}


def _ours(idx: dict, systems: dict, row: dict) -> dict | None:
    """This project's row that `row` is compared with: the same epoch of the
    same client and round, on our system of the same kind."""
    ref = REFERENCE[systems[row["system"]]["kind"]]
    return idx.get((row["workload"], row["config"], ref) + _key(row)[3:])


def _rate(row: dict | None, workload: str) -> float | None:
    return row.get(HEADLINE[workload][0]) if row else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def targets(result: dict) -> list[dict]:
    """The suite's targets (docs/benchmarks.md), each with the measured ratio and
    whether it is met."""
    idx = _index(result["rows"])
    out = []

    def rates(workload, config, system, epoch) -> list:
        """Epoch 1's figure (cold), or every warm epoch's (workload 1 repeats
        short ones; the target takes their median)."""
        return [_rate(r, workload) for r in result["rows"]
                if (r["workload"], r["config"], r["system"]) == (workload, config, system)
                and not r.get("client") and (r["epoch"] > 1 if epoch > 1 else r["epoch"] == 1)]

    def add(name, workload, config, ours, peer, epoch, want):
        a, b = rates(workload, config, ours, epoch), rates(workload, config, peer, epoch)
        ratio = _ratio(_median(a), _median(b))
        detail = (f"median of {len(a)} warm epochs against {len(b)}"
                  if epoch > 1 and a and b and (len(a), len(b)) != (1, 1) else "")
        out.append({"target": name, "workload": workload, "config": config,
                    "ours": ours, "peer": peer, "ratio": ratio, "want": want,
                    "met": None if ratio is None else ratio >= want, "detail": detail})

    configs = sorted({r["config"] for r in result["rows"] if r["workload"] == "small-files"})
    for config in configs:
        for peer in FSSPEC_CACHES:
            add(f"warm Volume >= 1.0x {peer}", "small-files", config, "volume", peer, 2, 1.0)
        add("warm FUSE >= 3x rclone vfs full", "small-files", config, "fuse", "rclone", 2, 3.0)
        add("warm FUSE >= 10x s3fs-fuse use_cache", "small-files", config, "fuse",
            "s3fs-fuse", 2, 10.0)
        add("warm FUSE >= 80% of passthrough", "small-files", config, "fuse", "passthrough",
            2, 0.8)
        for peer in FSSPEC_CACHES + ("s3fs", "crt"):
            add(f"cold Volume >= 1.0x {peer}", "small-files", config, "volume", peer, 1, 1.0)
        for peer in ("rclone", "s3fs-fuse"):
            add(f"cold FUSE >= 1.0x {peer}", "small-files", config, "fuse", peer, 1, 1.0)
    # cold large files against AWS's CRT client (many 8 MiB parts in flight)
    add("cold Volume >= 1.0x crt", "large-seq", "1 reader", "volume", "crt", 1, 1.0)
    # warm small random reads through Volume, files held open
    for config, want in (("4 KiB", 0.5), ("128 KiB", 1.0)):
        add(f"warm random reads: Volume >= {want:.1f}x fsspec-simplecache", "random", config,
            "volume", "fsspec-simplecache", 2, want)
    shared = defaultdict(list)
    for r in result["rows"]:
        if r["workload"] == "shared" and r["system"] in ("volume", "fuse"):
            shared[(r["config"], r["system"])].append(r)
    for (config, system), rows in shared.items():
        # New clients' median first epoch against client 0 restarted (epoch 3,
        # no memory of its own); its epoch 2, from private memory, only beside.
        restarted = [_rate(r, "shared") for r in rows if r["epoch"] == 3 and not r["client"]]
        new = [r for r in rows if r["client"]]
        firsts = [_rate(r, "shared") for r in new]
        warm, first = _median(restarted), _median(firsts)
        in_memory = _rate(idx.get(("shared", config, system, 2, 0, 0)), "shared")
        ratio = _ratio(first, warm)
        hits = sorted({f"{r['hit_ratio']:.2f}" for r in new if r["hit_ratio"] is not None})
        hit = "hit ratio " + ("–".join(dict.fromkeys([hits[0], hits[-1]])) if hits else "–")
        out.append({"target": f"{system} new clients' first epoch at warm speed (>= "
                              f"{WARM_SPEED:.0%} of client 0's warm epoch after a restart)",
                    "workload": "shared", "config": config, "ours": system,
                    "peer": f"{system} client 0 warm, restarted", "ratio": ratio,
                    "want": WARM_SPEED, "met": None if ratio is None else ratio >= WARM_SPEED,
                    "detail": f"median of {len(firsts)} first epochs, {_span(firsts)} files/s, "
                              f"against the median of {len(restarted)} restarts, "
                              f"{_span(restarted)}; {hit}, "
                              f"{sum(r['remote_requests'] for r in new)} remote requests; "
                              f"{_x(_ratio(first, in_memory))} of client 0's epoch 2, "
                              f"from its own memory"})
    return out


def _median(values: list) -> float | None:
    values = [v for v in values if v]
    return statistics.median(values) if values else None


def _span(values: list) -> str:
    values = [v for v in values if v]
    if not values:
        return "–"
    lo, hi = min(values), max(values)
    return _fmt(lo) if lo == hi else f"{_fmt(lo)}–{_fmt(hi)}"


def write(result: dict, out_dir: str, stem: str) -> dict:
    """Write `<stem>.json`, `<stem>.md` and `<stem>-<workload>.png`; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    result["targets"] = targets(result)
    paths = {"json": os.path.join(out_dir, f"{stem}.json")}
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=1, sort_keys=True, default=str)
    paths["png"] = plot(result, out_dir, stem)
    paths["md"] = os.path.join(out_dir, f"{stem}.md")
    with open(paths["md"], "w") as f:
        f.write(markdown(result, {w: os.path.basename(p) for w, p in paths["png"].items()}))
    return paths


def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "–"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.{digits}f}"
    return str(v)


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}x"


def markdown(result: dict, images: dict[str, str]) -> str:
    """The results as Markdown: run facts, targets, one table per workload and config."""
    return summary(result) + tables(result, images)


def _run_facts(result: dict) -> str:
    machine = result["machine"]
    host = ", ".join([f"{machine['cpus']} CPUs"]
                     + [f"{k} {machine[k]}" for k in ("kernel", "python") if machine.get(k)])
    return (f"Run of {result['date']} (commit {result['commit']}), size `{result['size']}`, "
            f"{host}. Remote: {result['remote']['method']}; "
            f"{result['remote']['note'].rstrip('.')}. Page cache dropped before cold epochs: "
            f"{result['page_cache_dropped']}. Cache files read into the page cache before "
            f"warm epochs: {result.get('host_cache_warmed', False)}. Wall time of the "
            f"workloads every system runs: {result['wall_s']:.0f} s.")


def summary(result: dict) -> str:
    """The run's facts and the targets with their verdicts, one row per config."""
    lines = [_run_facts(result), ""]
    lines += ["### Targets", "", "| target | workload | config | measured | met |",
              "|---|---|---|---|---|"]
    for t in result["targets"]:
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        detail = f" ({t['detail']})" if t.get("detail") else ""
        lines.append(f"| {t['target']} | {t['workload']} | {t['config']} | {_x(t['ratio'])}"
                     f"{detail} | {met} |")
    return "\n".join(lines) + "\n"


def tables(result: dict, images: dict[str, str]) -> str:
    """One table per workload and config, the failures, the systems' versions."""
    systems = result["systems"]
    lines = []
    idx = _index(result["rows"])
    groups = defaultdict(list)
    for r in result["rows"]:
        groups[(r["workload"], r["config"])].append(r)
    shown = set()
    for (workload, config), rows in groups.items():
        key, unit = HEADLINE[workload]
        lines += ["", f"### {result['workloads'].get(workload, workload)} — {config}", ""]
        if workload in images and workload not in shown:
            lines += [f"![{workload}](img/{images[workload]})", ""]
            shown.add(workload)
        lines += [f"| system | epoch | {unit} | MB/s | p50 ms | p99 ms | vs ours | hit ratio "
                  f"| CPU s/GB | remote req | remote MB | cache MiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            ours = _ours(idx, systems, r)
            epoch = f"client {r['client']}: first epoch" if r.get("client") \
                else f"{r['epoch']} ({r['phase']})"
            if "round" in r:
                epoch += f", round {r['round'] + 1}"
            lines.append(
                f"| {systems[r['system']]['label']} | {epoch} | {_fmt(r.get(key))} "
                f"| {_fmt(r['mb_per_s'])} | {_fmt(r['p50_ms'], 2)} | {_fmt(r['p99_ms'], 2)} "
                f"| {_x(_ratio(_rate(r, workload), _rate(ours, workload)))} "
                f"| {_fmt(r['hit_ratio'], 3)} | {_fmt(r['cpu_s_per_gb'])} "
                f"| {r['remote_requests']} | {_fmt(r['remote_bytes'] / 1e6)} "
                f"| {_fmt(r['cache_bytes'] / 2**20)} |")
    if result["errors"]:
        lines += ["", "### Failures", ""]
        lines += [f"- {e['workload']} {e['config']} on {e['system']}: `{_cause(e['error'])}`"
                  for e in result["errors"]]
    skipped = {n: s["unavailable"] for n, s in systems.items() if s["unavailable"]}
    lines += ["", "### Systems and versions", "", "| system | version | settings |",
              "|---|---|---|"]
    # (in the order systems run, settings by name: a table rebuilt from the
    # JSON, whose keys are sorted, reads as the run's did)
    order = {s.name: i for i, s in enumerate(all_systems())}
    for name, s in sorted(systems.items(), key=lambda kv: order.get(kv[0], len(order))):
        settings = "; ".join(f"{k}: {v}" for k, v in sorted(s["settings"].items()))
        if name in skipped:
            settings = f"**skipped**: {skipped[name]}"
        lines.append(f"| {s['label']} | {s['version']} | {settings or '–'} |")
    return "\n".join(lines) + "\n"


def _cause(error: str) -> str:
    """The exception line at the bottom of a failure (a reader's traceback ends in it)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def plot(result: dict, out_dir: str, stem: str) -> dict[str, str]:
    """One PNG per workload: bars per system, cold and warm (log scale), ratio to ours on top."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install '.[bench]'): no plots")
        return {}
    systems = result["systems"]
    paths = {}
    by_workload = defaultdict(lambda: defaultdict(list))
    for r in result["rows"]:
        by_workload[r["workload"]][r["config"]].append(r)
    for workload, configs in by_workload.items():
        key, unit = HEADLINE[workload]
        fig, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 4.2), squeeze=False)
        for ax, (config, rows) in zip(axes[0], configs.items()):
            names = list(dict.fromkeys(r["system"] for r in rows))
            series = list(dict.fromkeys(_series(r) for r in rows))
            width = 0.8 / len(series)
            for j, s in enumerate(series):
                xs, ys, notes = [], [], []
                for i, name in enumerate(names):
                    # Several rows per series (workload 1's warm epochs, workload
                    # 5's clients and rounds): their median.
                    y = _median([r.get(key) for r in rows
                                 if r["system"] == name and _series(r) == s])
                    if y:
                        ref = REFERENCE[systems[name]["kind"]]
                        ours = _median([r.get(key) for r in rows
                                        if r["system"] == ref and _series(r) == s])
                        xs.append(i + (j - (len(series) - 1) / 2) * width)
                        ys.append(y)
                        notes.append(_x(_ratio(y, ours)))
                bars = ax.bar(xs, ys, width, label=s)
                for bar, note in zip(bars, notes):
                    ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=6, rotation=90)
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels([name for name in names], rotation=40, ha="right", fontsize=8)
            ax.set_yscale("log")
            ax.set_ylabel(unit)
            ax.set_title(f"{workload}: {config}", fontsize=10)
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths[workload] = os.path.join(out_dir, f"{stem}-{workload}.png")
        fig.savefig(paths[workload], dpi=80)
        plt.close(fig)
    return paths


def _series(row: dict) -> str:
    if row.get("client"):
        return "new client, first epoch"
    return row["phase"]


def publish(paths: dict, docs_dir: str) -> None:
    """Put the run `write()` wrote into docs/: the plots into img/, the JSON beside the
    pages (bench/results is not kept in git), its facts, verdicts and every table into
    benchmarks-results.md."""
    img = os.path.join(docs_dir, "img")
    os.makedirs(img, exist_ok=True)
    shutil.copy(paths["json"], os.path.join(docs_dir, RESULTS_JSON))
    for workload, p in paths["png"].items():
        shutil.copy(p, os.path.join(img, f"bench-{workload}.png"))
    with open(paths["md"]) as f:
        body = f.read()
    with open(paths["json"]) as f:
        run = json.load(f)
    for workload, p in paths["png"].items():
        body = body.replace(f"(img/{os.path.basename(p)})", f"(img/bench-{workload}.png)")
    # The build measured comes first: a page read long after its run must not
    # pass for today's build.
    with open(os.path.join(docs_dir, RESULTS_PAGE), "w") as f:
        f.write(f"# Benchmark results\n\n<!-- generated by `python -m bench --publish` from "
                f"{RESULTS_JSON}: do not edit -->\n\n**Measured: commit {run['commit']}**, "
                f"run of {run['date']}. Every table of the run that [benchmarks.md]({PAGE}) "
                f"describes: what is measured, how to read it and how to run it are there."
                f"\n\n{body}")
