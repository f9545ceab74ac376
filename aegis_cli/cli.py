"""The ``aegis`` command line: click commands only.

Each command parses its options, calls one library function, renders the result with
rich and maps errors to exit codes (errors.ExitCode). The library never prints or exits.
"""

from __future__ import annotations

import io
import shlex
import sys
import traceback

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from aegis_cli import report as report_mod
from aegis_cli.ops import files, provenance
from aegis_cli.ops.errors import AegisError, ExitCode
from aegis_cli.probes import DEFAULT_PROBES

SCAN_RERUNS = 5  # the --reruns default, left out of the re-run command
VERDICT_STYLE = {"HEALTHY": "bold green", "SUSPECT": "bold yellow", "FAULTY": "bold red", "ERROR": "bold magenta"}
err_console = Console(stderr=True)


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
    """Option callback of every output path: checked while the command line is parsed, before
    any work, so a typo cannot cost a finished scan (report.check_writable)."""
    if path:
        files.check_writable(path)
    return path


def _emit(doc: dict, fmt: str, output: str | None, table_fn) -> None:
    if fmt == "table":
        console = Console(file=io.StringIO(), record=True, width=140) if output else Console()
        table_fn(console, doc)
        if output:
            files.atomic_write(output, console.export_text())
        return
    text = report_mod.render(doc, fmt)
    if output:
        files.atomic_write(output, text)
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
    for command in _rerun_commands(doc):
        # soft_wrap: a command broken over lines by the console would not paste back whole
        console.print(f"Re-run one case: {escape(command)}", highlight=False, soft_wrap=True)


def _rerun_commands(doc: dict) -> list[str]:
    """For each device with evidence, the scan command that re-runs its first case exactly as it
    was judged: seed, device(s), workload, golden file, the case's probe options, thresholds
    (repr: ``:g`` rounded them), re-runs and injected faults; defaults left out. No --probes:
    --case runs the probe that owns the case and nothing else (scan.run_scan)."""
    from aegis_cli.faults.spec import parse_spec
    from aegis_cli.ops.numerics import Thresholds
    from aegis_cli.probes import NODE_PROBES, case_probe, load_all

    load_all()
    o, th, q = doc.get("options") or {}, Thresholds(), shlex.quote
    scanned = [d["device"]["id"] for d in doc["devices"]]
    faults = [f for spec in doc.get("injected") or [] for f in parse_spec(spec)]
    commands = []
    for d in doc["devices"]:
        if not d["evidence"]:
            continue
        case = d["evidence"][0]["case_id"]
        probe = case_probe(case)
        devices = [d["device"]["id"]]
        # a node probe compares them all; and faults aimed at other devices keep their places in
        # the --inject spec (the seeds of their positions) only when those devices are scanned too
        if probe in NODE_PROBES or any(f.params.get("device") not in (None, *devices) for f in faults):
            devices = scanned
        sims = [int(i.split(":", 1)[1]) for i in devices if i.startswith("cpu:") and i[4:].isdigit()]
        env = f"AEGIS_CPU_DEVICES={max(sims) + 1} " if sims and max(sims) > 0 else ""  # simulated CPU devices
        parts = [f"{env}aegis scan", f"--seed {doc['seed']}", f"--device {q(','.join(devices))}"]
        if o.get("workload"):
            parts.append(f"--workload {q(str(o['workload']))}")
        if o.get("golden"):
            parts.append(f"--golden {q(str(o['golden']))}")
        for key, value in (o.get("probe_options") or {}).items():
            if key.split(".", 1)[0] == probe:
                parts.append(f"--probe-option {q(f'{key}={value}')}")
        if o.get("threshold") not in (None, th.tau):
            parts.append(f"--threshold {o['threshold']!r}")
        if o.get("confirm_margin") not in (None, th.confirm_margin):
            parts.append(f"--confirm-margin {o['confirm_margin']!r}")
        if o.get("reruns") not in (None, SCAN_RERUNS):
            parts.append(f"--reruns {o['reruns']}")
        parts += [f"--inject {q(spec)}" for spec in doc.get("injected") or []]
        parts.append(f"--case {q(case)}")
        commands.append(" ".join(parts))
    return list(dict.fromkeys(commands))  # devices that share a case and device list share its command


