"""Every benchmark in one command: runs them one after the other, then writes one JSON file and one markdown report
with plots, saying for each performance target whether it was met and by how much it was missed.

    .venv/bin/python -m bench.report [--quick] [--litellm PATH/TO/litellm] [--out-dir bench/results]

Writes ``<out-dir>/<date>.json`` (the environment and every benchmark's figures), ``<out-dir>/<date>.md`` (the
report) and its plots, ``<out-dir>/<date>-*.png``. The benchmarks run as separate processes, alone, in this order:
the proxy overhead (``bench/proxy_overhead.py``: 1 and 2 workers, LiteLLM side by side when ``--litellm`` names
its executable, a py-spy profile of the proxy's throughput phase, where the sequential requests' time went by
gate from the proxy's analytics rows, and a bare pass-through, whose figures the latency rows show beside ours as
the floor one more hop through a Python process sets on this host), memory search at 10k and 100k memories
(``bench/memory_bench.py``), context assembly at 10k memories (``bench/context_bench.py``) and the memory of each
process (``bench/rss.py``). Each stores Postgres with the durability of production (``synchronous_commit = on``)
and records the settings it ran with; before and after each, the report times the host yardstick of
``bench/hostspeed.py`` (fixed work on one thread), since this machine's speed moves by more than its load average
shows. ``--quick`` runs smaller sizes and fewer requests (a smoke run: its figures are not the targets' sizes and
the report says so). Nothing here is a test: it never fails on a missed target.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import hostspeed

REPO = Path(__file__).resolve().parents[1]

LIBRARIES = (
    "aiohttp", "asyncpg", "redis", "hiredis", "uvloop", "orjson", "prometheus_client", "grpcio", "numpy",
    "onnxruntime", "chdb", "presidio-analyzer", "matplotlib",
)  # fmt: skip


def bench_commands(args: argparse.Namespace, json_dir: Path) -> dict[str, list[str]]:
    """name -> the command of each benchmark, writing its figures to ``json_dir/<name>.json``."""
    py = sys.executable
    quick = args.quick
    proxy = [py, "-m", "bench.proxy_overhead", "--workers", "1,2", "--json", str(json_dir / "proxy.json")]
    proxy += ["--requests", "800", "--throughput-requests", "2000", "--stream-requests", "200"] if quick else []
    proxy += ["--litellm", args.litellm] if args.litellm else []
    proxy += ["--profile", str(json_dir / "proxy-profile.txt"), "--stages", "--bare"]
    memory = [py, "bench/memory_bench.py", "--json", str(json_dir / "memory.json"), "--streams", "2"]
    small = ["--single", "50", "--searches", "100", "--small", "2000", "--big", "20000", "--noise", "4000"]
    memory += small if quick else []
    context = [py, "bench/context_bench.py", "--json", str(json_dir / "context.json")]
    context += ["--memories", "2000", "--queries", "100", "--repeats", "1"] if quick else ["--repeats", "2"]
    rss = [py, "-m", "bench.rss", "--json", str(json_dir / "rss.json")]
    rss += ["--warm", "5", "--seconds", "10"] if quick else []
    return {"proxy": proxy, "memory": memory, "context": context, "rss": rss}


def environment(args: argparse.Namespace) -> dict[str, Any]:
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], capture_output=True, text=True, cwd=REPO).stdout.strip()

    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    if args.litellm:
        python = Path(args.litellm).with_name("python")
        probe = "import importlib.metadata as m; print(m.version('litellm'))"
        done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
        versions["litellm"] = done.stdout.strip() or "unknown"
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "cpu": hostspeed.cpu(),
        "load_before": list(os.getloadavg()),
        "libraries": versions,
        "quick": args.quick,
    }


def run_benchmarks(args: argparse.Namespace, json_dir: Path, only: list[str], commit: str) -> dict[str, Any]:
    """Each benchmark alone, its output kept; returns name -> {"command", "seconds", "exit", "figures", ...}."""
    results: dict[str, Any] = {}
    for name, command in bench_commands(args, json_dir).items():
        if only and name not in only:
            continue
        print(f"== {name}: {' '.join(command)}", flush=True)
        speed_before = hostspeed.measure()
        started = time.monotonic()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        seconds = round(time.monotonic() - started, 1)
        speed_after = hostspeed.measure()
        figures_file = json_dir / f"{name}.json"
        figures = json.loads(figures_file.read_text()) if figures_file.exists() else None
        results[name] = {
            "command": " ".join(Path(c).name if c == sys.executable else c for c in command),
            "seconds": seconds,
            "exit": done.returncode,
            "host_speed": {"before": speed_before, "after": speed_after},
            "commit": commit,
            "figures": figures,
            "output": done.stdout[-20_000:],
        }
        if done.returncode != 0:
            results[name]["error"] = done.stderr[-4000:]
            print(f"   failed ({done.returncode}): {done.stderr[-800:]}", flush=True)
        profile = json_dir / "proxy-profile.txt"
        if name == "proxy" and profile.exists():
            results[name]["profile_top"] = profile_top(profile)
    return results


def profile_top(path: Path, n: int = 15) -> list[tuple[str, float]]:
    """The project's functions with the largest inclusive share of py-spy's samples (collapsed stacks)."""
    total = 0
    inclusive: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        total += int(count)
        seen = set()
        for frame in stack.split(";"):
            if "ibex_dataplane/" not in frame:
                continue
            name = frame.split(" (")[0] + " (" + frame.split("ibex_dataplane/")[1].split(":")[0] + ")"
            if name not in seen:
                seen.add(name)
                inclusive[name] = inclusive.get(name, 0) + int(count)
    ranked = sorted(inclusive.items(), key=lambda kv: -kv[1])
    skip = ("cli.py", "middleware", "create_app", "handle (", "_run (")  # the frames every request passes through
    return [(name, round(100 * c / total, 1)) for name, c in ranked if not any(s in name for s in skip)][:n]


# -- targets ----------------------------------------------------------------------------------------------------


def _get(data: Any, *path: str) -> Any:
    for part in path:
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def target_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the architecture's performance table: measured value, met or by how much missed."""
    rows: list[dict[str, Any]] = []

    def row(
        name: str,
        target: float,
        measured: float | None,
        unit: str,
        *,
        at_most: bool = True,
        why: str = "",
        floor: float | None = None,
    ) -> None:
        """``floor``: the same figure for the bare pass-through of the same run, what one more hop costs alone."""
        if measured is None:
            rows.append({"target": name, "goal": target, "unit": unit, "measured": None, "met": None, "note": why})
            return
        met = measured <= target if at_most else measured >= target
        factor = measured / target if at_most else target / measured if measured else float("inf")
        notes = [] if met else [f"missed by {abs(measured - target):.3g} {unit} ({factor:.1f}x)"]
        if floor is not None:
            notes.append(f"a bare pass-through, same run: {floor:.3g} {unit}")
        note = "; ".join(notes)
        rows.append({"target": name, "goal": target, "unit": unit, "measured": round(measured, 3), "met": met,
                     "note": note})  # fmt: skip

    proxy = _get(results, "proxy", "figures")
    added = _get(proxy, "added")
    for p, goal in (("p50", 1.0), ("p99", 3.0)):
        row(f"proxy added latency {p}", goal, _get(added, "ibex", p), "ms", why="proxy benchmark missing",
            floor=_get(added, "bare", p))  # fmt: skip
    row("requests/s of one proxy process", 3000, _get(proxy, "workers", "1", "rps"), "req/s", at_most=False,
        why="proxy benchmark missing")  # fmt: skip
    # The same target read from the process's own CPU: what it would serve with a core to itself, which this machine
    # cannot show directly (the load generator, the upstream and Postgres share its two cores).
    own_us = _get(proxy, "targets", "workers=1", "cpu_us_per_request", "proxy")
    row(
        "requests/s one proxy process serves per core-second of its own CPU (1 / CPU per request)",
        3000,
        1e6 / own_us if own_us else None,
        "req/s",
        at_most=False,
        why="no CPU figure in the proxy benchmark",
    )
    # Streaming: the client's first event should cost no more than a whole non-streamed answer does.
    first_p50 = _get(proxy, "stream", "added", "ibex", "first_p50")
    plain_p50 = _get(added, "ibex", "p50")
    events = _get(proxy, "stream", "events")
    row(f"streamed answer: added p50 to the first event, at most the non-streamed added p50 ({events or '?'} events)",
        round(plain_p50, 3) if plain_p50 is not None else 0.0, first_p50 if plain_p50 is not None else None, "ms",
        why="no streamed answers in the proxy benchmark")  # fmt: skip
    for p in ("p50", "p99"):
        row(f"added latency ours / LiteLLM, {p}", 0.1, _get(proxy, "ratio_litellm", p), "ratio",
            why="LiteLLM not measured (no --litellm)", floor=_get(proxy, "ratio_litellm_bare", p))  # fmt: skip
    memory = _get(results, "memory", "figures")
    sizes = sorted(int(k) for k in (_get(memory, "search") or {}))
    biggest = sizes[-1] if sizes else None
    label = f"memory search p95 at {biggest // 1000}k memories" if biggest else "memory search p95 at 100k"
    row(label + (" (target size 100k)" if biggest and biggest < 100_000 else ""), 20.0,
        _get(memory, "search", str(biggest), "latency", "p95"), "ms", why="memory benchmark missing")  # fmt: skip
    # One row per client shape: one batch request at a time, and N of them in flight (a bulk importer's other shape).
    bulk = sorted(((int(k.removeprefix("streams_")), v) for k, v in (_get(memory, "bulk") or {}).items()))
    for streams, figures in bulk or [(1, None)]:
        label = "bulk ingest through the proxy" + (f", {streams} batch requests in flight" if streams > 1 else "")
        row(label, 150, _get(figures, "per_second"), "memories/s", at_most=False, why="memory benchmark missing")
    context = _get(results, "context", "figures")
    repeats = list((_get(context, "repeats") or {}).values())
    p95s = [r["assembly"]["p95"] for r in repeats]
    n = _get(context, "memories")
    row(f"context assembly p95 at {n // 1000 if n else '?'}k memories (median of repeats)", 25.0,
        sorted(p95s)[len(p95s) // 2] if p95s else None, "ms", why="context benchmark missing")  # fmt: skip
    return rows


# -- plots ------------------------------------------------------------------------------------------------------


def plots(results: dict[str, Any], prefix: Path) -> list[tuple[str, str]]:
    """(title, file name) of each plot written next to the report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[tuple[str, str]] = []

    def save(fig: Any, suffix: str, title: str) -> None:
        path = prefix.with_name(f"{prefix.name}-{suffix}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append((title, path.name))

    proxy = _get(results, "proxy", "figures")
    targets = _get(proxy, "targets") or {}
    if targets:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, data in targets.items():
            samples = sorted(data["latency"].get("samples_ms", []))
            if samples:
                ax.plot(samples, [(i + 1) / len(samples) for i in range(len(samples))], label=name)
        ax.set_xscale("log")
        ax.set_xlabel("latency per request, ms (log)")
        ax.set_ylabel("share of requests")
        ax.set_title("Chat completion latency: upstream direct, through IBEX, through LiteLLM")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        save(fig, "proxy-latency", "Latency distributions (sequential requests, interleaved rounds)")
    workers = _get(proxy, "workers") or {}
    if workers:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        counts = sorted(workers, key=int)
        ax.bar([str(c) for c in counts], [workers[c]["rps"] for c in counts])
        ax.set_xlabel("proxy workers")
        ax.set_ylabel("successful requests/s")
        ax.set_title("Throughput vs workers")
        save(fig, "proxy-workers", "Throughput vs workers")
    memory = _get(results, "memory", "figures")
    search = _get(memory, "search") or {}
    if search:
        sizes = sorted(search, key=int)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for q in ("p50", "p95", "p99"):
            ax.plot([int(s) for s in sizes], [search[s]["latency"][q] for s in sizes], marker="o", label=q)
        ax.axhline(20, linestyle="--", color="grey", label="p95 target")
        ax.set_xscale("log")
        ax.set_xlabel("memories of the agent (log)")
        ax.set_ylabel("search latency through the proxy, ms")
        ax.set_title("Memory search latency vs memories")
        ax.legend()
        save(fig, "search", "Search latency vs memories")
    context = _get(results, "context", "figures")
    repeats = _get(context, "repeats") or {}
    if repeats:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, data in repeats.items():
            ax.hist(data["assembly"]["samples_ms"], bins=40, alpha=0.5, label=f"repeat {int(key) + 1}")
        ax.axvline(25, linestyle="--", color="green", label="p95 target 25 ms")
        ax.axvline(40, linestyle="--", color="red", label="production deadline 40 ms")
        ax.set_xlabel("context assembly over gRPC, ms")
        ax.set_ylabel("assemblies")
        ax.set_title("Context assembly latency")
        ax.legend()
        save(fig, "context", "Context assembly latency")
    return made


# -- report -----------------------------------------------------------------------------------------------------


def markdown(env: dict[str, Any], results: dict[str, Any], rows: list[dict[str, Any]], images: list[Any]) -> str:
    out = [f"# Benchmark report, {env['date']}", ""]
    dirty = " (with uncommitted changes)" if env["dirty"] else ""
    cpu_model = f", {env['cpu']}" if env.get("cpu") else ""  # reports written before the field have none
    out.append(f"Commit `{env['commit'][:12]}`{dirty}; Python {env['python']} on {env['cores']} cores "
               f"({env['machine']}{cpu_model}); load average before {_load(env['load_before'])}.")  # fmt: skip
    if env["quick"]:
        out.append("\n**Quick run**: smaller sizes and fewer requests than the targets name; a smoke run, not figures.")
    out.append("\nLibraries: " + ", ".join(f"{k} {v}" for k, v in env["libraries"].items()) + ".")
    out += ["", "## Targets", "", "| target | goal | measured | met | note |", "|---|---|---|---|---|"]
    for r in rows:
        met = "n/a" if r["met"] is None else "yes" if r["met"] else "no"
        measured = "-" if r["measured"] is None else f"{r['measured']:g} {r['unit']}"
        out.append(f"| {r['target']} | {r['goal']:g} {r['unit']} | {measured} | {met} | {r['note']} |")
    out += ["", "## Runs", "",
            "The host yardstick (`bench/hostspeed.py`) times the same fixed work on one thread before and after each "
            "benchmark, lower is faster: figures of two runs compare only when their yardsticks agree, since this "
            "machine's speed moves by more than the load average shows.", ""]  # fmt: skip
    for name, res in results.items():
        if res.get("earlier"):
            out.append(f"- **{name}**: kept from an earlier run of this report ({res['earlier']}, commit "
                       f"`{res.get('commit', '?')[:12]}`):")  # fmt: skip
        figures = res.get("figures") or {}
        load = figures.get("load_before"), figures.get("load_after")
        durability = figures.get("durability", {})
        speed = res.get("host_speed") or {}
        yardstick = f"before {hostspeed.describe(speed.get('before'))}, after {hostspeed.describe(speed.get('after'))}"
        out.append(f"- **{name}**: `{res['command']}`, {res['seconds']} s, exit {res['exit']}; load average before "
                   f"{_load(load[0])}, after {_load(load[1])}; host yardstick {yardstick}; "
                   f"Postgres {_durability(durability)}")  # fmt: skip
    proxy = results.get("proxy", {})
    if proxy.get("profile_top"):
        out += ["", "## What dominates the proxy's cost", "",
                "Inclusive share of py-spy samples of the proxy process during the throughput phase "
                "(the project's functions; the frames every request passes through are left out):", ""]  # fmt: skip
        out += [f"- {share:.1f} % {name}" for name, share in proxy["profile_top"]]
    stages = _get(proxy, "figures", "stages", "ibex")
    if stages:
        out += ["", "## Where the proxy's latency goes", "",
                "Server side, the sequential requests through `ibex dev` (the latency phase), from the analytics rows "
                "the proxy wrote for them: each gate, the upstream call, and the rest of the request's time (its "
                "handling outside the gates and the call). Milliseconds, by p99:", "",
                "| part | p50 | p99 | max |", "|---|---|---|---|"]  # fmt: skip
        ranked = sorted(stages.items(), key=lambda kv: (kv[0] != "request", -kv[1]["p99"]))
        out += [f"| {name} | {v['p50']:.3f} | {v['p99']:.3f} | {v['max']:.2f} |" for name, v in ranked]
    streamed = _get(proxy, "figures", "stream", "added")
    if streamed:
        out += ["", "## Streamed answers", "",
                f"{_get(proxy, 'figures', 'stream', 'method')}. Milliseconds added over the direct upstream, to the "
                "first event and to the end of the stream, and microseconds added per relayed event:", "",
                "| target | first p50 | first p99 | end p50 | end p99 | per event |",
                "|---|---|---|---|---|---|"]  # fmt: skip
        out += [f"| {name} | {v['first_p50']:.3f} | {v['first_p99']:.3f} | {v['end_p50']:.3f} | {v['end_p99']:.3f}"
                f" | {v['per_event_us']:.1f} us |" for name, v in streamed.items()]  # fmt: skip
    cpu = {name: t["cpu_us_per_request"] for name, t in (_get(proxy, "figures", "targets") or {}).items()
           if t.get("cpu_us_per_request")}  # fmt: skip
    if cpu:
        out += ["", "## CPU per request by process", "",
                "Core-microseconds of each process per request of the throughput phase, from /proc (proxy: the "
                "process serving the target; its children: the processes it started, such as workers and the "
                "embedded ClickHouse engine; client: the load generator):", ""]  # fmt: skip
        out += [f"- {name}: " + ", ".join(f"{role} {us:.0f}" for role, us in by.items()) for name, by in cpu.items()]
    phases = _get(results, "memory", "figures", "search")
    if phases:
        out += ["", "## Where search time goes", ""]
        for size, data in sorted(phases.items(), key=lambda kv: int(kv[0])):
            parts = ", ".join(f"{k} {v:.2f} ms" for k, v in data.get("phases_ms", {}).items())
            ties = data.get("ann_recall_at_10_ties")
            tied = f" ({ties:.3f} counting ties at the 10th distance)" if ties is not None else ""
            out.append(f"- {int(size) // 1000}k memories: mean per phase in the memory stage: {parts}; "
                       f"filtered ANN recall@10 {data.get('ann_recall_at_10', float('nan')):.3f}{tied}")  # fmt: skip
            cpu = data.get("cpu_ms_per_search")
            if cpu:
                spent = ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())
                rate = data.get("query_cache_hit_rate", 0)
                out.append(f"  - CPU per search (core-ms, of 2 cores): {spent}; total {sum(cpu.values()):.1f}; "
                           f"query cache hit rate of the distinct queries {rate:.3f}")  # fmt: skip
            loop = data.get("tool_loop")
            if loop:
                out.append(f"  - a tool loop (each query asked three times in a row): first ask p50 "
                           f"{loop['first']['p50']:.1f} / p95 {loop['first']['p95']:.1f} ms, repeats p50 "
                           f"{loop['repeats']['p50']:.1f} / p95 {loop['repeats']['p95']:.1f} ms")  # fmt: skip
    repeats = _get(results, "context", "figures", "repeats")
    if repeats:
        out += ["", "## Where context assembly time goes", ""]
        for key, data in repeats.items():
            parts = ", ".join(f"{k} {v:.2f} ms" for k, v in data["phases_median_ms"].items())
            out.append(f"- repeat {int(key) + 1}: p50 {data['assembly']['p50']:.1f} ms, p95 "
                       f"{data['assembly']['p95']:.1f} ms; median per phase: {parts}; over the 40 ms deadline: "
                       f"{data['over_deadline']}/{data['assembly']['n']}")  # fmt: skip
    rss = _get(results, "rss", "figures", "processes_mib")
    if rss:
        out += ["", "## Memory per process (MiB)", "", "| process | idle | warm | under load | peak |",
                "|---|---|---|---|---|"]  # fmt: skip
        out += [f"| {k} | {v['idle']} | {v['warm']} | {v['load_max']} | {v['peak_hwm']} |" for k, v in rss.items()]
    if images:
        out += ["", "## Plots", ""]
        out += [f"![{title}]({name})" for title, name in images]
    out += ["", "Each benchmark's own output is kept in the JSON file under its name (`output`)."]
    return "\n".join(out) + "\n"


def _load(values: Any) -> str:
    return ", ".join(f"{v:.2f}" for v in values) if values else "?"


def _durability(settings: dict[str, str]) -> str:
    if not settings:
        return "durability not recorded"
    return ", ".join(f"{k} = {v}" for k, v in settings.items())


def machine_paths_hidden(text: str, tmp: str, litellm: str | None = None) -> str:
    """The report is committed: the paths of this machine in commands, outputs and tracebacks become names (LiteLLM's
    executable: ``PATH/TO/litellm``)."""
    named = [(tmp, "<tmp>"), (str(REPO), "<repo>"), (sys.base_prefix, "<python>"), (sys.prefix, "<venv>")]
    if litellm:
        named.insert(0, (litellm, "PATH/TO/litellm"))
    for path, name in [*named, (str(Path.home()), "~")]:
        text = text.replace(path, name)
    return re.sub(r"/tmp/ibex-[A-Za-z0-9_-]+", "<tmp>", text)  # scratch folders, also of the runs a report kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer requests (a smoke run)")
    parser.add_argument("--litellm", default=None, help="path of a `litellm` executable to measure side by side")
    parser.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    parser.add_argument(
        "--only", default="",
        help="comma-separated subset (proxy, memory, context, rss); the others are kept from the day's report, or "
        "else from the latest earlier one",
    )  # fmt: skip
    args = parser.parse_args()
    env = environment(args)
    only = [n for n in args.only.split(",") if n]
    with tempfile.TemporaryDirectory(prefix="ibex-report-") as tmp:
        results = run_benchmarks(args, Path(tmp), only, env["commit"])
        scratch = tmp
    env["load_after"] = list(os.getloadavg())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    prefix = args.out_dir / env["date"][:10]
    # A partial run: the rest comes from the day's report, or else from the latest earlier one (marked as kept).
    reports = sorted(p for p in args.out_dir.glob("????-??-??.json") if p.stem <= prefix.name)
    if only and reports:
        earlier = json.loads(reports[-1].read_text())
        for name, res in earlier["benchmarks"].items():
            if name not in results:
                kept = {**res, "earlier": res.get("earlier") or earlier["environment"]["date"]}
                if not res.get("earlier") and "commit" not in res:  # run by that report, at its commit
                    kept["commit"] = earlier["environment"].get("commit", "?")
                results[name] = kept
    rows = target_rows(results)
    images = plots(results, prefix)
    document = {"environment": env, "targets": rows, "benchmarks": results}
    text = json.dumps(document, indent=1, default=str) + "\n"
    prefix.with_suffix(".json").write_text(machine_paths_hidden(text, scratch, args.litellm))
    prefix.with_suffix(".md").write_text(
        machine_paths_hidden(markdown(env, results, rows, images), scratch, args.litellm)
    )
    print(f"wrote {prefix.with_suffix('.md')} and {prefix.with_suffix('.json')}", flush=True)
    failed = [name for name, res in results.items() if res["exit"] != 0]
    if failed:
        print(f"benchmarks that failed: {', '.join(failed)} (see the JSON file)", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
