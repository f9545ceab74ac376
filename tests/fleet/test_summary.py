"""``aegis history`` as a library call: the summary, retiring a device, CSV rows."""

from __future__ import annotations

import csv
import io

import pytest

from aegis_cli.fleet.history import History
from aegis_cli.fleet.summary import history_csv, show_history
from aegis_cli.ops.errors import ConfigError
from tests.fleet.test_history import doc


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "h.sqlite"
    with History(path) as h:
        h.record_sweep(doc({"GPU-a": "FAULTY", "GPU-b": "HEALTHY"}))
        h.record_sweep(doc({"GPU-a": "HEALTHY", "GPU-b": "HEALTHY"}))
    return str(path)


def test_history_csv_has_one_row_per_device_or_per_result_of_one_device(db):
    summary, _ = show_history(db)
    rows = list(csv.DictReader(io.StringIO(history_csv(summary))))
    assert [(r["uuid"], r["state"], r["sweeps"]) for r in rows] == [("GPU-a", "QUARANTINED", "2"), ("GPU-b", "ACTIVE", "2")]
    one, _ = show_history(db, ident="GPU-a")
    rows = list(csv.DictReader(io.StringIO(history_csv(one))))
    assert [r["verdict"] for r in rows] == ["FAULTY", "HEALTHY"]
    assert rows[0]["checks"] == "gemm.row_checksum"  # lists as space-separated words


def test_retire_names_exactly_one_device_and_needs_a_database(db):
    with pytest.raises(ConfigError, match="exactly one device"):
        show_history(db, retire="RMA")
    with pytest.raises(ConfigError, match="--db PATH or --config"):
        show_history(None)
    summary, retired = show_history(db, ident="GPU-a", retire="")
    assert retired == "GPU-a" and summary["devices"][0]["state"] == "RETIRED"