def _thresholds(tau: float | None, margin: float | None):
    from aegis_cli.ops.numerics import Thresholds

    base = Thresholds()
    return Thresholds(tau=base.tau if tau is None else tau, tau_bf16=base.tau_bf16,
                      confirm_margin=base.confirm_margin if margin is None else margin)


def _run_with_progress(run, opts, inject: str | None, quiet: bool):
    """Validate an injection (before any work), then ``run(opts, progress)`` with a progress bar
    on a terminal; the injection is announced when the work starts, after the run's own checks,
    so a refused run prints its one error line and nothing else."""
    banner = None
    if inject is not None:  # --inject '' (an unset $SPEC) is refused, not a silent run without faults
        from aegis_cli.faults.spec import parse_spec

        parse_spec(inject)
        banner = f"[bold red]FAULT INJECTION ACTIVE:[/] {escape(inject)} — results below are a self-test, not a diagnosis"
    show = not quiet and err_console.is_terminal
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True, disable=not show) as progress:
        return run(opts, _progress_callback(progress if show else None, banner))


def _warn_never_fired(rep) -> None:
    for spec in rep.never_fired or []:
        err_console.print(f"[bold yellow]Warning:[/] injected fault {escape(spec)!r} never fired (its device=/op= matched nothing "
                          "this run checked, or it changed no element there): the verdicts above are no self-test of it",
                          highlight=False, soft_wrap=True)


def _progress_callback(progress: Progress | None, banner: str | None = None):
    task = {}

    def cb(event: str, **info) -> None:
        if event == "start" and banner:
            err_console.print(banner, highlight=False)
        if progress is None:
            return
        if event == "start":
            task["id"] = progress.add_task("scanning", total=info["total"])
        elif event in ("case", "step") and "id" in task:  # a step (non-GEMM probes) is not one of the counted cases
            progress.update(task["id"], advance=1 if event == "case" else 0, description=f"{info['device']} {info['case'][:60]}")
    return cb


@cli.command()
@click.option("--device", "devices", default="auto", show_default=True,
              help="auto, all, cpu, cuda, cpu:N, cuda:N or a comma-separated list.")
@click.option("--workload", default=None, help="Catalog name (see `aegis info`) or path to a workload YAML. "
              "Default: cpu-quick on CPUs, llama3-70b on GPUs.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of every input (0…2147483647); recorded in the report.")
@click.option("--case", default=None, help="Re-run exactly one case id from a report.")
@click.option("--reruns", default=SCAN_RERUNS, show_default=True, type=int, help="Re-runs of a flagged case to confirm it (1…1000).")
@click.option("--inject", default=None, metavar="SPEC", help="Inject faults on purpose (self-test); see docs/fault-injection.md.")
@click.option("--save-vtasks", "save_vtasks", default=None, metavar="PATH", callback=_writable,
              help="Save every flagged GEMM case as vTasks in a bundle (aegis replay).")
@click.option("--format", "fmt", type=click.Choice(report_mod.FORMATS), default="table", show_default=True)
@click.option("--output", "-o", default=None, metavar="PATH", callback=_writable,
              help="Write the report here (atomically) instead of stdout.")
@click.option("--probes", default=",".join(DEFAULT_PROBES), show_default=True, help="Comma-separated probes to run.")
@click.option("--golden", default=None, metavar="FILE", help="Compare fingerprints against a golden file (aegis golden record).")
@click.option("--probe-option", "probe_options", multiple=True, metavar="PROBE.KEY=VALUE",
              help="Probe setting, repeatable, e.g. memory.mode=full (docs/probes.md).")
