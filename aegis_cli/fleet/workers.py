"""The sweep's worker processes: one per device (``python -m aegis_cli.fleet.worker``), at most
``max_parallel`` at once, each with a timeout inside the sweep's budget. A device whose worker
hangs past its timeout or dies gets ERROR (or the finding of its priority cases); the others
finish. Workers run in their own process group and are killed with it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from aegis_cli.backends import threads
from aegis_cli.fleet.config import SweepConfig
from aegis_cli.fleet.logs import Log, Stop, SweepInterrupted
from aegis_cli.fleet.plan import DevicePlan
from aegis_cli.ops import files


@dataclass
class _Worker:
    plan: DevicePlan
    identity: dict
    out: str
    errlog: str
    proc: subprocess.Popen | None = None
    started: float = 0.0
    deadline: float = 0.0


def _error_doc(identity: dict, message: str, seconds: float, partial: dict | None = None) -> dict:
    doc = {"device": identity, "verdict": "ERROR", "workload": "", "error": message, "evidence": [], "stats": None,
           "noise": None, "probes": {}, "timings": {"seconds": round(seconds, 3), "gemm_tflops": None}}
    if partial and partial.get("verdict") in ("SUSPECT", "FAULTY"):
        # the previously failing cases re-ran and failed again: that finding stands
        doc.update({k: partial[k] for k in ("workload", "evidence", "probes") if k in partial})
        doc["verdict"] = partial["verdict"]
    return doc


def _tail(path: str, n: int = 3) -> str:
    """The last lines a worker wrote to stderr, its own structured log lines left out when
    anything else is there (an error message, a traceback)."""
    try:
        lines = [ln for ln in Path(path).read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    other = [ln for ln in lines if not ln.startswith("ts=")]
    return " | ".join((other or lines)[-n:])


def _kill(w: _Worker) -> None:
    if w.proc is not None and w.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(w.proc.pid, signal.SIGKILL)
        w.proc.wait()


def run_workers(cfg: SweepConfig, plans: list[DevicePlan], identities: dict[str, dict], deadline: float, log: Log,
                env: dict[str, str] | None = None, stop: Stop | None = None) -> list[dict]:
    """One worker process per device (at most ``max_parallel`` at once); device reports in
    ``plans`` order. Workers are killed on timeout, on the sweep's deadline and on exit."""
    if cfg.seed is None:  # a bug, not bad input: the sweep chooses the seed first (fleet/coverage.py)
        raise ValueError("run_workers needs the sweep's chosen seed: coverage.resolve(cfg, …) first")
    stop = stop or (lambda: None)
    # removed after (the reports are read by now; the workers' logs live on only in the sweep's
    # log), and by the next sweep when this one is killed
    with files.work_dir("aegis-sweep-") as tmp:
        return _run_workers(cfg, plans, identities, deadline, log, env, stop, tmp)


def _worker_env(extra: dict[str, str] | None, workers: int) -> dict[str, str]:
    """The worker's environment: it must import the aegis this sweep runs. ``python -m`` puts
    the working directory first on sys.path, so workers start in their temp folder (an old
    checkout in the sweep's directory would otherwise shadow the installed package), with the
    running package's root and absolute PYTHONPATH entries in front. Workers running side by
    side divide the cores between them (backends/threads.py) unless the operator set a count."""
    env = {**os.environ, **(extra or {}), "AEGIS_SWEEP_PID": str(os.getpid())}
    if not env.get("AEGIS_THREADS", "").strip() and not env.get("OMP_NUM_THREADS", "").strip():
        env["AEGIS_THREADS"] = str(threads.share(workers, env))
    root = str(Path(__file__).resolve().parents[2])
    paths = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([root, *paths]))
    return env


