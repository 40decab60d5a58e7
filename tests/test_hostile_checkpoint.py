"""Hostile checkpoints (issue 14): damaged safetensors, config and weights that disagree, non-finite weights, a
string rope_scaling, and ``--model DIR/config.json``; each a CheckpointError or ConfigError naming the file."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from workbench.cli import main
from workbench.config import ModelConfig
from workbench.errors import CheckpointError, ConfigError
from workbench.model.checkpoint import load_checkpoint, load_model


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path):
    """A private copy of a tiny-gqa checkpoint that a test may damage."""
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("tiny-gqa"), out)
    return out


def cut_in_half(f):
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def zero_header(f):
    data = bytearray(f.read_bytes())
    data[:8] = bytes(8)
    f.write_bytes(bytes(data))


def random_bytes(f):
    f.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)).byte().numpy().tobytes())


def empty(f):
    f.write_bytes(b"")


@pytest.mark.parametrize("damage", [cut_in_half, zero_header, random_bytes, empty])
def test_corrupt_safetensors_is_a_checkpoint_error_naming_the_file(ckpt, damage, capsys):
    file = ckpt / "model.safetensors"
    damage(file)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(ckpt)
    rc = main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2"])
    err = capsys.readouterr().err
    assert rc == 2 and str(file) in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_fewer_layers_in_config_than_in_file_names_the_unused_tensors(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\..* not used .*1 layers"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weight_is_named(ckpt, value):
    file = ckpt / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = value
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj\.weight holds 1 NaN or infinite"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_rope_scaling_as_a_string_is_a_config_error(ckpt, key):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg[key] = "linear"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=f"{key} must be an object .* got 'linear'"):
        ModelConfig.from_json(ckpt / "config.json")
    with pytest.raises(CheckpointError, match=f"{key} must be an object"):
        load_checkpoint(ckpt)


def test_model_given_as_the_config_json_of_a_checkpoint_loads_its_weights(ckpt):
    from_dir = load_model(ckpt)
    from_json = load_model(ckpt / "config.json")
    for (name, a), (_, b) in zip(from_dir.named_parameters(), from_json.named_parameters()):
        assert torch.equal(a, b), name
    # while a lone config.json (no weights beside it) still means random weights of that shape
    lone = ckpt.parent / "lone"
    lone.mkdir()
    shutil.copy(ckpt / "config.json", lone / "config.json")
    random = load_model(lone / "config.json")
    assert not torch.equal(random.embed_tokens.weight, from_dir.embed_tokens.weight)