@click.option("--threshold", default=None, type=float, help="Floor of the normalised checksum threshold τ (default 1e-6; see docs/calibration.md).")
@click.option("--confirm-margin", default=None, type=float, help="How far over τ a reproducible flag must be to count as FAULTY, below it SUSPECT (default 1).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def scan(devices, workload, seed, case, reruns, inject, save_vtasks, probes, golden, probe_options, threshold, confirm_margin, fmt, output, quiet):
    """Scan this node's devices with checked training-shaped GEMMs and print a verdict per device."""
    from aegis_cli.scan import ScanOptions, run_scan

    opts = ScanOptions(devices=devices, workload=workload, seed=seed, reruns=reruns, inject=inject, case=case,
                       probes=tuple(p.strip() for p in probes.split(",") if p.strip()), golden=golden,
                       thresholds=_thresholds(threshold, confirm_margin), command_line=["aegis", *sys.argv[1:]], keep_flagged=bool(save_vtasks))
    for item in probe_options:
        key, eq, value = item.partition("=")
        if not eq:
            raise click.BadParameter(f"expected PROBE.KEY=VALUE, got {item!r}", param_hint="--probe-option")
        opts.probe_options[key.strip()] = value.strip()
    rep = _run_with_progress(run_scan, opts, inject, quiet)
    # the report first: a bundle that cannot be saved must not cost the scan's verdict
    _emit(rep.to_dict(), fmt, output, _verdict_table)
    _warn_never_fired(rep)
    if save_vtasks:
        from aegis_cli.vtask.capture import save_scan_vtasks

        try:
            n = save_scan_vtasks(rep, opts, save_vtasks)
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

    doc = gather()
    if fmt == "json":
        click.echo(report_mod.render(doc, "json"), nl=False)
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
    for p in doc["probes"]:
        t.add_row(f"probe {p['name']}", p["summary"] + ("  (default)" if p["default"] else ""))
    for k, v in doc["kernel_hashes"].items():
        t.add_row(f"kernel {k}", v)
    console.print(t)


# ==== aegis replay: vTask bundles (issue 3; library: aegis_cli/replay.py) =====================
_OUTCOME_STYLE = {"reproduced": "bold red", "not_reproduced": "bold green", "inconsistent": "bold magenta"}
_REPLAY_ROWS = 40  # per-vTask rows shown in the table; --format json has them all


def _replay_table(console: Console, doc: dict) -> None:
    title = f"aegis replay — {doc['options']['vtasks']} vTask(s) × {doc['options']['repeat']} run(s) per scale"
    if doc.get("fault_injected"):
        title += "  [bold red](FAULTS INJECTED ON PURPOSE)[/]"
    t = Table(title=title, title_justify="left")
    for col in ("device", "name", "uuid", "verdict", "reproduced", "not reproduced", "inconsistent", "GEMMs", "time"):
        t.add_column(col, overflow="fold")
    for d in doc["devices"]:
        r = (d.get("probes") or {}).get("replay", {})
        t.add_row(d["device"]["id"], d["device"]["name"], d["device"]["uuid"], f"[{VERDICT_STYLE[d['verdict']]}]{d['verdict']}[/]",
                  str(r.get("reproduced", 0)), str(r.get("not_reproduced", 0)), str(r.get("inconsistent", 0)),
                  str((d.get("stats") or {}).get("gemms", "")), f"{d['timings']['seconds']:.1f}s")
    console.print(t)
    v = Table(title="vTasks", title_justify="left")
    for col in ("device", "vTask", "captured check", "outcome", "checks fired here", "matches capture", "severity"):
        v.add_column(col, overflow="fold")
    shown, meanings = 0, {}
    for d in doc["devices"]:
        if d.get("error"):
            console.print(f"[bold magenta]{d['device']['id']} ERROR:[/] {d['error']}", highlight=False)
        for o in (d.get("probes") or {}).get("replay", {}).get("outcomes", []):
            meanings.setdefault((d["device"]["id"], o["label"], o["meaning"]), 0)
            meanings[(d["device"]["id"], o["label"], o["meaning"])] += 1
            if shown >= _REPLAY_ROWS:
                continue
            shown += 1
            mc = {True: "yes", False: "no", None: "—"}[o["matches_capture"]]
            v.add_row(d["device"]["id"], o["id"], o["check"], f"[{_OUTCOME_STYLE[o['outcome']]}]{o['label']}[/]",
                      ", ".join(o["checks_fired"]) or "—", mc, f"[{VERDICT_STYLE[o['severity']]}]{o['severity']}[/]")
    console.print(v)
    total = sum(meanings.values())
    if total > shown:
        console.print(f"    … {total - shown} more vTasks (use --format json)")
    console.print("What it means:")
    for (dev, label, meaning), count in meanings.items():
        console.print(f"  {dev}: {count} vTask(s) {label} — {escape(meaning)}", highlight=False)


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

    opts = ReplayOptions(bundles=list(bundles), devices=devices, repeat=repeat, scales=parse_scales(scales), inject=inject,
                         max_bundle_bytes=max_bundle_size, command_line=["aegis", *sys.argv[1:]])
    rep = _run_with_progress(run_replay, opts, inject, quiet)
    _emit(rep.to_dict(), fmt, output, _replay_table)
    _warn_never_fired(rep)
    sys.exit(rep.exit_code)
# ==== end of aegis replay =====================================================================


# ---- fleet: sweep, history, report (issue 6; library in aegis_cli/fleet, guide in docs/fleet.md) ----------
def _sweep_logger(fmt: str):
    """Structured log lines on stderr (logfmt or JSON lines): no colours, no progress bars."""
    from aegis_cli.fleet.sweep import log_line

    def log(event: str, level: str = "info", **kv) -> None:
        click.echo(log_line(event, level, fmt, **kv), err=True)
    return log


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


def _fleet_table(console: Console, doc: dict) -> None:
    title = f"aegis {doc['kind']} — {len(doc['devices'])} device(s)"
    if doc.get("fault_injected"):
        title += "  [bold red](FAULTS INJECTED ON PURPOSE)[/]"
    t = Table(title=title, title_justify="left")
    for col in ("host", "device", "uuid", "verdict", "own verdict", "state", "evidence", "error"):
        t.add_column(col, overflow="fold")
    policy = doc.get("policy") or {}
    for d in doc["devices"]:
        own = d.get("local_verdict", d["verdict"])
        st = policy.get(d["device"]["uuid"], {})
        t.add_row(d["device"].get("host", ""), d["device"]["id"], d["device"]["uuid"], f"[{VERDICT_STYLE[d['verdict']]}]{d['verdict']}[/]",
                  own, st.get("state", ""), str(len(d.get("evidence") or [])), (d.get("error") or "")[:80])
    console.print(t)
    for d in doc["devices"]:
        for e in (d.get("evidence") or [])[:5]:
            console.print(f"[{VERDICT_STYLE[e['severity']]}]{e['severity']}[/] {d['device'].get('host', '')}/{d['device']['id']} "
                          f"{e['check']} {e['case_id']}\n    {e['summary']}", highlight=False)
    cmp_ = doc.get("comparison")
    if cmp_:
        console.print(f"cross-device comparison: [bold]{cmp_['outcome']}[/] — {cmp_['note']}", highlight=False)


@cli.command()
@click.option("--config", "config_path", required=True, metavar="SWEEP.YAML", help="Sweep configuration (examples/sweep.yaml).")
@click.option("--log-format", type=click.Choice(["logfmt", "json"]), default="logfmt", show_default=True,
              help="Structured log lines on stderr.")
@click.option("--format", "fmt", type=click.Choice(["auto", "table", "json", "none"]), default="auto", show_default=True,
              help="What goes to stdout: auto = a table on a terminal, nothing otherwise (cron, systemd).")
def sweep(config_path, log_format, fmt):
    """Sweep every local device (one worker per device), record history, apply the quarantine policy."""
    from aegis_cli.fleet.sweep import load_config, run_sweep

    cfg = load_config(config_path)
    outcome = run_sweep(cfg, _sweep_logger(log_format), stop=_stop_on_signals())
    doc = outcome.fleet or outcome.doc
    if fmt == "json":
        click.echo(report_mod.render(doc, "json"), nl=False)
    elif fmt == "table" or (fmt == "auto" and sys.stdout.isatty()):
        _fleet_table(Console(), doc)
    sys.exit(outcome.exit_code)


@cli.command()
@click.option("--config", "config_path", default=None, metavar="SWEEP.YAML", help="Take the database path and policy from this config.")
@click.option("--db", default=None, metavar="PATH", help="History database (default: history.path of --config).")
@click.option("--device", "ident", default=None, help="One device: UUID, serial, UUID prefix, or an id like cuda:0.")
@click.option("--since", default=None, help="Only results since: 30d, 12h, 90m or an ISO date.")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True)
@click.option("--retire", default=None, metavar="REASON",
              help="Mark the --device gone (replaced, RMA'd): it leaves the quarantine list until it reports results again.")
