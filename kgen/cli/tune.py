"""`kgen tune` and `kgen report`: tune a spec with a live progress display; render the
tuning table and a PNG plot of time per config per bucket (the chosen config highlighted)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from kgen.build import select_backend
from kgen.cli.common import SEED, err, guard, load_specs, out
from kgen.errors import KgenUserError
from kgen.tune.ray_executor import connect, require_ray
from kgen.tune.results import device_info, read_results, results_path
from kgen.tune.runner import DEFAULT_BUDGET_S, tune_spec
from kgen.tune.search import parse_buckets


def _fmt(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "inf"
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def _ckey(config: dict, keys: set[str] | None = None) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(config.items()) if keys is None or k in keys)


def _varying(configs: list[dict]) -> set[str]:
    """The parameters whose value differs between configs (all of them when none does): the table's rows."""
    keys = {k for c in configs for k in c}
    return {k for k in keys if len({c.get(k) for c in configs}) > 1} or keys


@click.command()
@click.argument("spec")
@click.option("--backend", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--buckets", default=None, metavar="BATCHES x CONTEXTS",
              help="shape buckets, e.g. '1,8x128,1024' (default: the spec's, else the backend's)")
@click.option("--budget-s", type=float, default=None,
              help=f"time budget of the whole run in seconds, compiles included (default {DEFAULT_BUDGET_S:g})")
@click.option("--measure-s", type=float, default=None, help="timing budget per (config, bucket)")
@click.option("--strategy", type=click.Choice(["auto", "exhaustive", "hillclimb"]), default="auto", show_default=True)
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="where measurements run (ray: one task per GPU on an existing Ray cluster)")
@click.option("--ray-address", default=None, metavar="HOST:PORT",
              help="the Ray cluster to join (implies --executor ray; default: RAY_ADDRESS, else a local one)")
@click.option("--seed", type=SEED, default=None)
@click.option("--json", "as_json", is_flag=True, help="print the results as JSON")
@guard
def tune(spec, backend, buckets, budget_s, measure_s, strategy, executor, ray_address, seed, as_json):
    """Time every config of SPEC's tuning space over shape buckets; save the results."""
    (loaded,) = load_specs((spec,))
    parsed = parse_buckets(buckets) if buckets else None
    if ray_address is not None:
        executor = "ray"
    if executor == "ray":
        require_ray()
    if ray_address is not None:
        resources = connect(ray_address).cluster_resources()
        err.print(f"ray: joined the cluster at {ray_address}: {resources.get('CPU', 0):g} CPUs, "
                  f"{resources.get('GPU', 0):g} GPUs", markup=False)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        bar = progress.add_task(f"{loaded.name}: configs x buckets", total=None)

        def update(record, state):
            line = progress_line(record, state)
            if line:
                progress.console.print(line, markup=False, highlight=False)
            best = ", ".join(f"{b}: {_fmt(t)} ({_ckey(c)})" for b, (t, c) in sorted(state["best"].items())[:3])
            progress.update(bar, completed=state["done"] + state["not_run"],
                            total=max(state["planned"], state["done"] + state["not_run"]),
                            description=f"{loaded.name}: configs x buckets  best {best or '-'}")

        results = tune_spec(loaded, backend=backend, buckets=parsed, budget_s=budget_s or DEFAULT_BUDGET_S,
                            strategy=strategy, executor=executor, measure_s=measure_s, seed=seed, progress=update)
    if as_json:
        click.echo(json.dumps(results, indent=1, sort_keys=True))
        return
    print_table(results)
    out.print(f"saved {results_path(loaded, device_info(results['device']['backend']))}", markup=False)


def progress_line(record: dict, state: dict) -> str | None:
    """One line per measurement as it finishes (stderr): what it did and how long the run has taken;
    one line when the budget is first found spent."""
    at = f"[{state['elapsed_s']:7.1f} s] {state['done']}/{state['planned']}"
    where = f"{_ckey(record['config'])} @ {record['batch']}x{record['context']}"
    if record["status"] == "not_run":
        stopped = f"{at} {where}: {record['reason']}\n" if record["reason"].startswith("stopped") else ""
        return f"{stopped}{at} budget spent: no new measurements" if state["not_run"] == 1 else None
    compiled = f"built in {record.get('compile_s', 0.0):.1f} s"  # compile, or load of a cached build
    if record["status"] == "ok":
        return (f"{at} {where}: {compiled}, timed {record['reps']} launches (median {_fmt(record['median_s'])}), "
                "output verified")
    return f"{at} {where}: {compiled}, {record['status']}: {record['reason']}"


