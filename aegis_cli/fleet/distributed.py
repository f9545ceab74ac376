"""Cross-node comparison over torch.distributed (docs/design.md §4.1, docs/fleet.md).

When ``aegis sweep`` is launched by torchrun (RANK, WORLD_SIZE, MASTER_ADDR set; under
srun, export MASTER_ADDR/MASTER_PORT and SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID stand in),
every rank sweeps one device (``cuda:LOCAL_RANK``, ``cuda:0`` when each task sees one GPU, or
``cpu:LOCAL_RANK`` without GPUs) with
the same seeded workload in a worker process, exactly as a node sweep does. Then the
ranks all-gather their device reports — fingerprints and checksum noise included — as
byte tensors (NCCL with GPU tensors, gloo on CPU), every rank applies the same comparison
(fleet/compare.py), records its device's fleet verdict in its node's history, local rank 0
writes the node's exports, and rank 0 writes one fleet report.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from collections.abc import Mapping

from aegis_cli import report as report_mod
from aegis_cli.backends.base import node_name
from aegis_cli.fleet import compare, coverage, vtasks
from aegis_cli.fleet.history import History
from aegis_cli.fleet.lock import SweepLock
from aegis_cli.fleet.plan import plan_devices
from aegis_cli.fleet.record import SweepOutcome, apply_policy, sweep_doc, write_exports
from aegis_cli.fleet.workers import run_workers
from aegis_cli.ops import files
from aegis_cli.ops.errors import AegisError, DeviceError, LockError


def launched(env: Mapping[str, str]) -> bool:
    """True when this process is one rank of a torchrun/srun launch."""
    has_rank = "RANK" in env or "SLURM_PROCID" in env
    has_world = "WORLD_SIZE" in env or "SLURM_NTASKS" in env
    return has_rank and has_world and "MASTER_ADDR" in env


def ranks(env: Mapping[str, str]) -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from torchrun or Slurm variables."""
    def get(*names: str, default: str | None = None) -> int:
        for n in names:
            if n in env:
                try:
                    return int(env[n])
                except ValueError:
                    raise DeviceError(f"{n}={env[n]!r} is not an integer") from None
        if default is None:
            raise DeviceError(f"distributed launch: none of {', '.join(names)} is set")
        return int(default)

    rank = get("RANK", "SLURM_PROCID")
    world = get("WORLD_SIZE", "SLURM_NTASKS")
    local = get("LOCAL_RANK", "SLURM_LOCALID", default="0")
    local_world = get("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", default=str(world))
    if not 0 <= rank < world:
        raise DeviceError(f"distributed launch: rank {rank} outside world size {world}")
    return rank, world, local, local_world


@contextlib.contextmanager
def _collective(what: str):
    """A collective breaks when another rank stopped (its own error, SIGTERM): say that in one
    line, not as an internal error of this rank."""
    try:
        yield
    except RuntimeError as exc:  # torch.distributed.DistError and the backends' errors
        detail = " ".join(str(exc).split())[:200]
        raise DeviceError(f"distributed sweep: {what} failed; another rank probably stopped (see its log): {detail}") from None


def _barrier(what: str) -> None:
    import torch.distributed as dist

    with _collective(what):
        dist.barrier()


def _all_gather_json(obj, device) -> list:
    """All-gather a JSON-able object from every rank as uint8 tensors on ``device``."""
    with _collective("exchanging reports"):
        return _gather(obj, device)