def history(config_path, db, ident, since, fmt, retire):
    """A device's record: verdicts over time, failure rate with counts and a 95% bound, quarantine state."""
    import time as _time

    from aegis_cli.fleet.summary import history_csv, show_history

    doc, retired = show_history(db, config_path, ident, since, retire)
    if retired:
        err_console.print(f"retired {retired}: off the quarantine list from the next export, until it reports again", highlight=False)
    if fmt in ("json", "csv"):
        click.echo(report_mod.render(doc, "json") if fmt == "json" else history_csv(doc), nl=False)
        return
    console = Console()
    t = Table(title=f"aegis history — {doc['database']}", title_justify="left")
    for col in ("uuid", "serial", "last seen on", "state", "record", "last verdict"):
        t.add_column(col, overflow="fold")
    for d in doc["devices"]:
        state = d["state"] + (f" ({d['clean_streak']} clean)" if d["state"] != "ACTIVE" else "")
        t.add_row(d["uuid"], d.get("serial") or "", f"{d.get('last_host', '')} {d.get('last_id', '')}", state, d["summary"],
                  d["last_verdict"] or "")
    console.print(t)
    for d in doc["devices"]:
        if d.get("reason"):
            console.print(f"{d['uuid']}: {d['reason']}", highlight=False)
        for r in d.get("results", []):
            when = _time.strftime("%Y-%m-%d %H:%M:%S", _time.localtime(r["ts"]))
            style = VERDICT_STYLE.get(r["verdict"], "")
            console.print(f"  {when}  {r['host']} {r['device']}  [{style}]{r['verdict']}[/]  {' '.join(r['checks'])} {r['error'] or ''}",
                          highlight=False)


