"""Rich output of the ``aegis`` commands: tables, the progress bar, warnings (cli.py draws with
these; with cli.py, the only importer of rich). Each table takes the report document the
library returned, the same dict the JSON format prints.

Importing this module touches no torch: the library is imported where a table needs it.
"""

from __future__ import annotations

import io
import time

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from aegis_cli import report as report_mod
from aegis_cli.ops import files

VERDICT_STYLE = {"HEALTHY": "bold green", "SUSPECT": "bold yellow", "FAULTY": "bold red", "ERROR": "bold magenta"}
INJECTED = ("  (FAULTS INJECTED ON PURPOSE)", "bold red")
err_console = Console(stderr=True)

# Every string that comes from a report (host and workload names, errors, summaries, merged
# reports from other nodes) is drawn as Text, never parsed as markup: "[/bold]" in a host name
# would end a style that was never opened (an error), "[green]fine[/green]" would lose its brackets.


def _lit(value: object) -> Text:
    return Text("" if value is None else str(value))


def _verdict(word: str, styles: dict[str, str] = VERDICT_STYLE) -> Text:
    return Text(str(word), style=styles.get(word, ""))


def _title(text: str, injected: bool) -> Text:
    return Text.assemble(text, INJECTED) if injected else Text(text)


def emit(doc: dict, fmt: str, output: str | None, table_fn) -> None:
    """``doc`` as ``fmt`` to ``output`` (atomically) or stdout; "table" draws it with ``table_fn(console, doc)``."""
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


def verdict_table(console: Console, doc: dict) -> None:
    """``aegis scan``: a row per device, its error and first evidence, and how to re-run a case."""
    from aegis_cli.scan import rerun_commands  # imports torch: only when a scan table is drawn

    _device_rows(console, doc)
    for command in rerun_commands(doc):
        # soft_wrap: a command broken over lines by the console would not paste back whole
        console.print(_lit(f"Re-run one case: {command}"), highlight=False, soft_wrap=True)


def _device_rows(console: Console, doc: dict) -> None:
    """A row per device of a scan report, then each device's error and first evidence."""
    t = Table(title=_title(f"aegis {doc['kind']} — seed {doc['seed']}", doc.get("fault_injected")), title_justify="left")
    for col in ("device", "verdict", "GEMMs", "noise margin", "evidence", "time"):
        t.add_column(col, no_wrap=True)
    t.add_column("name / uuid", overflow="fold")
    for d in doc["devices"]:
        noise = d.get("noise") or {}
        margin = noise.get("margin")
        t.add_row(_lit(d["device"]["id"]), _verdict(d["verdict"]),
                  _lit((d.get("stats") or {}).get("gemms", "")),
                  f"{margin:.0f}×" if isinstance(margin, (int, float)) else "—",
                  str(len(d["evidence"])), f"{d['timings']['seconds']:.1f}s",
                  _lit(f"{d['device']['name']}\n{d['device']['uuid']}"))
    console.print(t)
    for d in doc["devices"]:
        if d.get("error"):
            console.print(Text.assemble((f"{d['device']['id']} ERROR:", "bold magenta"), f" {d['error']}"), highlight=False)
        for e in d["evidence"][:10]:
            where = f" tiles {e['tiles'][:4]}" if e.get("tiles") else ""
            sms = f" SMs {e['sms'][:8]}" if e.get("sms") else ""
            console.print(Text.assemble(_verdict(e["severity"]), f" {d['device']['id']} {e['case_id']}\n    {e['summary']}{where}{sms}"),
                          highlight=False)
        if len(d["evidence"]) > 10:
            console.print(f"    … {len(d['evidence']) - 10} more evidence records (use --format json)")
        _confirmation_lines(console, d)


def _span(v: dict | None, unit: str) -> str:
    return "—" if not v else f"{v['start']:g} / {v['min']:g} / {v['peak']:g} / {v['end']:g} {unit}"