def _gather(obj, device) -> list:
    import torch
    import torch.distributed as dist

    data = json.dumps(obj).encode("utf-8")
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    longest = int(max(s.item() for s in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(device)
    bufs = [torch.empty_like(buf) for _ in sizes]
    dist.all_gather(bufs, buf)
    return [json.loads(bytes(b[: int(s.item())].cpu().tolist()).decode("utf-8")) for b, s in zip(bufs, sizes, strict=True)]


def gpu_index(local_rank: int, visible: int) -> int:
    """The CUDA device of this rank: its local rank, or 0 when the launcher bound one GPU to each
    task (srun --gpus-per-task=1: every task sees only cuda:0)."""
    from aegis_cli.ops.errors import ConfigError

    if visible == 1:
        return 0
    if local_rank < visible:
        return local_rank
    raise ConfigError(f"local rank {local_rank} has no GPU: this task sees {visible} (one per local rank, or one per task)")


def _local_device(local_rank: int, local_world: int, env: Mapping[str, str]) -> tuple[str, dict, dict[str, str]]:
    """This rank's device id, identity, and environment for its worker."""
    from aegis_cli.backends import cuda_available, resolve_devices

    if cuda_available():
        import torch

        (dev,) = resolve_devices(f"cuda:{gpu_index(local_rank, torch.cuda.device_count())}")
        return dev.identity.id, dev.identity.to_dict(), {}
    from aegis_cli.backends.cpu import CpuBackend

    n = max(local_world, int(env.get("AEGIS_CPU_DEVICES", "1") or 1))
    dev = CpuBackend(n_devices=n).device(local_rank)
    return dev.identity.id, dev.identity.to_dict(), {"AEGIS_CPU_DEVICES": str(n)}


def run_distributed(cfg, log, env: Mapping[str, str], stop=None):
    import torch
    import torch.distributed as dist

    started = time.time()
    rank, world, local_rank, local_world = ranks(env)
    for k, v in (("RANK", rank), ("WORLD_SIZE", world)):
        os.environ.setdefault(k, str(v))
    os.environ.setdefault("MASTER_PORT", env.get("MASTER_PORT", "29500"))
    backend = cfg.distributed.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        gpu = gpu_index(local_rank, torch.cuda.device_count())
        torch.cuda.set_device(gpu)
        coll = torch.device("cuda", gpu)
    else:
        coll = torch.device("cpu")
    timeout = datetime.timedelta(seconds=cfg.device_timeout_seconds + cfg.distributed.timeout_seconds)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    except Exception as exc:
        raise DeviceError(f"distributed sweep: cannot join the process group ({backend} at "
                          f"{env.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}): {exc}") from None
    log("distributed_start", rank=rank, world_size=world, local_rank=local_rank, backend=backend)
    lock = SweepLock(cfg.lock_file)
    try:
        problem = None
        if local_rank == 0:
            try:
                lock.acquire()
            except LockError as exc:
                problem = str(exc)
        problems = [p for p in _all_gather_json(problem, coll) if p]
        if problems:
            raise LockError(problems[0])
        device_id, identity, worker_env = _local_device(local_rank, local_world, env)
        with History(cfg.history.path, busy_timeout=cfg.history.busy_timeout_seconds) as hist:
            (plan,) = plan_devices(cfg, [identity], hist.results([identity["uuid"]]), started)
            proposal = coverage.choose(cfg, hist, node_name(), started)
        chosen = _all_gather_json(proposal, coll)[0]  # rank 0's seed everywhere: the fingerprints must compare
        cfg = coverage.resolve(cfg, chosen)
        (mine,) = run_workers(cfg, [plan], {device_id: identity}, started + cfg.worker_budget(), log, env=worker_env, stop=stop)
        marks = coverage.annotate(cfg, chosen, [mine])
        mine["rank"] = rank
        gathered = _all_gather_json(mine, coll)
        comparison = compare.compare(gathered)
        fleet_devices = compare.apply(gathered, comparison)
        log("comparison", rank=rank, outcome=comparison["outcome"], odd=",".join(o["device"] for o in comparison["odd"]))
        extra = {"rank": rank, "world_size": world, "backend": backend, "comparison": comparison["outcome"], "coverage": marks,
                 **vtasks.summarise(cfg, [mine], log)}
        doc = sweep_doc(cfg, [fleet_devices[rank]], started, extra)
        fleet_code = compare.fleet_exit(fleet_devices, comparison["outcome"])
        host = node_name()
        peers = [d for i, d in enumerate(fleet_devices) if i != rank and d["device"].get("host") == host]
        with History(cfg.history.path, busy_timeout=cfg.history.busy_timeout_seconds) as hist:
            # {host_quarantined} counts the node's other ranks' devices from their reports, so no rank
            # may record before every rank has read the history
            states, acts = apply_policy(cfg, hist, doc, log, deadline=started + cfg.budget_seconds, stop=stop, rank=rank,
                                        world_size=world, export=False, peers=peers,
                                        before_write=lambda: _barrier("waiting for the other ranks to read the history"))
        _barrier("waiting for every rank's policy")
        if local_rank == 0:
            node_doc = sweep_doc(cfg, [d for d in fleet_devices if d["device"].get("host") == host], started, extra)
            with History(cfg.history.path, busy_timeout=cfg.history.busy_timeout_seconds) as hist:
                write_exports(cfg, hist, node_doc, log)
        fleet = None
        if rank == 0:
            fleet = fleet_doc(cfg, fleet_devices, comparison, started, sources=[f"rank {d.get('rank')}" for d in gathered])
            fleet["distributed"] = {"world_size": world, "backend": backend}
            path = cfg.distributed.fleet_report
            if path:
                files.atomic_write(path, report_mod.render(fleet, "json"))
                log("fleet_report", path=path, outcome=comparison["outcome"], exit_code=fleet["exit_code"])
        _barrier("waiting for the fleet report")
    except AegisError:
        raise
    finally:
        lock.release()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    log("sweep_done", rank=rank, exit_code=fleet_code, seconds=round(time.time() - started, 2))
    return SweepOutcome(doc, states, acts, fleet_code, fleet)


def fleet_doc(cfg, devices: list[dict], comparison: dict, started: float, sources: list[str]) -> dict:
    """The fleet report: every device's report with its fleet verdict, the comparison and
    its outcome (CONSISTENT, ODD_ONE_OUT, INCONCLUSIVE, NOT_COMPARED)."""
    doc = sweep_doc(cfg, devices, started) if cfg is not None else _bare_doc(devices)
    doc.pop("sweep", None)
    doc["kind"] = "fleet"
    doc["sources"] = sources
    doc["hosts"] = sorted({d["device"].get("host", "?") for d in devices})
    doc["comparison"] = comparison
    doc["outcome"] = comparison["outcome"]
    doc["exit_code"] = compare.fleet_exit(devices, comparison["outcome"])
    return doc


def _bare_doc(devices: list[dict]) -> dict:
    """A report header (report.Report's) around gathered devices, for runs without a sweep config."""
    now = report_mod._now()
    doc = report_mod.Report(kind="fleet", command_line=[], seed=None, options={}, started=now, finished=now).to_dict()
    doc["devices"] = devices
    return doc
