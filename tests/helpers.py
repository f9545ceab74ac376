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


def cuda_kernels() -> list[str]:
    """The checked-GEMM kernels this machine's GPU runs: wgmma on sm_90 only (mma without a GPU)."""
    import torch

    if not torch.cuda.is_available():
        return ["mma"]
    return ["mma", "wgmma"] if torch.cuda.get_device_capability(0) == (9, 0) else ["mma"]
