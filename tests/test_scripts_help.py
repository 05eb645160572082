"""Every script under scripts/ (what docs/results.md cites) runs and explains itself with --help.

A script is a `.py` file with a `__main__` block or a `.sh` file; the others there are
modules the scripts import (procstat.py) or load (vllm_noprog/sitecustomize.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    p
    for p in (ROOT / "scripts").rglob("*")
    if p.suffix == ".sh" or (p.suffix == ".py" and '__name__ == "__main__"' in p.read_text())
)


def test_there_are_scripts() -> None:
    assert len(SCRIPTS) >= 10  # the glob sees them: an empty list would pass every case below


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_answers_help(script: Path) -> None:
    runner = ["bash"] if script.suffix == ".sh" else [sys.executable]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [*runner, str(script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage" in out.stdout.lower(), out.stdout[:500]
