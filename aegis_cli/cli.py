"""The ``aegis`` command line: click commands only.

Each command parses its options, calls one library function, renders the result
(render.py: the tables, the progress bar) and maps errors to exit codes (errors.ExitCode).
The library never prints or exits.
"""

from __future__ import annotations

import sys
import traceback

import click
from rich.console import Console
from rich.markup import escape

from aegis_cli import render
from aegis_cli import report as report_mod
from aegis_cli.backends.threads import apply_thread_policy
from aegis_cli.ops import files, provenance
from aegis_cli.ops.errors import AegisError, ExitCode
from aegis_cli.probes import DEFAULT_IN_FULL, DEFAULT_PROBES, DEFAULT_RERUNS
from aegis_cli.render import err_console


class State:
    debug = False


def _fail(message: str, code: int = ExitCode.UNKNOWN) -> None:
    # escape: messages quote hostile input (bundle fields, paths) that must not act as rich markup
    err_console.print(f"[bold red]Error:[/] {escape(message)}", highlight=False, markup=True, soft_wrap=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(provenance.tool_version(), prog_name="aegis")
def cli(debug: bool) -> None:
    """aegis: find GPUs that silently compute wrong numbers.

    Exit codes: 0 healthy, 1 suspect, 2 faulty, 3 unknown (error, bad input, no device).
    """
    State.debug = debug


def _writable(_ctx, _param, path: str | None) -> str | None:
    """Option callback of every output path: checked before any work, so a typo cannot cost a finished scan."""
    if path:
        files.check_writable(path)
    return path


@cli.command()
@click.option("--device", "devices", default="auto", show_default=True,
              help="auto, all, cpu, cuda, cpu:N, cuda:N or a comma-separated list.")
@click.option("--workload", default=None, help="Catalog name (see `aegis info`) or path to a workload YAML. "
              "Default: cpu-quick on CPUs, llama3-70b on GPUs.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of every input (0…2147483647); recorded in the report.")
@click.option("--case", default=None, help="Re-run exactly one case id from a report.")
@click.option("--reruns", default=DEFAULT_RERUNS, show_default=True, type=int, help="Re-runs of a flagged case to confirm it (1…1000).")
@click.option("--inject", default=None, metavar="SPEC", help="Inject faults on purpose (self-test); see docs/fault-injection.md.")
@click.option("--save-vtasks", "save_vtasks", default=None, metavar="PATH", callback=_writable,
              help="Save the flagged GEMM and attention cases shown in full (see --evidence-in-full) as vTasks in a bundle (aegis replay).")
@click.option("--format", "fmt", type=click.Choice(report_mod.FORMATS), default="table", show_default=True)
@click.option("--output", "-o", default=None, metavar="PATH", callback=_writable,
              help="Write the report here (atomically) instead of stdout.")
@click.option("--probes", default=",".join(DEFAULT_PROBES), show_default=True, help="Comma-separated probes to run.")
@click.option("--golden", default=None, metavar="FILE", help="Compare fingerprints against a golden file (aegis golden record).")
@click.option("--probe-option", "probe_options", multiple=True, metavar="PROBE.KEY=VALUE",
              help="Probe setting, repeatable, e.g. memory.mode=full (docs/probes.md).")
@click.option("--threshold", default=None, type=float, help="Threshold τ in units of the device's calibrated noise (default 3.5, docs/calibration.md).")
@click.option("--confirm-margin", default=None, type=float, help="How far over τ a reproducible flag must be to count as FAULTY, below it SUSPECT (default 1).")
@click.option("--fail-fast", is_flag=True, help="Stop each device at its first confirmed FAULTY (the report names what was skipped).")
@click.option("--evidence-in-full", default=DEFAULT_IN_FULL, show_default=True, type=int, metavar="N",
              help="Once a probe has confirmed FAULTY: flagged cases shown in full; the rest are counted.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--soak", default=None, metavar="DURATION", help="Instead of the probes, a checked burn-in for DURATION "
              "(10s, 2m, 1h): the workload's GEMMs back to back, every launch checked (docs/soak.md).")
def scan(devices, workload, seed, case, reruns, inject, save_vtasks, probes, golden, probe_options, threshold, confirm_margin, fmt, output,
         fail_fast, evidence_in_full, quiet, soak):
    """Scan this node's devices with checked training-shaped GEMMs and attention and print a verdict per device."""
    from aegis_cli.scan import ScanOptions, run_scan, scan_thresholds

    apply_thread_policy()
    opts = ScanOptions(devices=devices, workload=workload, seed=seed, reruns=reruns, inject=inject, case=case,
                       probes=tuple(p.strip() for p in probes.split(",") if p.strip()), golden=golden,
                       thresholds=scan_thresholds(threshold, confirm_margin), command_line=["aegis", *sys.argv[1:]], keep_flagged=bool(save_vtasks),
                       fail_fast=fail_fast, evidence_in_full=evidence_in_full)
    for item in probe_options:
        key, eq, value = item.partition("=")
        if not eq:
            raise click.BadParameter(f"expected PROBE.KEY=VALUE, got {item!r}", param_hint="--probe-option")
        opts.probe_options[key.strip()] = value.strip()
    if soak is not None:
        from aegis_cli.soak.record import parse_duration
        from aegis_cli.soak.run import SoakOptions, run_soak

        sopts = SoakOptions(seconds=parse_duration(soak), devices=devices, workload=workload, seed=seed, reruns=reruns, inject=inject,
                            thresholds=opts.thresholds, command_line=opts.command_line, case=case, keep_flagged=opts.keep_flagged,
                            golden=golden, probe_options=opts.probe_options, fail_fast=fail_fast,
                            probes=() if probes == ",".join(DEFAULT_PROBES) else opts.probes)
        rep = render.run_with_progress(run_soak, sopts, inject, quiet)
        render.emit(rep.to_dict(), fmt, output, render.soak_table)
        render.warn_never_fired(rep)
        sys.exit(rep.exit_code)
    rep = render.run_with_progress(run_scan, opts, inject, quiet)
    # the report first: a bundle that cannot be saved must not cost the scan's verdict
    render.emit(rep.to_dict(), fmt, output, render.verdict_table)
    render.warn_never_fired(rep)
    if save_vtasks:
        from aegis_cli.vtask.from_scan import save_scan_vtasks

        try:
            n = save_scan_vtasks(rep, save_vtasks)
        except AegisError as exc:
            if State.debug:
                traceback.print_exc()
            _fail(f"--save-vtasks: the report is out, but the vTasks were not saved: {exc}")
        err_console.print(f"saved {n} vTask(s) to {save_vtasks}", highlight=False)
    sys.exit(rep.exit_code)


@cli.command()
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def info(fmt):
    """Devices and backends found, versions, probes, kernels, and where caches live."""
    from aegis_cli.info import gather

    render.emit(gather(), fmt, None, render.info_table)


@cli.command()
@click.argument("bundles", nargs=-1, required=True, metavar="BUNDLE...")
@click.option("--device", "devices", default="auto", show_default=True,
              help="auto, all, cpu, cuda, cpu:N, cuda:N or a comma-separated list.")
@click.option("--repeat", default=3, show_default=True, type=int, help="Runs of each vTask per input scale, compared bit for bit.")
@click.option("--scales", default="0,0;-8,8;8,-8", show_default=True, metavar="EA,EB;...",
              help="Power-of-two input scales relative to the captured inputs (A·2^EA, B·2^EB); exact expectations.")
@click.option("--inject", default=None, metavar="SPEC", help="Inject faults on purpose (self-test); see docs/fault-injection.md.")
@click.option("--max-bundle-size", "max_bundle_size", default=None, type=int, metavar="BYTES",
              help="Refuse bundles larger than this (default 2 GiB, or AEGIS_BUNDLE_MAX_BYTES).")
@click.option("--format", "fmt", type=click.Choice(report_mod.FORMATS), default="table", show_default=True)
@click.option("--output", "-o", default=None, metavar="PATH", callback=_writable,
              help="Write the report here (atomically) instead of stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def replay(bundles, devices, repeat, scales, inject, max_bundle_size, fmt, output, quiet):
    """Replay the vTasks of bundles (aegis scan --save-vtasks) and say where the fault lies."""
    from aegis_cli.vtask.replay import ReplayOptions, parse_scales, run_replay

    apply_thread_policy()
    opts = ReplayOptions(bundles=list(bundles), devices=devices, repeat=repeat, scales=parse_scales(scales), inject=inject,
                         max_bundle_bytes=max_bundle_size, command_line=["aegis", *sys.argv[1:]])
    rep = render.run_with_progress(run_replay, opts, inject, quiet)
    render.emit(rep.to_dict(), fmt, output, render.replay_table)
    render.warn_never_fired(rep)
    sys.exit(rep.exit_code)


def _stop_on_signals():
    """SIGTERM/SIGINT set a flag the sweep checks while its workers run (raising from the
    handler could land inside an import or SQLite call); a second signal exits at once."""
    import signal

    seen: list[str] = []

    def handler(signum, frame):
        if seen:
            raise SystemExit(ExitCode.UNKNOWN)
        seen.append(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return lambda: seen[0] if seen else None


@cli.command()
@click.option("--config", "config_path", required=True, metavar="SWEEP.YAML", help="Sweep configuration (examples/sweep.yaml).")
@click.option("--log-format", type=click.Choice(["logfmt", "json"]), default="logfmt", show_default=True,
              help="Structured log lines on stderr.")
@click.option("--format", "fmt", type=click.Choice(["auto", "table", "json", "none"]), default="auto", show_default=True,
              help="What goes to stdout: auto = a table on a terminal, nothing otherwise (cron, systemd).")
def sweep(config_path, log_format, fmt):
    """Sweep every local device (one worker per device), record history, apply the quarantine policy."""
    from aegis_cli.fleet.config import load_config
    from aegis_cli.fleet.sweep import run_sweep

    cfg = load_config(config_path)
    outcome = run_sweep(cfg, render.sweep_logger(log_format), stop=_stop_on_signals())
    doc = outcome.fleet or outcome.doc
    if fmt == "json":
        click.echo(report_mod.render(doc, "json"), nl=False)
    elif fmt == "table" or (fmt == "auto" and sys.stdout.isatty()):
        render.fleet_table(Console(), doc)
    sys.exit(outcome.exit_code)


@cli.command()
@click.option("--config", "config_path", default=None, metavar="SWEEP.YAML", help="Take the database path and policy from this config.")
@click.option("--db", default=None, metavar="PATH", help="History database (default: history.path of --config).")
@click.option("--device", "ident", default=None, help="One device: UUID, serial, UUID prefix, or an id like cuda:0.")
@click.option("--since", default=None, help="Only results since: 30d, 12h, 90m or an ISO date.")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True)
@click.option("--retire", default=None, metavar="REASON",
              help="Mark the --device gone (replaced, RMA'd): it leaves the quarantine list until it reports results again.")
@click.option("--coverage", is_flag=True, help="Per device: seeds and scale bands visited, sweeps, launches checked, failing runs.")
def history(config_path, db, ident, since, fmt, retire, coverage):
    """A device's record: verdicts over time, failure rate with counts and a 95% bound, quarantine state."""
    from aegis_cli.fleet.summary import history_csv, show_history

    doc, retired = show_history(db, config_path, ident, since, retire)
    if retired:
        err_console.print(f"retired {retired}: off the quarantine list from the next export, until it reports again", highlight=False)
    if fmt in ("json", "csv"):
        click.echo(report_mod.render(doc, "json") if fmt == "json" else history_csv(doc, coverage), nl=False)
        return
    (render.coverage_table if coverage else render.history_table)(Console(), doc)


@cli.command("report")
@click.argument("files", nargs=-1, required=True, metavar="REPORT.json...")
@click.option("--format", "fmt", type=click.Choice(report_mod.FORMATS), default="table", show_default=True)
@click.option("--output", "-o", default=None, metavar="PATH", callback=_writable,
              help="Write the fleet report here (atomically) instead of stdout.")
def report_cmd(files, fmt, output):
    """Merge per-node JSON reports (scan or sweep) into one fleet table; compares the fingerprints of sweeps across devices."""
    from aegis_cli.fleet.merge import merge

    doc = merge(list(files))
    render.emit(doc, fmt, output, render.fleet_table)
    sys.exit(doc["exit_code"])


@cli.group()
def golden() -> None:
    """Golden fingerprints of the canonical workloads (docs/fingerprints.md)."""


@golden.command("record")
@click.option("--device", "devices", default="auto", show_default=True, help="Devices to record on (assumed known-good).")
@click.option("--seed", default=None, type=int, help="Seed of the canonical inputs (default: the golden seed).")
@click.option("--output", "-o", required=True, metavar="FILE", callback=_writable, help="Golden file to write (JSON, atomically).")
def golden_record(devices, seed, output):
    """Record fingerprints of the canonical workloads, keyed by GPU model, driver, CUDA, torch and kernel hash."""
    from aegis_cli.backends import resolve_devices
    from aegis_cli.probes import golden_file as golden_mod

    apply_thread_policy()
    doc = golden_mod.record(resolve_devices(devices), golden_mod.GOLDEN_SEED if seed is None else seed)
    golden_mod.save(doc, output)
    render.golden_table(Console(stderr=True), doc, output)


def main(argv: list[str] | None = None) -> None:
    """Entry point: usage errors, AegisErrors and unexpected exceptions become one line and exit 3."""
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
    except Exception as exc:  # a bug of ours: never exit 1 (that means SUSPECT) or dump a traceback unasked
        if State.debug:
            traceback.print_exc()
        what = " ".join(str(exc).split())[:300]  # one line, whatever the exception says
        _fail(f"internal error: {type(exc).__name__}: {what} (a bug in aegis: rerun with --debug for the traceback "
              "and report it)", ExitCode.UNKNOWN)
    sys.exit(0)
