"""Loading local HF checkpoints: single file, shards with an index, and the errors for broken directories."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from workbench.errors import CheckpointError
from workbench.model import load_checkpoint, save_random_checkpoint


def test_sharded_checkpoint_loads_the_same_weights(tiny_checkpoint, tmp_path):
    single = load_checkpoint(tiny_checkpoint("tiny-gqa"))
    sharded_dir = save_random_checkpoint("tiny-gqa", tmp_path / "sharded", seed=0, max_shard_size="40KB")
    assert (sharded_dir / "model.safetensors.index.json").exists()
    assert len(list(sharded_dir.glob("model-*.safetensors"))) > 1
    sharded = load_checkpoint(sharded_dir)
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_dtype_and_tied_embeddings(tiny_checkpoint):
    model = load_checkpoint(tiny_checkpoint("tiny-qwen2"), dtype="bf16")
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_directory_and_files(tmp_path, tiny_checkpoint):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "nope")
    d = _copy(tiny_checkpoint("tiny-mha"), tmp_path / "noconfig")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_checkpoint(d)
    d = _copy(tiny_checkpoint("tiny-mha"), tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(d)


def test_unsupported_architecture(tmp_path, tiny_checkpoint):
    d = _copy(tiny_checkpoint("tiny-mha"), tmp_path / "gpt2")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel"):
        load_checkpoint(d)


def test_missing_and_misshaped_tensors_are_named(tmp_path, tiny_checkpoint):
    d = _copy(tiny_checkpoint("tiny-mha"), tmp_path / "missing")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(d)

    d = _copy(tiny_checkpoint("tiny-mha"), tmp_path / "shape")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"k_proj\.weight has shape \(8, 64\), expected \(64, 64\)"):
        load_checkpoint(d)


def test_missing_shard_named(tmp_path):
    d = save_random_checkpoint("tiny-mha", tmp_path / "s", max_shard_size="40KB")
    victim = sorted(d.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_checkpoint(d)
