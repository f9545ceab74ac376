"""The sweep's configuration: ``sweep.yaml`` read into typed dataclasses, every value checked
before any work (a typo must not end as ERROR in the history of every device)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from aegis_cli.fleet import statefiles
from aegis_cli.fleet.actions import ActionsConfig
from aegis_cli.fleet.policy import PolicyConfig, check_positive
from aegis_cli.ops import config as config_mod
from aegis_cli.ops import files
from aegis_cli.ops.errors import ConfigError
from aegis_cli.probes.pow2 import MAX_STEP


@dataclass(kw_only=True)
class HistoryConfig:
    path: str = "/var/lib/aegis/history.sqlite"
    busy_timeout_seconds: float = 30.0

    def __post_init__(self) -> None:
        check_positive("history.busy_timeout_seconds", self.busy_timeout_seconds, zero_ok=True)


@dataclass(kw_only=True)
class ExportsConfig:
    report: str | None = None  # this sweep's JSON report
    quarantine_list: str | None = None  # TSV, or JSON when the name ends in .json
    prometheus_textfile: str | None = None  # e.g. /var/lib/node_exporter/textfile_collector/aegis.prom


@dataclass(kw_only=True)
class DistributedConfig:
    mode: str = "auto"  # auto: distributed when RANK/WORLD_SIZE/MASTER_ADDR are set; off: never
    backend: str = "auto"  # auto: nccl when CUDA is usable, else gloo
    timeout_seconds: float = 600.0
    fleet_report: str | None = None  # written by rank 0

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "off"):
            raise ConfigError(f"distributed.mode must be auto or off, got {self.mode!r}")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ConfigError(f"distributed.backend must be auto, nccl or gloo, got {self.backend!r}")
        check_positive("distributed.timeout_seconds", self.timeout_seconds)


MAX_DITHER_SWEEPS = MAX_STEP * MAX_STEP  # the pow2 grid's coarsest step, squared


@dataclass(kw_only=True)
class SweepConfig:
    devices: str = "auto"
    workload: str | None = None
    probes: list[str] = field(default_factory=lambda: ["gemm", "pow2", "attention"])  # pow2: the whole exact range, dithered
    seed: int | None = None  # None: a new seed every sweep (fleet/coverage.py); an integer pins it
    dither_sweeps: int = 256  # scale dithering: every exponent pair of the exact range within this many sweeps (0: off)
    vtasks: str | None = None  # a directory of captured vTask bundles, replayed on every device (fleet/vtasks.py)
    reruns: int = 3
    fail_fast: bool = False  # stop each device at its first confirmed FAULTY (aegis scan --fail-fast)
    budget_seconds: float = 3600.0
    device_timeout_seconds: float = 1800.0
    max_parallel: int = 0  # 0: one worker per device, all at once
    prioritize: bool = True
    fingerprint_cases: int = 12
    lock_file: str = "/var/lib/aegis/sweep.lock"
    inject: str | None = None  # self-test only: faults (and worker test hooks) to inject; records nothing
    drill: bool = False  # with inject: record, quarantine and act as on a real finding (on a history of its own)
    soak: str | None = None  # a checked burn-in per device after the probes (aegis scan --soak), e.g. "5m"
    history: HistoryConfig = field(default_factory=HistoryConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    exports: ExportsConfig = field(default_factory=ExportsConfig)
    actions: ActionsConfig = field(default_factory=ActionsConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    source: str = ""
    # set by the sweep for its workers, never by the YAML: this sweep's dithering as probe options
    probe_options: dict[str, str] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        check_positive("budget_seconds", self.budget_seconds)
        check_positive("device_timeout_seconds", self.device_timeout_seconds)
        from aegis_cli.ops.case import check_seed
        from aegis_cli.probes import check_reruns

        check_reruns(self.reruns, "reruns")

        if self.seed is not None:
            check_seed(self.seed)
        if not 0 <= self.dither_sweeps <= MAX_DITHER_SWEEPS:
            raise ConfigError(f"dither_sweeps must lie in 0…{MAX_DITHER_SWEEPS} (0: off), got {self.dither_sweeps}")
        self._check_probes()
        if self.soak is not None:  # counted in each worker's time: a burn-in as long as the timeout would end ERROR
            from aegis_cli.soak.record import parse_duration

            if parse_duration(self.soak, "soak:") >= self.device_timeout_seconds:
                raise ConfigError(f"soak: {self.soak} leaves no time for the probes within device_timeout_seconds "
                                  f"({self.device_timeout_seconds:g} s)")
        if self.max_parallel < 0 or self.fingerprint_cases < 0:
            raise ConfigError("max_parallel and fingerprint_cases must be ≥ 0")
        if self.inject:
            from aegis_cli.faults.spec import parse_spec

            parse_spec(self.inject, worker=True)

    @property
    def self_test(self) -> bool:
        """Faults injected on purpose and no drill: history, actions and exports stay as they were."""
        return bool(self.inject) and not self.drill

    def worker_budget(self) -> float:
        """The part of ``budget_seconds`` the workers may use: commands that will run keep up to
        their timeout (at most half the budget), so a sweep whose devices use all their time
        still drains a node."""
        acts = self.actions
        if self.self_test or not acts.enabled or not (acts.on_quarantine or acts.on_readmit):
            return self.budget_seconds
        return self.budget_seconds - min(acts.timeout_seconds, self.budget_seconds / 2)

    def _check_probes(self) -> None:
        """Refuse, before any worker starts, probes a worker cannot run: otherwise every device
        would record ERROR (a typo) or HEALTHY with nothing checked (a node probe)."""
        from aegis_cli.probes import NODE_PROBES, PROBES, load_all

        load_all()
        runnable = sorted(p for p in PROBES if p != "golden")
        if not self.probes:
            raise ConfigError(f"probes is empty: no probes to run, so HEALTHY would mean nothing was checked "
                              f"(a sweep runs {', '.join(runnable)})")
        for p in self.probes:
            if p in NODE_PROBES:
                raise ConfigError(f"probes: {p} is a node probe, and each sweep worker scans one device; "
                                  f"a sweep compares devices through fingerprint_cases instead")
            if p == "golden":
                raise ConfigError("probes: golden compares against a golden file, which a sweep does not take "
                                  "(aegis scan --golden FILE)")
            if p not in PROBES:
                raise ConfigError(f"probes: unknown probe {p!r} (a sweep runs {', '.join(runnable)})")


def load_config(path: str | os.PathLike) -> SweepConfig:
    """sweep.yaml → SweepConfig; relative paths are taken relative to the file."""
    path = Path(path)
    data = config_mod.load_yaml(path)
    try:
        cfg = config_mod.from_dict(SweepConfig, data, str(path))
    except ConfigError as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
    base = path.resolve().parent

    def rel(p: str | None) -> str | None:
        return None if p is None else str(base / os.path.expanduser(p))

    cfg.lock_file = rel(cfg.lock_file)
    cfg.history.path = rel(cfg.history.path)
    for key in ("report", "quarantine_list", "prometheus_textfile"):
        setattr(cfg.exports, key, rel(getattr(cfg.exports, key)))
    cfg.distributed.fleet_report = rel(cfg.distributed.fleet_report)
    cfg.vtasks = rel(cfg.vtasks)
    if cfg.vtasks is not None and not os.path.isdir(cfg.vtasks):  # a typo would replay nothing, every night
        raise ConfigError(f"{path}: vtasks: {cfg.vtasks} is not a directory (create it, or leave vtasks out)")
    if cfg.workload and (cfg.workload.endswith((".yaml", ".yml"))) and not os.path.isabs(cfg.workload):
        cfg.workload = str(base / cfg.workload)
    if cfg.workload:  # a typo here would otherwise be ERROR in the history of every device
        from aegis_cli.ops import workloads

        try:
            workloads.load(cfg.workload)
        except ConfigError as exc:
            raise ConfigError(f"{path}: workload: {exc}") from None
    cfg.source = str(path)
    return cfg


def check_outputs(cfg: SweepConfig) -> None:
    """Every path the sweep will write is writable and none is another's: an export that cannot
    be written fails the sweep now, not after every device ran. A linked, FIFO, empty or
    read-only history, or a lock_file that is the history, is refused here too."""
    statefiles.preflight(cfg.history.path, cfg.lock_file)
    own = {os.path.realpath(cfg.history.path): "history.path", os.path.realpath(cfg.lock_file): "lock_file"}
    for key, path in (("exports.report", cfg.exports.report), ("exports.quarantine_list", cfg.exports.quarantine_list),
                      ("exports.prometheus_textfile", cfg.exports.prometheus_textfile),
                      ("distributed.fleet_report", cfg.distributed.fleet_report)):
        if path:
            real = os.path.realpath(path)
            # written over the history it would destroy it; over another export, a scheduler
            # would read a report or metrics as its quarantine list
            if real in own:
                raise ConfigError(f"{key}: {path} is also the sweep's {own[real]}")
            files.check_writable(path)
            own[real] = key