def _run_workers(cfg: SweepConfig, plans: list[DevicePlan], identities: dict[str, dict], deadline: float, log: Log,
                 env: dict[str, str] | None, stop: Stop, tmp: str) -> list[dict]:
    workers = [_Worker(p, identities[p.device_id], os.path.join(tmp, f"{i}.json"), os.path.join(tmp, f"{i}.log"))
               for i, p in enumerate(plans)]
    pending, running, results = list(workers), [], {}
    limit = cfg.max_parallel or len(workers)
    try:
        while pending or running:
            why = stop()
            if why:
                raise SweepInterrupted(f"sweep stopped by {why}: {len(running)} worker(s) killed, nothing of this sweep recorded")
            while pending and len(running) < limit:
                w = pending.pop(0)
                now = time.time()
                if now >= deadline:
                    results[w.plan.device_id] = _error_doc(w.identity, "not started: the sweep's time budget ran out", 0.0)
                    log("device_skipped", level="warning", device=w.plan.device_id, reason="budget")
                    continue
                spec = {"device": w.plan.device_id, "workload": cfg.workload, "seed": cfg.seed, "reruns": cfg.reruns, "fail_fast": cfg.fail_fast,
                        "probes": w.plan.probes, "probe_options": cfg.probe_options, "vtasks": cfg.vtasks, "inject": cfg.inject,
                        "priority_cases": w.plan.priority_cases, "priority_seeds": w.plan.priority_seeds,
                        "fingerprint_cases": cfg.fingerprint_cases, "output": w.out, "soak": cfg.soak,
                        "command_line": ["aegis", "sweep", "--config", cfg.source]}
                spec_path = w.out + ".spec"
                Path(spec_path).write_text(json.dumps(spec), encoding="utf-8")
                with open(w.errlog, "wb") as errfh:
                    w.proc = subprocess.Popen([sys.executable, "-m", "aegis_cli.fleet.worker", spec_path], stdin=subprocess.DEVNULL,
                                              stdout=subprocess.DEVNULL, stderr=errfh, start_new_session=True, cwd=tmp,
                                              env=_worker_env(env, limit))
                w.started = now
                w.deadline = min(now + cfg.device_timeout_seconds, deadline)
                running.append(w)
                log("device_start", device=w.plan.device_id, uuid=w.plan.uuid, pid=w.proc.pid,
                    timeout=round(w.deadline - now, 1), priority_cases=len(w.plan.priority_cases))
            time.sleep(0.05)
            for w in list(running):
                rc = w.proc.poll()
                now = time.time()
                if rc is None and now < w.deadline:
                    continue
                running.remove(w)
                took = now - w.started
                if rc is None:
                    _kill(w)
                    why = "device timeout" if w.deadline < deadline else "sweep budget"
                    scanned = _read(w.out + ".scanned.json")
                    if scanned is not None:  # killed while replaying vTasks: the finished scan's verdict stands
                        scanned["device"] = {**w.identity, **scanned["device"]}
                        scanned["probes"]["vtasks"] = {"error": f"replays not finished: worker timed out after {took:.0f} s ({why}); "
                                                                "killed", "bundles": []}
                        doc = scanned
                    else:
                        doc = _error_doc(w.identity, f"worker timed out after {took:.0f} s ({why}); killed", took,
                                         _read(w.out + ".partial.json"))
                    log("device_timeout", level="error", device=w.plan.device_id, seconds=round(took, 1), verdict=doc["verdict"])
                else:
                    doc = _read(w.out) if rc == 0 else None
                    if doc is None:
                        how = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
                        tail = _tail(w.errlog)
                        doc = _error_doc(w.identity, f"worker failed ({how})" + (f": {tail}" if tail else ""), took,
                                         _read(w.out + ".partial.json"))
                        log("device_failed", level="error", device=w.plan.device_id, rc=rc)
                    else:
                        doc["device"] = {**w.identity, **doc["device"]}
                # every device ends with one device_done line; an ERROR says why there too:
                # operators tail logs, not reports
                why = {"error": str(doc["error"])[:300]} if doc.get("error") else {}
                log("device_done", device=w.plan.device_id, verdict=doc["verdict"], seconds=round(took, 2), **why)
                results[w.plan.device_id] = doc
    finally:
        for w in running:
            _kill(w)
    return [results[p.device_id] for p in plans]


def _read(path: str) -> dict | None:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