def soak_table(console: Console, doc: dict) -> None:
    """``aegis scan --soak``: the verdicts, then per device the burn-in's launches, failures
    ("k of n"), TFLOP/s, clocks, temperature, power and throttling, and how to re-run a failing launch."""
    _device_rows(console, doc)
    for d in doc["devices"]:
        s = d.get("soak")
        if not s:
            continue
        f, tel, cov = s["failures"], s["telemetry"], s["coverage"]
        rates = [i["tflops"] for i in s["intervals"]]
        t = Table(title=_lit(f"{d['device']['id']} burn-in — {s['elapsed']:.0f} s of {s['seconds']:g} s"), title_justify="left",
                  show_header=False)
        t.add_column("what")
        t.add_column("value", overflow="fold")
        t.add_row("launches checked", _lit(f"{s['launches']} ({s['input_sets']} input sets, {cov['shapes']} shapes, "
                                           f"{cov['scales']} scales: 2^ea {cov['ea']}, 2^eb {cov['eb']})"))
        t.add_row("failed", Text(f"{f['launches']} of {f['of']} launches", style="bold red" if f["launches"] else "bold green"))
        t.add_row("TFLOP/s", _lit(f"{s['tflops'] or 0:.3g} sustained" + (f"; per interval {min(rates):.3g}…{max(rates):.3g}"
                                                                           f" over {len(rates)}" if rates else "")))
        if tel["available"]:
            t.add_row("SM clock start/min/peak/end", _span(tel["sm_clock_mhz"], "MHz"))
            t.add_row("temperature", _span(tel["temperature_c"], "°C"))
            t.add_row("power", _span(tel["power_w"], "W") + (f" (limit {tel['power_limit_w']:g} W)" if tel["power_limit_w"] else ""))
            t.add_row("throttle reasons (samples)", _lit(", ".join(f"{k} ({v})" for k, v in tel["throttle"].items()) or "none"))
        else:
            t.add_row("telemetry", _lit(f"not available: {tel['reason']}"))
        console.print(t)
        for x in f["first"][:3]:
            console.print(_lit(f"Re-run failing launch {x['launch']}: {x['command']}"), highlight=False, soft_wrap=True)


def _confirmation_lines(console: Console, d: dict) -> None:
    """A device's "k of n launches", its flagged cases beyond those shown in full, and what
    --fail-fast skipped."""
    c = d.get("confirmation") or {}
    probes = (c.get("probes") or {}).values()
    flagged = sum(p["flagged_cases"] for p in probes)
    if c.get("failed_launches"):
        console.print(_lit(f"    failed {c['failed_launches']} of {c['launches']} launches checked; {flagged} flagged case(s), "
                           f"{sum(p['evidence_in_full'] for p in probes)} in full (every case's count: --format json)"),
                      highlight=False)
    stop = c.get("fail_fast") or {}
    if stop.get("stopped_at"):
        skipped = sum(len(p["skipped_cases"]) for p in probes)
        console.print(_lit(f"    --fail-fast: stopped at {stop['stopped_at']}; skipped {skipped} case(s)"
                           + (f" and probe(s) {', '.join(stop['skipped_probes'])}" if stop["skipped_probes"] else "")),
                      highlight=False)


def run_with_progress(run, opts, inject: str | None, quiet: bool):
    """Validate an injection (before any work), then ``run(opts, progress)`` with a progress bar
    on a terminal; the injection is announced when the work starts, after the run's own checks,
    so a refused run prints its one error line and nothing else."""
    banner = None
    if inject is not None:  # --inject '' (an unset $SPEC) is refused, not a silent run without faults
        from aegis_cli.faults.spec import parse_spec

        parse_spec(inject)
        banner = Text.assemble(("FAULT INJECTION ACTIVE:", "bold red"), f" {inject} — results below are a self-test, not a diagnosis")
    show = not quiet and err_console.is_terminal
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True, disable=not show) as progress:
        return run(opts, _progress_callback(progress if show else None, banner))


