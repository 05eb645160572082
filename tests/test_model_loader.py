"""Loader: path resolution, dtype rule, and clear errors for checkpoints that do not fit."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.config import ModelConfig
from pdserve.model.builtin import ensure_builtin
from pdserve.model.loader import load_model, resolve_dtype
from pdserve.model.spec import ModelSpec


@pytest.fixture(scope="module")
def builtin_dir(tmp_path_factory) -> Path:
    return ensure_builtin("tiny", tmp_path_factory.mktemp("cache"))


@pytest.fixture
def copy_dir(tmp_path, builtin_dir) -> Path:
    return Path(shutil.copytree(builtin_dir, tmp_path / "model"))


def rewrite_weights(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def test_local_directory_loads(copy_dir):
    lm = load_model(ModelConfig(model=str(copy_dir)))
    assert lm.name == "model" and lm.dtype == torch.float32 and lm.path == copy_dir


def test_missing_directory_says_no_downloads(tmp_path):
    with pytest.raises(FileNotFoundError, match="hub downloads"):
        load_model(ModelConfig(model="Qwen/Qwen3-0.6B", cache_dir=tmp_path))


def test_directory_without_weights(copy_dir):
    (copy_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(ModelConfig(model=str(copy_dir)))


def test_missing_tensor_is_named(copy_dir):
    rewrite_weights(copy_dir, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(ModelConfig(model=str(copy_dir)))


def test_unexpected_tensor_is_named(copy_dir):
    rewrite_weights(copy_dir, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected model\.extra\.weight"):
        load_model(ModelConfig(model=str(copy_dir)))


def test_ignorable_tensors_are_accepted(copy_dir):
    """Old checkpoints carry rotary inv_freq; tied ones sometimes also save lm_head."""

    def add(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    rewrite_weights(copy_dir, add)
    assert load_model(ModelConfig(model=str(copy_dir))).spec.tie_word_embeddings


def test_wrong_shape_is_named(copy_dir):
    rewrite_weights(copy_dir, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight: checkpoint shape"):
        load_model(ModelConfig(model=str(copy_dir)))


def test_unsupported_architecture(copy_dir):
    config = json.loads((copy_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (copy_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(ModelConfig(model=str(copy_dir)))


def test_dtype_rule(builtin_dir, caplog):
    config = json.loads((builtin_dir / "config.json").read_text())
    spec = ModelSpec.from_hf_config(config)
    assert resolve_dtype("auto", spec, "cpu") == torch.float32
    assert resolve_dtype("bfloat16", spec, "cpu") == torch.bfloat16
    bf16 = ModelSpec.from_hf_config({**config, "torch_dtype": "bfloat16"})
    assert resolve_dtype("auto", bf16, "cpu") == torch.bfloat16
    fp16 = ModelSpec.from_hf_config({**config, "torch_dtype": "float16"})
    with caplog.at_level(logging.WARNING):
        assert resolve_dtype("auto", fp16, "cpu") == torch.float32
    assert "float16" in caplog.text
    assert resolve_dtype("float16", fp16, "cpu") == torch.float16
    no_dtype = ModelSpec.from_hf_config({**config, "torch_dtype": None})
    assert no_dtype.torch_dtype == "float32"
    assert resolve_dtype("auto", no_dtype, "cpu") == torch.float32


def test_weights_land_in_the_right_rows(builtin_dir):
    """q/k/v and gate/up are fused: each HF tensor must fill exactly its own rows."""
    lm = load_model(ModelConfig(model="builtin:tiny", cache_dir=builtin_dir.parent))
    tensors = load_file(builtin_dir / "model.safetensors")
    attn = lm.model.layers[1].self_attn.qkv_proj.weight
    q, k, v = attn.split((lm.spec.q_size, lm.spec.kv_size, lm.spec.kv_size))
    assert torch.equal(q, tensors["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(k, tensors["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(v, tensors["model.layers.1.self_attn.v_proj.weight"])
    gate, up = lm.model.layers[0].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(gate, tensors["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(up, tensors["model.layers.0.mlp.up_proj.weight"])