@cli.command("report")
@click.argument("files", nargs=-1, required=True, metavar="REPORT.json...")
@click.option("--format", "fmt", type=click.Choice(report_mod.FORMATS), default="table", show_default=True)
@click.option("--output", "-o", default=None, metavar="PATH", callback=_writable,
              help="Write the fleet report here (atomically) instead of stdout.")
def report_cmd(files, fmt, output):
    """Merge per-node JSON reports (scan or sweep) into one fleet table; compares the fingerprints of sweeps across devices."""
    from aegis_cli.fleet.merge import merge

    doc = merge(list(files))
    _emit(doc, fmt, output, _fleet_table)
    sys.exit(doc["exit_code"])
# ---- end fleet ---------------------------------------------------------------------------------------------


# -- golden fingerprints -----------------------------------------------------------------
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

    doc = golden_mod.record(resolve_devices(devices), golden_mod.GOLDEN_SEED if seed is None else seed)
    golden_mod.save(doc, output)
    t = Table(title=f"golden fingerprints → {output}", title_justify="left")
    for col in ("key", "devices", "computations", "outputs"):
        t.add_column(col, overflow="fold")
    for r in doc["records"]:
        k = r["key"]
        t.add_row(f"{k['model']} · driver {k.get('driver')} · cuda {k.get('cuda')} · torch {k['torch']} · kernels {k['kernels']}",
                  str(len(r["devices"])), ", ".join(r["computations"]),
                  str(sum(len(c["outputs"]) for c in r["computations"].values())))
    Console(stderr=True).print(t)


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