def warn_never_fired(rep) -> None:
    for spec in rep.never_fired or []:
        err_console.print(Text.assemble(("Warning:", "bold yellow"), f" injected fault {spec!r} never fired (its device=/op= matched "
                                        "nothing this run checked, or it changed no element there): the verdicts above are no "
                                        "self-test of it"),
                          highlight=False, soft_wrap=True)


def _progress_callback(progress: Progress | None, banner: Text | None = None):
    task = {}

    def cb(event: str, **info) -> None:
        if event == "start" and banner:
            err_console.print(banner, highlight=False)
        if progress is None:
            return
        if event == "start":
            task["id"] = progress.add_task("scanning", total=info["total"])
            if info.get("soak"):  # a burn-in counts seconds, device after device, each its share of the total
                task["share"], task["done"] = info["total"] / max(len(info["devices"]), 1), 0.0
        elif event in ("case", "step") and "id" in task:  # a step (non-GEMM probes) is not one of the counted cases
            progress.update(task["id"], advance=1 if event == "case" else 0, description=f"{info['device']} {info['case'][:60]}")
        elif event == "soak" and "id" in task:
            progress.update(task["id"], completed=task["done"] + min(info["elapsed"], info["seconds"]),
                            description=f"{info['device']} soak: {info['launches']} launches, {info['tflops']:.1f} TFLOP/s, "
                                        f"{info['failures']} failed")
        elif event == "device_done" and "share" in task:  # also a device that ended before its first soak event
            task["done"] += task["share"]
            progress.update(task["id"], completed=task["done"])
    return cb


_OUTCOME_STYLE = {"reproduced": "bold red", "not_reproduced": "bold green", "inconsistent": "bold magenta"}
_REPLAY_ROWS = 40  # per-vTask rows shown in the table; --format json has them all
FLEET_ROWS = 200  # devices shown in a fleet table; --format json and csv have them all


def replay_table(console: Console, doc: dict) -> None:
    title = f"aegis replay — {doc['options']['vtasks']} vTask(s) × {doc['options']['repeat']} run(s) per scale"
    t = Table(title=_title(title, doc.get("fault_injected")), title_justify="left")
    for col in ("device", "name", "uuid", "verdict", "reproduced", "not reproduced", "inconsistent", "GEMMs", "time"):
        t.add_column(col, overflow="fold")
    for d in doc["devices"]:
        r = (d.get("probes") or {}).get("replay", {})
        t.add_row(_lit(d["device"]["id"]), _lit(d["device"]["name"]), _lit(d["device"]["uuid"]), _verdict(d["verdict"]),
                  str(r.get("reproduced", 0)), str(r.get("not_reproduced", 0)), str(r.get("inconsistent", 0)),
                  _lit((d.get("stats") or {}).get("gemms", "")), f"{d['timings']['seconds']:.1f}s")
    console.print(t)
    v = Table(title="vTasks", title_justify="left")
    for col in ("device", "vTask", "captured check", "outcome", "checks fired here", "matches capture", "severity"):
        v.add_column(col, overflow="fold")
    shown, meanings = 0, {}
    for d in doc["devices"]:
        if d.get("error"):
            console.print(Text.assemble((f"{d['device']['id']} ERROR:", "bold magenta"), f" {d['error']}"), highlight=False)
        for o in (d.get("probes") or {}).get("replay", {}).get("outcomes", []):
            meanings.setdefault((d["device"]["id"], o["label"], o["meaning"]), 0)
            meanings[(d["device"]["id"], o["label"], o["meaning"])] += 1
            if shown >= _REPLAY_ROWS:
                continue
            shown += 1
            mc = {True: "yes", False: "no", None: "—"}[o["matches_capture"]]
            v.add_row(_lit(d["device"]["id"]), _lit(o["id"]), _lit(o["check"]), Text(o["label"], style=_OUTCOME_STYLE.get(o["outcome"], "")),
                      _lit(", ".join(o["checks_fired"]) or "—"), mc, _verdict(o["severity"]))
    console.print(v)
    total = sum(meanings.values())
    if total > shown:
        console.print(f"    … {total - shown} more vTasks (use --format json)")
    console.print("What it means:")
    for (dev, label, meaning), count in meanings.items():
        console.print(_lit(f"  {dev}: {count} vTask(s) {label} — {meaning}"), highlight=False)


