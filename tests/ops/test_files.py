"""Files aegis replaces or leaves behind, as root under cron: owner and mode kept, nothing
world-writable, and no temp files or work folders piling up after a killed run."""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess

import pytest

from aegis_cli.ops import files
from tests.fleet_helpers import aegis, env, wait_for, write_config


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another owner")
def test_replaced_export_keeps_its_owner_group_and_mode(tmp_path):
    out = tmp_path / "aegis.prom"
    out.write_text("old\n")
    os.chown(out, 65534, 65534)  # nobody:nogroup
    out.chmod(0o640)
    files.atomic_write(out, "new\n")
    st = out.stat()
    assert out.read_text() == "new\n"
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (65534, 65534, 0o640)


def test_new_export_is_not_world_writable_under_umask_000(tmp_path):
    old = os.umask(0)
    try:
        files.atomic_write(tmp_path / "report.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "report.json").stat().st_mode) == 0o644


def test_temp_files_of_a_killed_write_are_removed_and_a_live_writers_kept(tmp_path):
    out = tmp_path / "aegis.prom"
    stale = tmp_path / ".aegis.prom.k1ll3d.tmp"  # what a SIGKILL between mkstemp and rename leaves
    stale.write_text("half")
    live = tmp_path / ".aegis.prom.l1ve00.tmp"  # another writer, still writing: holds its flock
    live.write_text("busy")
    other = tmp_path / ".other.prom.k1ll3d.tmp"  # another file's temp: not ours to judge here
    other.write_text("x")
    with open(live, "rb") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        files.atomic_write(out, "metrics\n")
        assert live.exists()
    assert out.read_text() == "metrics\n" and not stale.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".aegis.prom.l1ve00.tmp", ".other.prom.k1ll3d.tmp", "aegis.prom"]


def test_work_folder_is_private_held_and_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    (tmp_path / "aegis-x-stale").mkdir()
    (tmp_path / "aegis-x-stale" / "1.json").write_text("{}")
    (tmp_path / "aegis-x-link").symlink_to(tmp_path / "aegis-x-stale")
    with files.work_dir("aegis-x-") as d:
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["aegis-x-link", os.path.basename(d)])
        assert files.remove_stale(tmp_path, "aegis-x-", dirs=True) == []  # held: a second run leaves it alone
    assert [p.name for p in tmp_path.iterdir()] == ["aegis-x-link"]


def test_work_folder_removed_by_another_run_before_it_is_held_is_made_again(tmp_path, monkeypatch):
    """Ranks of one sweep start together: one's stale-folder cleaner can remove another's folder
    between mkdtemp and its flock (a CI run failed so: 'No such file or directory')."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    made, real = [], files.tempfile.mkdtemp

    def mkdtemp(**kw):
        path = real(**kw)
        made.append(path)
        if len(made) == 1:
            assert files.remove_stale(tmp_path, "aegis-x-", dirs=True) == [path]  # not held yet: the other run's cleaner takes it
        return path

    monkeypatch.setattr(files.tempfile, "mkdtemp", mkdtemp)
    with files.work_dir("aegis-x-") as d:
        assert len(made) == 2 and d == made[1] and os.path.isdir(d)
    assert list(tmp_path.iterdir()) == []


def test_killed_sweep_leaves_no_work_folder_after_the_next_run(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    e = env(1, TMPDIR=str(tmp))
    hanging = write_config(tmp_path, inject="hang:seconds=300")
    p = subprocess.Popen(aegis("sweep", "--config", str(hanging)), env=e, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert wait_for(lambda: any(tmp.glob("aegis-sweep-*/0.json.spec")), timeout=60)
    finally:
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=60)
    assert list(tmp.glob("aegis-sweep-*"))  # SIGKILL runs no cleanup
    clean = write_config(tmp_path)
    q = subprocess.run(aegis("sweep", "--config", str(clean)), env=e, capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert q.returncode in (0, 1, 2), q.stderr
    assert not list(tmp.glob("aegis-sweep-*"))
