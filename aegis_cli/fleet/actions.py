"""What the policy does about a device: a quarantine list, a Prometheus textfile for
node_exporter, and an optional command per quarantined / re-admitted device.

Commands are argument lists (no shell) built from templates with ``{placeholder}``
fields (PLACEHOLDERS); they only run when ``actions.enabled`` is true, otherwise each is
recorded as a dry run. A command runs when a device's quarantine differs from what a
command last *did* for it (quarantine or re-admission), not on every sweep: a dry run, a
command that failed or one the budget left no time for stays pending and runs again at the
next sweep, until it succeeds. Each runs in its own process group, killed with it at its
timeout, at the sweep's deadline or when the sweep is stopped. Every file is written atomically.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import string
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from aegis_cli.backends.base import node_name
from aegis_cli.fleet.logs import Stop, SweepInterrupted
from aegis_cli.fleet.policy import ACTIVE, DeviceState, check_positive, wilson
from aegis_cli.ops.errors import ConfigError
from aegis_cli.ops.files import atomic_write
from aegis_cli.report import VERDICT_CODE

PLACEHOLDERS = {
    "uuid": "device UUID", "serial": "board serial ('' when unknown)", "host": "node name (AEGIS_HOST, else the hostname)",
    "host_short": "node name up to the first dot (Slurm/Kubernetes node name)", "device": "device id, e.g. cuda:3",
    "host_quarantined": "other devices of this node still quarantined or on probation (resume a node only at 0)",
    "index": "device index", "name": "device model name", "state": "QUARANTINED, PROBATION or ACTIVE",
    "reason": "why (one line)", "event": "quarantine or readmit",
}


@dataclass(kw_only=True)
class ActionsConfig:
    enabled: bool = False  # false: dry run (commands are recorded, never executed)
    on_quarantine: list[str] = field(default_factory=list)  # argv template, e.g. [examples/slurm/aegis-drain.sh, "{host_short}", "{reason}"]
    on_readmit: list[str] = field(default_factory=list)
    timeout_seconds: float = 60.0

    def __post_init__(self) -> None:
        for key in ("on_quarantine", "on_readmit"):
            for arg in getattr(self, key):
                for _, fname, spec, conv in string.Formatter().parse(arg):
                    if fname is None:
                        continue
                    if fname not in PLACEHOLDERS or spec or conv:
                        raise ConfigError(f"actions.{key}: unknown placeholder {{{fname}}} in {arg!r} "
                                          f"(known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)})")
        check_positive("actions.timeout_seconds", self.timeout_seconds)


@dataclass
class ActionRecord:
    uuid: str
    event: str  # quarantine | readmit
    argv: list[str] | None  # None: no command configured for the event (recorded all the same)
    executed: bool
    returncode: int | None = None
    output: str = ""

    def to_dict(self) -> dict:
        return {"uuid": self.uuid, "event": self.event, "argv": self.argv, "executed": self.executed,
                "returncode": self.returncode, "output": self.output}

    @property
    def done(self) -> bool:
        return took_effect(self.argv, self.executed, self.returncode)


def took_effect(argv: list[str] | None, executed: bool, returncode: int | None) -> bool:
    """An event (an ActionRecord, or one the history holds) took effect: its command succeeded,
    or none is configured for it. A dry run, a failure or a command not run stays pending and is
    tried again at the next sweep."""
    return argv is None or (executed and returncode == 0)


def render_argv(template: list[str], fields: dict[str, str]) -> list[str]:
    return [arg.format_map(fields) for arg in template]


def device_fields(dev: dict, st: DeviceState, event: str) -> dict[str, str]:
    host = dev.get("host") or node_name()
    return {"uuid": dev["uuid"], "serial": dev.get("serial") or "", "host": host, "host_short": host.split(".")[0],
            "device": dev.get("id", ""), "index": str(dev.get("index", "")), "name": dev.get("name") or "",
            "state": st.state, "reason": " ".join((st.reason or event).split()), "event": event,
            "host_quarantined": str(dev.get("host_quarantined", 0))}


def run_actions(cfg: ActionsConfig, changes: list[tuple[dict, DeviceState, str]], *, deadline: float | None = None,
                stop: Stop | None = None) -> list[ActionRecord]:
    """Run (or dry-run) the command for each (device dict, new state, event) change, one after
    another, each within its timeout and the sweep's ``deadline``. Every change gets a record,
    with no command too: the history's record of what was announced. Raises SweepInterrupted
    (the running command killed) when ``stop()`` says so."""
    out = []
    for dev, st, event in changes:
        template = cfg.on_quarantine if event == "quarantine" else cfg.on_readmit
        if not template:
            out.append(ActionRecord(dev["uuid"], event, None, executed=False))
            continue
        argv = render_argv(template, device_fields(dev, st, event))
        rec = ActionRecord(dev["uuid"], event, argv, executed=False)
        if cfg.enabled:
            timeout = cfg.timeout_seconds if deadline is None else min(cfg.timeout_seconds, deadline - time.time())
            if timeout <= 0:
                rec.output = "not run: the sweep's time budget ran out (runs at the next sweep)"
            else:
                rec.executed = True
                rec.returncode, rec.output = run_command(argv, timeout, stop)
        out.append(rec)
    return out


def run_command(argv: list[str], timeout: float, stop: Stop | None = None) -> tuple[int | None, str]:
    """(exit status or None, the tail of its output) of ``argv`` run without a shell in a process
    group of its own: at ``timeout`` the whole group is killed, so no child it started lives on."""
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.Popen(argv, shell=False, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        except FileNotFoundError:
            return None, f"command not found: {argv[0]}"
        except OSError as exc:
            return None, f"could not run {argv[0]}: {exc.strerror}"
        end, timed_out = time.monotonic() + timeout, False
        try:
            while proc.poll() is None:
                why = stop() if stop else None
                if why:
                    raise SweepInterrupted(f"sweep stopped by {why} while running {argv[0]} (killed), nothing of this sweep recorded")
                if time.monotonic() >= end:
                    timed_out = True
                    break
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=min(0.05, max(0.0, end - time.monotonic())))
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # its children too, even when it exited first
            proc.wait()
        out.seek(0)
        text = out.read()[-2000:].decode("utf-8", errors="replace")
    if timed_out:
        return None, f"timed out after {timeout:g} s; killed with its process group" + (f": {text}" if text else "")
    return proc.returncode, text


def transitions(was_quarantined: dict[str, bool], after: dict[str, DeviceState]) -> dict[str, str]:
    """uuid → 'quarantine' | 'readmit' for devices whose quarantine differs from what was last
    announced for them (``was_quarantined``)."""
    ev = {}
    for uuid, st in after.items():
        was_q = was_quarantined.get(uuid, False)
        if st.quarantined and not was_q:
            ev[uuid] = "quarantine"
        elif was_q and st.state == ACTIVE:
            ev[uuid] = "readmit"
    return ev


# -- files ---------------------------------------------------------------------------------
def write_quarantine_list(path: str, states: dict[str, DeviceState], devices: dict[str, dict]) -> int:
    """Every quarantined device (probation included) in the history: TSV, or JSON for *.json."""
    rows = []
    for uuid, st in sorted(states.items()):
        if not st.quarantined:
            continue
        dev = devices.get(uuid, {})
        rows.append({"uuid": uuid, "serial": dev.get("serial") or "", "host": (st.last.host if st.last else "") or dev.get("last_host") or "",
                     "device": (st.last.device_id if st.last else "") or dev.get("last_id") or "", "state": st.state,
                     "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(st.since)) if st.since else "",
                     "clean_streak": st.clean_streak, "reason": " ".join(st.reason.split())})
    if str(path).endswith(".json"):
        atomic_write(path, json.dumps({"format_version": 1, "written": time.time(), "quarantined": rows}, indent=2) + "\n")
        return len(rows)
    cols = ("uuid", "serial", "host", "device", "state", "since", "clean_streak", "reason")
    lines = [f"# aegis quarantine list, written {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}; "
             "PROBATION devices stay quarantined until re-admitted", "# " + "\t".join(cols)]
    lines += ["\t".join(str(r[c]).replace("\t", " ") for c in cols) for r in rows]
    atomic_write(path, "\n".join(lines) + "\n")
    return len(rows)


def _lbl(v) -> str:
    return str(v if v is not None else "").replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(doc: dict, states: dict[str, DeviceState]) -> str:
    """node_exporter textfile: this sweep's devices with their history-derived state."""
    fams: dict[str, tuple[str, list[str]]] = {
        "aegis_device_verdict": ("Verdict of the last sweep per device (0 healthy, 1 suspect, 2 faulty, 3 error).", []),
        "aegis_device_quarantined": ("1 when the quarantine policy holds the device out (probation included).", []),
        "aegis_device_probation_clean_sweeps": ("Consecutive clean sweeps of a quarantined device.", []),
        "aegis_device_sweeps": ("Sweeps recorded for the device in its history.", []),
        "aegis_device_results": ("Sweeps recorded for the device by verdict.", []),
        "aegis_device_failure_rate_upper": ("95% Wilson upper bound of the device's failure rate (SUSPECT or FAULTY).", []),
    }
    for d in doc["devices"]:
        dev = d["device"]
        base = f'uuid="{_lbl(dev["uuid"])}",serial="{_lbl(dev.get("serial"))}",device="{_lbl(dev["id"])}",host="{_lbl(dev["host"])}"'
        st = states.get(dev["uuid"])
        fams["aegis_device_verdict"][1].append(f'aegis_device_verdict{{{base},verdict="{d["verdict"]}"}} {VERDICT_CODE[d["verdict"]]}')
        if st is None:
            continue
        fams["aegis_device_quarantined"][1].append(f'aegis_device_quarantined{{{base},state="{st.state}"}} {int(st.quarantined)}')
        fams["aegis_device_probation_clean_sweeps"][1].append(f"aegis_device_probation_clean_sweeps{{{base}}} {st.clean_streak}")
        fams["aegis_device_sweeps"][1].append(f"aegis_device_sweeps{{{base}}} {st.sweeps}")
        for v, n in st.counts.items():
            fams["aegis_device_results"][1].append(f'aegis_device_results{{{base},verdict="{v}"}} {n}')
        _, hi = wilson(st.failures, st.sweeps)
        fams["aegis_device_failure_rate_upper"][1].append(f"aegis_device_failure_rate_upper{{{base}}} {hi:.6g}")
    lines = []
    for name, (help_text, samples) in fams.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", *samples]
    lines += ["# HELP aegis_last_sweep_timestamp_seconds When the last aegis sweep finished (Unix time).",
              "# TYPE aegis_last_sweep_timestamp_seconds gauge", f"aegis_last_sweep_timestamp_seconds {time.time():.0f}",
              "# HELP aegis_sweep_duration_seconds Wall time of the last aegis sweep.",
              "# TYPE aegis_sweep_duration_seconds gauge", f"aegis_sweep_duration_seconds {float(doc.get('duration_seconds') or 0):.3f}",
              "# HELP aegis_sweep_exit_code Exit code of the last sweep (0 healthy, 1 suspect, 2 faulty, 3 unknown).",
              "# TYPE aegis_sweep_exit_code gauge", f"aegis_sweep_exit_code {int(doc.get('exit_code', 3))}",
              "# HELP aegis_fault_injected 1 when the last sweep injected faults on purpose (a self-test).",
              "# TYPE aegis_fault_injected gauge", f"aegis_fault_injected {int(bool(doc.get('fault_injected')))}"]
    return "\n".join(lines) + "\n"

