"""The ``aegis`` command line: click commands only.

Each command parses its options, calls one library function, renders the result with
rich and maps errors to exit codes (errors.ExitCode). The library never prints or exits.
"""

from __future__ import annotations

import io
import sys
import traceback

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from aegis_cli import report as report_mod
from aegis_cli.errors import AegisError, ExitCode
from aegis_cli.probes import DEFAULT_PROBES

VERDICT_STYLE = {"HEALTHY": "bold green", "SUSPECT": "bold yellow", "FAULTY": "bold red", "ERROR": "bold magenta"}
err_console = Console(stderr=True)


class State:
    debug = False


def _fail(message: str, code: int = ExitCode.UNKNOWN) -> None:
    err_console.print(f"[bold red]Error:[/] {message}", highlight=False, markup=True, soft_wrap=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(report_mod.tool_version(), prog_name="aegis")
def cli(debug: bool) -> None:
    """aegis: find GPUs that silently compute wrong numbers.

    Exit codes: 0 healthy, 1 suspect, 2 faulty, 3 unknown (error, bad input, no device).
    """
    State.debug = debug


def _emit(doc: dict, fmt: str, output: str | None, table_fn) -> None:
    if fmt == "table":
        console = Console(file=io.StringIO(), record=True, width=140) if output else Console()
        table_fn(console, doc)
        if output:
            report_mod.atomic_write(output, console.export_text())
        return
    text = report_mod.render(doc, fmt)
    if output:
        report_mod.atomic_write(output, text)
    else:
        click.echo(text, nl=False)


def _verdict_table(console: Console, doc: dict) -> None:
    title = f"aegis {doc['kind']} — seed {doc['seed']}"
    if doc.get("fault_injected"):
        title += "  [bold red](FAULTS INJECTED ON PURPOSE)[/]"
    t = Table(title=title, title_justify="left")
    for col in ("device", "verdict", "GEMMs", "noise margin", "evidence", "time"):
        t.add_column(col, no_wrap=True)
    t.add_column("name / uuid", overflow="fold")
    for d in doc["devices"]:
        noise = d.get("noise") or {}
        margin = noise.get("margin")
        t.add_row(d["device"]["id"], f"[{VERDICT_STYLE[d['verdict']]}]{d['verdict']}[/]",
                  str((d.get("stats") or {}).get("gemms", "")),
                  f"{margin:.0f}×" if isinstance(margin, (int, float)) else "—",
                  str(len(d["evidence"])), f"{d['timings']['seconds']:.1f}s",
                  f"{d['device']['name']}\n{d['device']['uuid']}")
    console.print(t)
    for d in doc["devices"]:
        if d.get("error"):
            console.print(f"[bold magenta]{d['device']['id']} ERROR:[/] {d['error']}", highlight=False)
        for e in d["evidence"][:10]:
            style = VERDICT_STYLE[e["severity"]]
            where = f" tiles {e['tiles'][:4]}" if e.get("tiles") else ""
            sms = f" SMs {e['sms'][:8]}" if e.get("sms") else ""
            console.print(f"[{style}]{e['severity']}[/] {d['device']['id']} {e['case_id']}\n    {e['summary']}{where}{sms}", highlight=False)
        if len(d["evidence"]) > 10:
            console.print(f"    … {len(d['evidence']) - 10} more evidence records (use --format json)")
    if any(d["evidence"] for d in doc["devices"]):
        console.print(f"Re-run one case: aegis scan --seed {doc['seed']} --case CASE_ID", highlight=False)


def _thresholds(tau: float | None, margin: float | None):
    from aegis_cli.numerics import Thresholds

    base = Thresholds()
    return Thresholds(tau=base.tau if tau is None else tau, tau_bf16=base.tau_bf16,
                      confirm_margin=base.confirm_margin if margin is None else margin)


def _progress_callback(progress: Progress | None):
    task = {}

    def cb(event: str, **info) -> None:
        if progress is None:
            return
        if event == "start":
            task["id"] = progress.add_task("scanning", total=info["total"])
        elif event == "case" and "id" in task:
            progress.update(task["id"], advance=1, description=f"{info['device']} {info['case'][:60]}")
    return cb


@cli.command()
@click.option("--device", "devices", default="auto", show_default=True,
              help="auto, all, cpu, cuda, cpu:N, cuda:N or a comma-separated list.")
@click.option("--workload", default=None, help="Catalog name (see `aegis info`) or path to a workload YAML. "
              "Default: cpu-quick on CPUs, llama3-70b on GPUs.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of every input; recorded in the report.")
@click.option("--case", default=None, help="Re-run exactly one case id from a report.")
@click.option("--reruns", default=5, show_default=True, type=int, help="Re-runs of a flagged case to confirm it.")
@click.option("--inject", default=None, metavar="SPEC", help="Inject faults on purpose (self-test); see docs/fault-injection.md.")
@click.option("--save-vtasks", "save_vtasks", default=None, metavar="PATH", help="Save every flagged case as vTasks in a bundle.")
@click.option("--format", "fmt", type=click.Choice(report_mod.FORMATS), default="table", show_default=True)
@click.option("--output", "-o", default=None, metavar="PATH", help="Write the report here (atomically) instead of stdout.")
@click.option("--probes", default=",".join(DEFAULT_PROBES), show_default=True, help="Comma-separated probes to run.")
@click.option("--golden", default=None, metavar="FILE", help="Compare fingerprints against a golden file (aegis golden record).")
@click.option("--threshold", default=None, type=float, help="Normalised checksum threshold τ (default: calibrated, see docs/calibration.md).")
@click.option("--confirm-margin", default=None, type=float, help="How far over τ a reproducible flag must be to count as FAULTY.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def scan(devices, workload, seed, case, reruns, inject, save_vtasks, probes, golden, threshold, confirm_margin, fmt, output, quiet):
    """Scan this node's devices with checked training-shaped GEMMs and print a verdict per device."""
    from aegis_cli.scan import ScanOptions, run_scan

    opts = ScanOptions(devices=devices, workload=workload, seed=seed, reruns=reruns, inject=inject, case=case,
                       probes=tuple(p.strip() for p in probes.split(",") if p.strip()), golden=golden,
                       thresholds=_thresholds(threshold, confirm_margin), command_line=["aegis", *sys.argv[1:]])
    if inject:
        from aegis_cli.inject import parse_spec

        parse_spec(inject)  # bad specs fail before any work
        err_console.print(f"[bold red]FAULT INJECTION ACTIVE:[/] {inject} — results below are a self-test, not a diagnosis",
                          highlight=False)
    show = not quiet and err_console.is_terminal
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True, disable=not show) as progress:
        rep = run_scan(opts, _progress_callback(progress if show else None))
    doc = rep.to_dict()
    if save_vtasks:
        from aegis_cli.vtask import save_scan_vtasks

        n = save_scan_vtasks(rep, opts, save_vtasks)
        err_console.print(f"saved {n} vTask(s) to {save_vtasks}", highlight=False)
    _emit(doc, fmt, output, _verdict_table)
    sys.exit(rep.exit_code)


@cli.command()
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def info(fmt):
    """Devices and backends found, versions, kernels, and where caches live."""
    from aegis_cli.info import gather

    doc = gather()
    if fmt == "json":
        click.echo(report_mod.to_json(report_mod.sanitize(doc)), nl=False)
        return
    console = Console()
    t = Table(title="aegis info", title_justify="left", show_header=False)
    t.add_column("key")
    t.add_column("value", overflow="fold")
    for k, v in doc["versions"].items():
        t.add_row(k, v)
    for b in doc["backends"]:
        t.add_row(f"backend {b['name']}", "available" if b["available"] else f"unavailable ({b.get('reason', '')})")
    for d in doc["devices"]:
        t.add_row(d["id"], f"{d['name']}  uuid {d['uuid']}")
    for k, v in doc["paths"].items():
        t.add_row(k, v)
    t.add_row("workloads", ", ".join(doc["workloads"]))
    for k, v in doc["kernel_hashes"].items():
        t.add_row(f"kernel {k}", v)
    console.print(t)


def main(argv: list[str] | None = None) -> None:
    """Entry point: usage errors and AegisErrors become one line and exit 3."""
    try:
        cli.main(args=argv, prog_name="aegis", standalone_mode=False)
    except click.exceptions.Abort:
        _fail("aborted", ExitCode.UNKNOWN)
    except click.ClickException as exc:  # usage errors: bad option, missing argument
        _fail(exc.format_message())
    except AegisError as exc:
        if State.debug:
            traceback.print_exc()
        _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted", ExitCode.UNKNOWN)
    sys.exit(0)
