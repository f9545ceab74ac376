"""Report model and machine formats: JSON (docs/report-format.md), CSV, Prometheus.

The human tables live in render.py. Every report carries what is needed to reproduce it:
seed, command line, versions and the source hash of every kernel.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Protocol

from aegis_cli.backends.base import DeviceIdentity, node_name
from aegis_cli.backends.loader import kernel_hashes
from aegis_cli.ops.errors import AegisError, ConfigError, GoldenError
from aegis_cli.ops.files import sanitize
from aegis_cli.ops.provenance import tool_version, versions
from aegis_cli.ops.verdict import Evidence, Verdict, overall_exit, worst

if TYPE_CHECKING:
    from aegis_cli.ops.numerics import Thresholds
    from aegis_cli.probes.confirmation import Tally
    from aegis_cli.probes.gemm import ProbeStats

SCHEMA_VERSION = "1.2"
FORMATS = ("table", "json", "csv", "prom")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class DeviceReport:
    identity: DeviceIdentity
    verdict: Verdict
    workload: str = ""
    evidence: list[Evidence] = field(default_factory=list)
    stats: ProbeStats | None = None
    error: str | None = None
    seconds: float = 0.0
    probe_stats: dict = field(default_factory=dict)  # other probes' JSON-able summaries
    # case id → the flagged run as observed (GemmResult; only with ScanOptions.keep_flagged), for
    # --save-vtasks; holds tensors, so never serialised (not in to_dict) nor compared
    captured: dict = field(default_factory=dict, repr=False, compare=False)
    # launches, failed launches, "k of n" per flagged case, fail-fast (probes/confirmation.py)
    tally: Tally | None = None
    # aegis scan --soak: the burn-in's own section (soak/record.py; docs/report-format.md), else None
    soak: dict | None = None

    def judge(self) -> None:
        """Its verdict: the worst of its evidence, and ERROR at the least when the device failed."""
        self.verdict = worst([Verdict.ERROR if self.error is not None else Verdict.HEALTHY, *(e.severity for e in self.evidence)])

    def to_dict(self, tau: float) -> dict:
        s = self.stats
        noise = None
        if s is not None and s.checksums:
            noise = {"threshold": tau, "clean_max": s.clean_max,
                     "margin": (1.0 / s.clean_ratio) if s.clean_ratio > 0 else None}
        soak = {"soak": self.soak} if self.soak is not None else {}
        return {
            "device": self.identity.to_dict(),
            "verdict": self.verdict.value,
            "workload": self.workload,
            "error": self.error,
            "evidence": [e.to_dict() for e in self.evidence],
            "stats": None if s is None else {"gemms": s.gemms, "checksums": s.checksums, "flops": s.flops,
                                             "skipped_scales": s.skipped_scales},
            "noise": noise,
            "probes": self.probe_stats,
            "confirmation": None if self.tally is None else self.tally.to_dict(),
            "timings": {"seconds": round(self.seconds, 3),
                        "gemm_tflops": round(s.flops / s.seconds / 1e12, 4) if s and s.seconds > 0 else None},
            **soak,
        }


@contextmanager
def device_failures(dr: DeviceReport) -> Iterator[None]:
    """Around the checks of ``dr``'s device: a failure during them is the device's, said in
    ``dr.error`` (``judge`` then gives ERROR, never HEALTHY; FAULTY evidence found so far is kept),
    except bad input (ConfigError, GoldenError), which stops the command (exit 3)."""
    try:
        yield
    except (ConfigError, GoldenError):
        raise
    except AegisError as exc:
        dr.error = str(exc)
    except Exception as exc:  # a driver or runtime failure during checks: the device is not trusted
        dr.error = f"{type(exc).__name__}: {exc}"


@dataclass
class Report:
    kind: str  # "scan" | "replay" | "sweep"
    command_line: list[str]
    seed: int
    options: dict
    started: str
    injected: list[str] = field(default_factory=list)
    devices: list[DeviceReport] = field(default_factory=list)
    finished: str | None = None
    tau: float = 0.0
    never_fired: list[str] | None = None  # injected faults that applied nowhere (None: not tracked)
    _t0: float = field(default_factory=time.time, repr=False)
    duration: float = 0.0

    def finish(self) -> None:
        self.finished = _now()
        self.duration = time.time() - self._t0

    @property
    def exit_code(self) -> int:
        return int(overall_exit(d.verdict for d in self.devices))

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": self.kind,
            "tool": {"name": "aegis", "version": tool_version()},
            "command_line": self.command_line,
            "seed": self.seed,
            "host": node_name(),
            "started": self.started,
            "finished": self.finished,
            "duration_seconds": round(self.duration, 3),
            "options": self.options,
            "fault_injected": bool(self.injected),
            "injected": self.injected,
            **({"injected_never_fired": self.never_fired} if self.never_fired is not None else {}),
            "versions": versions(),
            "kernel_hashes": kernel_hashes(),
            "devices": [d.to_dict(self.tau) for d in self.devices],
            "exit_code": self.exit_code,
        }


class RunOptions(Protocol):
    """The options a report records of the run that made it (scan.ScanOptions has them all)."""

    devices: str
    workload: str | None
    seed: int
    reruns: int
    inject: str | None
    case: str | None
    probes: tuple[str, ...]
    golden: str | None
    probe_options: dict[str, str]
    thresholds: Thresholds
    command_line: list[str]


def new_report(opts: RunOptions, kind: str = "scan") -> Report:
    options = {"devices": opts.devices, "workload": opts.workload, "reruns": opts.reruns, "case": opts.case,
               "probes": list(opts.probes), "golden": opts.golden, "probe_options": dict(opts.probe_options),
               "threshold": opts.thresholds.tau, "confirm_margin": opts.thresholds.confirm_margin}
    return Report(kind=kind, command_line=list(opts.command_line) or list(sys.argv), seed=opts.seed, options=options,
                  started=_now(), injected=[opts.inject] if opts.inject else [], tau=opts.thresholds.tau)


# -- machine formats ---------------------------------------------------------------------
def to_json(doc: dict) -> str:
    return json.dumps(doc, indent=2, sort_keys=False, allow_nan=False, default=_json_default) + "\n"


def _json_default(o):
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


CSV_COLUMNS = ["host", "device", "uuid", "name", "verdict", "workload", "gemms", "evidence", "first_check",
               "first_case", "max_margin", "seconds", "error", "fault_injected"]


def to_csv(doc: dict) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    w.writeheader()
    for d in doc["devices"]:
        ev = d["evidence"]
        # render() has already turned inf into "inf" (JSON has no infinity): the worst margin of all
        margins = [math.inf if e.get("margin") == "inf" else e["margin"] for e in ev
                   if isinstance(e.get("margin"), (int, float)) or e.get("margin") == "inf"]
        w.writerow({"host": d["device"]["host"], "device": d["device"]["id"], "uuid": d["device"]["uuid"],
                    "name": d["device"]["name"], "verdict": d["verdict"], "workload": d["workload"],
                    "gemms": (d["stats"] or {}).get("gemms", 0), "evidence": len(ev),
                    "first_check": ev[0]["check"] if ev else "", "first_case": ev[0]["case_id"] if ev else "",
                    "max_margin": f"{max(margins):.4g}" if margins else "", "seconds": d["timings"]["seconds"],
                    "error": d["error"] or "", "fault_injected": "true" if doc.get("fault_injected") else "false"})
    return buf.getvalue()


VERDICT_CODE = {v.value: int(v.exit_code) for v in Verdict}  # 0 healthy … 3 error


def _label(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def launch_counts(d: dict) -> tuple[int, int] | None:
    """(checked launches, failing launches) of a device report: its probes' (``confirmation``)
    plus its burn-in's (``soak``); None when it carries neither (an older report)."""
    c = d.get("confirmation") if isinstance(d.get("confirmation"), dict) else {}
    s = d.get("soak") if isinstance(d.get("soak"), dict) else {}
    f = s.get("failures") if isinstance(s.get("failures"), dict) else {}
    parts = [(c.get("launches"), c.get("failed_launches")), (s.get("launches"), f.get("launches"))]
    parts = [(n, k) for n, k in parts if isinstance(n, int) and isinstance(k, int)]
    return (sum(n for n, _ in parts), sum(k for _, k in parts)) if parts else None