def print_table(results: dict) -> None:
    buckets = [f"{b}x{c}" for b in results["buckets"]["batch"] for c in results["buckets"]["context"]]
    dev = results["device"]
    title = (f"{results['spec_name']} on {dev.get('name')} ({results['clock']}; {results['strategy']}, "
             f"{len(results['measurements'])} measurements)")
    table = Table(title=title, caption="columns: batch x context; median per launch; * = the bucket's winner; "
                                       "parameters not shown are the same in every row")
    shown = _varying([m["config"] for m in results["measurements"]])
    table.add_column("config", no_wrap=True)
    for b in buckets:
        table.add_column(b, justify="right", no_wrap=True)
    cells: dict[str, dict[str, str]] = {}
    for m in results["measurements"]:
        row = cells.setdefault(_ckey(m["config"], shown), {})
        b = f"{m['batch']}x{m['context']}"
        if m["status"] == "ok":
            win = results["winners"].get(b)
            text = _fmt(m["median_s"])
            row[b] = f"[bold green]{text} *[/bold green]" if win == m["config"] else text
        else:
            row[b] = f"[red]{m['status']}[/red]"
    for key, row in cells.items():
        table.add_row(key, *(row.get(b, "-") for b in buckets))
    out.print(table)
    pruned = results["space"]["pruned"]
    failed = {(_ckey(m["config"]), m["status"], m["reason"]) for m in results["measurements"]
              if m["status"] not in ("ok", "pruned")}
    by_ptxas = sum(p["reason"].startswith("ptxas advisory") for p in pruned)
    out.print(f"{len(results['space']['configs']) + len(pruned)} configs: {len(pruned) - by_ptxas} pruned before "
              f"compiling, {by_ptxas} pruned by a ptxas advisory, "
              f"{len({f[0] for f in failed})} failed (compile/resources/launch/wrong output); * = bucket winner; "
              f"single-config choice: {_ckey(results['default_winner'])}", markup=False)
    for p in pruned:
        out.print(f"  pruned {_ckey(p['config'])}: {p['reason']}", markup=False)
    for key, status, reason in sorted(failed):
        out.print(f"  {status} {key}: {reason}", markup=False)
    if results.get("not_run"):
        out.print(f"budget spent: {len(results['measurements'])} measurements in {results['seconds']:.1f} s "
                  f"(budget {results['budget_s']:g} s); {results['not_run']} planned ones not run: the winners are "
                  "the best of what was measured (raise --budget-s for more)", markup=False)
    else:
        out.print(f"{len(results['measurements'])} measurements in {results['seconds']:.1f} s "
                  f"(budget {results['budget_s']:g} s)", markup=False)
    if results.get("note"):
        out.print(f"note: {results['note']}", markup=False)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = [(b, c) for b in results["buckets"]["batch"] for c in results["buckets"]["context"]]
    index = {b: i for i, b in enumerate(buckets)}
    series: dict[str, list[float]] = {}
    for m in results["measurements"]:
        ys = series.setdefault(_ckey(m["config"]), [math.nan] * len(buckets))
        if m["status"] == "ok":
            ys[index[(m["batch"], m["context"])]] = m["median_s"] * 1e3
    fig, ax = plt.subplots(figsize=(max(6, len(buckets) * 0.9), 4.5))
    for key, ys in series.items():
        ax.plot(range(len(buckets)), ys, marker="o", lw=1, alpha=0.6, label=key)
    chosen = []
    for i, (b, c) in enumerate(buckets):
        win = results["winners"].get(f"{b}x{c}")
        y = series.get(_ckey(win), [math.nan] * len(buckets))[i] if win else math.nan
        chosen.append(y)
    ax.plot(range(len(buckets)), chosen, ls="none", marker="*", ms=16, color="crimson", label="chosen (per bucket)")
    ax.set_xticks(range(len(buckets)), [f"{b}x{c}" for b, c in buckets], rotation=45)
    ax.set_yscale("log")
    ax.set_xlabel("bucket (batch x context)")
    ax.set_ylabel(f"median time per launch, ms ({results['clock']})")
    ax.set_title(f"{results['spec_name']} on {results['device'].get('name')}")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@click.command()
@click.argument("spec")
@click.option("--backend", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--results", "results_file", type=click.Path(), default=None,
              help="a results JSON or a generated manifest.json (default: this device's saved results)")
@click.option("--png", "png", type=click.Path(), default=None, help="plot path (default: <name>.tuning.png)")
@guard
def report(spec, backend, results_file, png):
    """Render SPEC's tuning table and a PNG plot (time per config per bucket)."""
    (loaded,) = load_specs((spec,))
    path = Path(results_file) if results_file else results_path(loaded, device_info(select_backend(backend)))
    if not results_file and not path.exists():
        raise KgenUserError(f"{loaded.name}: no tuning results for this device at {path} (run `kgen tune {spec}`)")
    results = read_results(path)
    if results.get("spec_hash") != loaded.spec_hash():
        err.print(f"warning: {path} was tuned for a different version of {loaded.name} (spec hash differs)",
                  markup=False)
    print_table(results)
    written = plot(results, Path(png) if png else Path(f"{loaded.name}.tuning.png"))
    out.print(f"plot: {written}", markup=False)
