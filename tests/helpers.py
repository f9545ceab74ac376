"""Shared test helpers: run the CLI in-process and capture its exit code and output."""

from __future__ import annotations

from pathlib import Path

import pytest

from aegis_cli.cli import main

DATA = Path(__file__).parent / "data"
TINY = str(DATA / "tiny.yaml")


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out = capsys.readouterr()
    code = exc.value.code if isinstance(exc.value.code, int) else 3
    return code, out.out, out.err