def to_prometheus(doc: dict) -> str:
    """Prometheus text exposition (node_exporter textfile collector)."""
    lines = [
        "# HELP aegis_device_verdict Verdict of the last aegis run per device (0 healthy, 1 suspect, 2 faulty, 3 error).",
        "# TYPE aegis_device_verdict gauge",
    ]
    for d in doc["devices"]:
        dev = d["device"]
        labels = f'device="{_label(dev["id"])}",uuid="{_label(dev["uuid"])}",name="{_label(dev["name"])}",host="{_label(dev["host"])}"'
        lines.append(f'aegis_device_verdict{{{labels},verdict="{d["verdict"]}"}} {VERDICT_CODE[d["verdict"]]}')
    lines += ["# HELP aegis_device_evidence Evidence records of the last aegis run per device.",
              "# TYPE aegis_device_evidence gauge"]
    for d in doc["devices"]:
        lines.append(f'aegis_device_evidence{{device="{_label(d["device"]["id"])}",uuid="{_label(d["device"]["uuid"])}"}} {len(d["evidence"])}')
    lines += ["# HELP aegis_device_gemms GEMMs checked in the last aegis run per device.",
              "# TYPE aegis_device_gemms gauge"]
    for d in doc["devices"]:
        lines.append(f'aegis_device_gemms{{device="{_label(d["device"]["id"])}",uuid="{_label(d["device"]["uuid"])}"}} {(d["stats"] or {}).get("gemms", 0)}')
    # "k of n launches": what each device ran under check, and how many of those runs failed
    for i, (metric, what) in enumerate((("launches_checked", "Launches (runs of a checked computation) checked"),
                                        ("failed_launches", "Checked launches with a signal (failed)"))):
        lines += [f"# HELP aegis_device_{metric} {what} in the last aegis run per device.", f"# TYPE aegis_device_{metric} gauge"]
        for d in doc["devices"]:
            lines.append(f'aegis_device_{metric}{{device="{_label(d["device"]["id"])}",uuid="{_label(d["device"]["uuid"])}"}} '
                         f'{(launch_counts(d) or (0, 0))[i]}')
    finished = doc.get("finished") or doc.get("started")
    ts = datetime.fromisoformat(finished).timestamp() if finished else time.time()
    lines += ["# HELP aegis_last_run_timestamp_seconds When the last aegis run finished (Unix time).",
              "# TYPE aegis_last_run_timestamp_seconds gauge", f"aegis_last_run_timestamp_seconds {ts:.0f}",
              "# HELP aegis_fault_injected 1 when the last run injected faults on purpose (a self-test).",
              "# TYPE aegis_fault_injected gauge", f"aegis_fault_injected {int(bool(doc.get('fault_injected')))}"]
    return "\n".join(lines) + "\n"


def render(doc: dict, fmt: str) -> str:
    doc = sanitize(doc)
    if fmt == "json":
        return to_json(doc)
    if fmt == "csv":
        return to_csv(doc)
    if fmt == "prom":
        return to_prometheus(doc)
    raise ValueError(f"no machine renderer for {fmt!r}")


