"""The loader's dtype advice from CPU flags (pdserve.model.cpu_features)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pdserve.config import ModelConfig
from pdserve.model import loader
from pdserve.model.cpu_features import cpu_flags, dtype_advice

AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
AVX2 = frozenset({"avx", "avx2", "fma"})


def test_flags_are_read_from_the_first_cpu(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t: x\n")
    assert cpu_flags(info) == frozenset({"fpu", "avx2", "amx_bf16"})
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_advice_points_to_the_faster_dtype_only() -> None:
    assert "--dtype bfloat16" in (dtype_advice(torch.float32, AMX) or "")
    assert "--dtype float32" in (dtype_advice(torch.bfloat16, AVX2) or "")
    assert dtype_advice(torch.bfloat16, AMX) is None
    assert dtype_advice(torch.float32, AVX2) is None
    assert dtype_advice(torch.bfloat16, frozenset()) is None  # flags unknown: no advice


def test_the_loader_logs_the_advice_for_this_cpu(tmp_path: Path, caplog, monkeypatch) -> None:
    monkeypatch.setattr(loader, "cpu_flags", lambda: AMX)
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        loader.load_model(ModelConfig(model="builtin:tiny", dtype="float32", cache_dir=tmp_path))
    assert any("AMX-BF16" in r.getMessage() for r in caplog.records)