def fleet_table(console: Console, doc: dict) -> None:
    t = Table(title=_title(f"aegis {doc['kind']} — {len(doc['devices'])} device(s)", doc.get("fault_injected")), title_justify="left")
    for col in ("host", "device", "uuid", "verdict", "own verdict", "state", "evidence", "error"):
        t.add_column(col, overflow="fold")
    policy = doc.get("policy") or {}
    shown = _fleet_rows(doc["devices"])
    for d in shown:
        own = d.get("local_verdict", d["verdict"])
        st = policy.get(d["device"]["uuid"], {})
        t.add_row(_lit(d["device"].get("host", "")), _lit(d["device"]["id"]), _lit(d["device"]["uuid"]), _verdict(d["verdict"]),
                  _lit(own), _lit(st.get("state", "")), str(len(d.get("evidence") or [])), _lit((d.get("error") or "")[:80]))
    console.print(t)
    if len(shown) < len(doc["devices"]):
        counts: dict[str, int] = {}
        for d in doc["devices"]:
            counts[str(d["verdict"])] = counts.get(str(d["verdict"]), 0) + 1
        console.print(_lit(f"… {len(doc['devices']) - len(shown)} more devices not shown (all: "
                           + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) + "; use --format json or csv)"))
    for d in shown:
        for e in (d.get("evidence") or [])[:5]:
            console.print(Text.assemble(_verdict(e["severity"]), f" {d['device'].get('host', '')}/{d['device']['id']} "
                                        f"{e['check']} {e['case_id']}\n    {e['summary']}"), highlight=False)
    cmp_ = doc.get("comparison")
    if cmp_:
        console.print(Text.assemble("cross-device comparison: ", (str(cmp_["outcome"]), "bold"), f" — {cmp_['note']}"), highlight=False)


def _fleet_rows(devices: list[dict]) -> list[dict]:
    """The devices a fleet table shows: all of them up to FLEET_ROWS (a table of a million rows
    helps no one and takes minutes to draw), else every device that is not HEALTHY first, in
    report order, then healthy ones up to the limit."""
    if len(devices) <= FLEET_ROWS:
        return devices
    worse = [d for d in devices if d["verdict"] != "HEALTHY"][:FLEET_ROWS]
    return worse + [d for d in devices if d["verdict"] == "HEALTHY"][:FLEET_ROWS - len(worse)]


def sweep_logger(fmt: str):
    """Structured log lines on stderr (logfmt or JSON lines): no colours, no progress bars."""
    from aegis_cli.fleet.logs import log_line

    def log(event: str, level: str = "info", **kv) -> None:
        click.echo(log_line(event, level, fmt, **kv), err=True)
    return log


def info_table(console: Console, doc: dict) -> None:
    """``aegis info``: versions, backends, devices, paths, workloads, probes and kernel hashes."""
    t = Table(title="aegis info", title_justify="left", show_header=False)
    t.add_column("key")
    t.add_column("value", overflow="fold")
    for k, v in doc["versions"].items():
        t.add_row(_lit(k), _lit(v))
    for b in doc["backends"]:
        t.add_row(f"backend {b['name']}", _lit("available" if b["available"] else f"unavailable ({b.get('reason', '')})"))
    for d in doc["devices"]:
        t.add_row(_lit(d["id"]), _lit(f"{d['name']}  uuid {d['uuid']}"))
    for k, v in doc["paths"].items():
        t.add_row(_lit(f"{k} path" if k == "workloads" else k), _lit(v))  # "workloads" names the catalogs below
    t.add_row("workloads", _lit(", ".join(doc["workloads"])))
    for p in doc["probes"]:
        t.add_row(f"probe {p['name']}", _lit(p["summary"] + ("  (default)" if p["default"] else "")))
    for k, v in doc["kernel_hashes"].items():
        t.add_row(f"kernel {k}", v)
    console.print(t)


