"""Fleet sweeps (docs/fleet.md, docs/architecture.md): scheduled node sweeps with one worker per device,
per-GPU history in SQLite, a quarantine policy with exports, and cross-device comparison
over torch.distributed or by merging per-node reports. Library code: never prints or exits.

    lock.py         one sweep per node at a time (fcntl.flock + holder record)
    history.py      SQLite history keyed by device UUID (WAL, versioned schema)
    policy.py       quarantine / probation state from history; Wilson bounds
    actions.py      quarantine list, Prometheus textfile, command templates
    compare.py      cross-device fingerprint comparison (odd one out / INCONCLUSIVE)
    worker.py       the per-device worker process (`python -m aegis_cli.fleet.worker`)
    logs.py         the structured log lines of sweeps and workers
    config.py       sweep.yaml → SweepConfig, checked before any work
    plan.py         device order and priority cases from the history
    workers.py      one worker process per device, timeouts, the budget
    record.py       report → history → policy → actions → exports
    sweep.py        the node sweep itself (lock, history, plan, workers, record)
    distributed.py  torchrun/srun mode: all-gather, rank 0 writes the fleet report
    merge.py        `aegis report FILES…`: per-node reports → one fleet table
    summary.py      `aegis history`: a device's record as a table, JSON or CSV
"""