def golden_table(console: Console, doc: dict, output: str) -> None:
    """``aegis golden record``: one row per record key of the golden file written to ``output``."""
    t = Table(title=_lit(f"golden fingerprints → {output}"), title_justify="left")
    for col in ("key", "devices", "computations", "outputs"):
        t.add_column(col, overflow="fold")
    for r in doc["records"]:
        k = r["key"]
        t.add_row(_lit(f"{k['model']} · driver {k.get('driver')} · cuda {k.get('cuda')} · torch {k['torch']} · kernels {k['kernels']}"),
                  str(len(r["devices"])), ", ".join(r["computations"]),
                  str(sum(len(c["outputs"]) for c in r["computations"].values())))
    console.print(t)


def history_table(console: Console, doc: dict) -> None:
    """``aegis history``: a row per device (state, record, last verdict), then each device's reason and results."""
    t = Table(title=_lit(f"aegis history — {doc['database']}"), title_justify="left")
    for col in ("uuid", "serial", "last seen on", "state", "record", "last verdict"):
        t.add_column(col, overflow="fold")
    for d in doc["devices"]:
        state = d["state"] + (f" ({d['clean_streak']} clean)" if d["state"] != "ACTIVE" else "")
        t.add_row(*(_lit(v) for v in (d["uuid"], d.get("serial") or "", f"{d.get('last_host', '')} {d.get('last_id', '')}", state,
                                      d["summary"], d["last_verdict"] or "")))
    console.print(t)
    for d in doc["devices"]:
        if d.get("reason"):
            console.print(_lit(f"{d['uuid']}: {d['reason']}"), highlight=False)
        for r in d.get("results", []):
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["ts"]))
            console.print(Text.assemble(f"  {when}  {r['host']} {r['device']}  ", _verdict(r["verdict"]),
                                        f"  {' '.join(r['checks'])} {r['error'] or ''}"), highlight=False)


def coverage_table(console: Console, doc: dict) -> None:
    """``aegis history --coverage``: per device, the seeds and scale bands its sweeps visited and
    what they checked (fleet/coverage.py)."""
    t = Table(title=_lit(f"aegis history --coverage — {doc['database']}"), title_justify="left")
    for col in ("uuid", "last seen on", "sweeps", "seeds (last)", "pow2 bands", "gemm bands", "launches", "failed runs"):
        t.add_column(col, overflow="fold")
    for d in doc["devices"]:
        c = d["coverage"]
        bands = lambda k, c=c: f"{c[k]}/{c['bands']} ({100 * c[k] / c['bands']:.0f}%)" if c["bands"] else "off"
        seeds = f"{c['seeds']} ({c['last_seed']})" if c["last_seed"] is not None else "-"
        launches = "-" if c["launches"] is None else f"{c['launches']:,}"
        t.add_row(*(_lit(str(v)) for v in (d["uuid"], f"{d.get('last_host', '')} {d.get('last_id', '')}", c["sweeps"], seeds,
                                           bands("pow2_bands"), bands("gemm_bands"), launches,
                                           "-" if c["failures"] is None else c["failures"])))
    console.print(t)
    console.print("bands: offsets of the scale-dithering grid visited of step² (every exponent pair of the exact range once "
                  "all are); launches and failed runs count sweeps that recorded them", highlight=False)
    for d in doc["devices"]:
        for r in d.get("results", []):
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["ts"]))
            dz = r.get("coverage") or {}
            ran = [f"{k.replace('_', ' ')} {dz[k]}" for k in ("index", "pow2_offset", "gemm_shift") if dz.get(k) is not None]
            console.print(Text.assemble(f"  {when}  seed {r.get('seed')}  {'  '.join(ran)}  launches {r.get('launches')}  ",
                                        _verdict(r["verdict"])), highlight=False)
