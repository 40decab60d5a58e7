"""Hugging Face checkpoints: load a local directory into our ``Transformer``; write a random one of a preset.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Supported architectures: ``workbench.config.SUPPORTED_ARCHITECTURES`` (Llama,
Mistral, Qwen2, and the MoE / MLA ones, whose per-expert and MLA tensors ``model.moe`` and ``model.mla`` map). Our
model fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; the loader concatenates the HF tensors.

No weights can be downloaded where this workbench is tested, so ``save_random_checkpoint`` builds a randomly
initialised model of a preset's architecture *through transformers* and saves it as a real HF checkpoint, with a
tokenizer trained offline (``workbench.model.tokenizer``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from workbench.config import SUPPORTED_ARCHITECTURES, ModelConfig
from workbench.device import torch_dtype
from workbench.errors import CheckpointError, ConfigError
from workbench.model.mla import hf_mla_shapes, mla_state
from workbench.model.moe import hf_moe_shapes, moe_state
from workbench.model.sharding import TensorParallelShard, all_reduce, empty_shard_model, shard_model
from workbench.model.transformer import Transformer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # the safetensors dtypes a weight may have


@contextmanager
def _open_safetensors(file: Path) -> Iterator[Any]:
    """``safe_open`` on ``file``; a file that is not safetensors (cut short, zeroed, empty, random bytes) is a
    CheckpointError naming it, not safetensors' own traceback."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(file), framework="pt")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"{file}: not a readable safetensors file ({exc}); write it again or fetch it whole"
        ) from None
    with handle as f:
        yield f


def _by_file(files: dict[str, Path], names: Iterable[str]) -> Iterator[tuple[Path, Any, str]]:
    """(file, its open safetensors handle, name) for each of ``names``, one file open at a time."""
    for file in sorted(set(files[n] for n in names)):
        with _open_safetensors(file) as f:
            for name in names:
                if files[name] == file:
                    yield file, f, name


def _slice(f: Any, file: Path, name: str, read: bool = False, shard: TensorParallelShard | None = None) -> Any:
    """The safetensors slice of ``name`` (nothing read), or with ``read`` the tensor: whole, or only ``shard``'s
    part (the bytes of the other ranks are never read). A damaged entry is a CheckpointError naming it."""
    from safetensors import SafetensorError

    try:
        t = f.get_slice(name)
        return (t[:] if shard is None else shard.take(t, name)) if read else t
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{file}: tensor {name} cannot be read ({exc}); the file is damaged") from None


def _tensor_files(ckpt: Path) -> dict[str, Path]:
    """Tensor name -> file that holds it."""
    if (ckpt / INDEX_FILE).exists():
        try:
            weight_map = json.loads((ckpt / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{ckpt / INDEX_FILE}: not a valid safetensors index ({exc})") from None
        files = {name: ckpt / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.exists():
                raise CheckpointError(f"{ckpt}: shard {shard.name} named in {INDEX_FILE} is missing")
        return files
    if (ckpt / SINGLE_FILE).exists():
        with _open_safetensors(ckpt / SINGLE_FILE) as f:
            return {name: ckpt / SINGLE_FILE for name in f.keys()}  # noqa: SIM118
    raise CheckpointError(f"{ckpt}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are supported)")


def _expected_hf_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes for this config."""
    h, lin = cfg.hidden_size, cfg.linear_shapes()
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        if cfg.is_moe_layer(layer):
            shapes |= hf_moe_shapes(cfg, layer)
        else:
            shapes |= {p + f"mlp.{n}.weight": lin[n] for n in ("gate_proj", "up_proj", "down_proj")}
        if cfg.is_mla:
            shapes |= hf_mla_shapes(cfg, layer)
            continue
        shapes |= {p + f"self_attn.{n}.weight": lin[n] for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        if cfg.qk_norm:
            shapes |= {p + f"self_attn.{x}_norm.weight": (cfg.head_dim,) for x in "qk"}
        if cfg.attention_bias:
            shapes |= {p + f"self_attn.{x}_proj.bias": lin[f"{x}_proj"][:1] for x in "qkv"}
    return shapes


def check_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, Path], dict[str, tuple[int, ...]]]:
    """Check what a checkpoint directory says without reading a weight: its ``config.json``, every safetensors file
    (its header readable), each tensor the config needs present with its shape and a floating-point dtype, and no
    tensor the config does not use. A CheckpointError names the first problem. Returns (config, tensor name ->
    file, expected shapes). ``load_checkpoint`` starts with it; the drivers of multi-process engines call it (through
    ``check_model_source``) before they start a rank, so a bad checkpoint is one line, not a traceback per rank."""
    ckpt = Path(path)
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {ckpt}")
    if not (ckpt / "config.json").exists():
        raise CheckpointError(f"{ckpt}: missing config.json")
    try:
        cfg = ModelConfig.from_json(ckpt / "config.json", name=ckpt.name)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    files = _tensor_files(ckpt)
    expected = _expected_hf_tensors(cfg)
    missing = [n for n in expected if n not in files]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"{ckpt}: missing tensor(s) {missing[:3]}{more}")

    # a checkpoint may carry rotary tables (``rotary_emb.inv_freq``), which our model recomputes
    unused = sorted(n for n in files if n not in expected and not n.endswith("rotary_emb.inv_freq"))
    if unused:
        more = f" (and {len(unused) - 5} more)" if len(unused) > 5 else ""
        raise CheckpointError(
            f"{ckpt}: tensor(s) {unused[:5]}{more} are not used by the model config.json describes "
            f"({cfg.num_layers} layers); the config and the weights disagree (num_hidden_layers?)"
        )
    for file, f, name in _by_file(files, expected):
        t = _slice(f, file, name)
        if tuple(t.get_shape()) != expected[name]:
            raise CheckpointError(f"{ckpt}: tensor {name} has shape {tuple(t.get_shape())}, expected {expected[name]}")
        if t.get_dtype() not in FLOAT_DTYPES:  # an integer tensor would be cast silently
            raise CheckpointError(
                f"{file}: tensor {name} has dtype {t.get_dtype()}; weights must be floating point "
                f"({', '.join(FLOAT_DTYPES)}): write the checkpoint again with float weights"
            )
    return cfg, files, expected


def check_model_source(name_or_path: str | Path) -> None:
    """What ``load_model`` would refuse before reading a weight: a checkpoint directory (or the ``config.json`` of
    one) is ``check_checkpoint``-ed, anything else must resolve to a model config (a preset or a config.json)."""
    path = _checkpoint_dir(name_or_path)
    if path is not None:
        check_checkpoint(path)
    else:
        ModelConfig.resolve(name_or_path)


def load_checkpoint(
    path: str | Path,
    dtype: str | torch.dtype = "fp32",
    device: str | torch.device = "cpu",
    tensor_parallel: tuple[int, int] | None = None,
) -> Transformer:
    """Load a local HF checkpoint directory. Errors name the missing file or tensor, or the wrong shape.

    ``tensor_parallel`` ``(rank, size)``: load only that rank's shard (``workbench.model.sharding``): every
    tensor is read as a slice of the file, so the rank never holds the whole model.
    """
    cfg, files, expected = check_checkpoint(path)
    shard = None if tensor_parallel is None else TensorParallelShard(cfg, *tensor_parallel)
    tensors: dict[str, torch.Tensor] = {}
    for file, f, name in _by_file(files, expected):
        value = _slice(f, file, name, read=True, shard=shard)
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise CheckpointError(f"{file}: tensor {name} holds {bad} NaN or infinite value(s)")
        tensors[name] = value
    return _model_from_tensors(cfg, tensors, shard).to(device=device, dtype=torch_dtype(dtype)).eval()


def _model_from_tensors(
    cfg: ModelConfig, tensors: dict[str, torch.Tensor], shard: TensorParallelShard | None
) -> Transformer:
    """Our fp32 model (or ``shard``'s rank of it) holding the checkpoint-named ``tensors`` (already cut to the
    shard): q/k/v and gate/up concatenated into the fused ``qkv_proj`` and ``gate_up_proj``."""
    if shard is None:
        model = Transformer.from_config(cfg, dtype=torch.float32, device="cpu", init_std=0.0)
    else:
        model = empty_shard_model(shard)
    state: dict[str, torch.Tensor] = {
        "embed_tokens.weight": tensors["model.embed_tokens.weight"],
        "norm.weight": tensors["model.norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        state["lm_head.weight"] = tensors["lm_head.weight"]
    for layer in range(cfg.num_layers):
        p, o = f"model.layers.{layer}.", f"layers.{layer}."
        attn = p + "self_attn."
        state |= {o + n: tensors[p + n] for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
        if cfg.is_moe_layer(layer):
            state |= moe_state(cfg, layer, tensors)
        else:
            state[o + "mlp.gate_up_proj.weight"] = torch.cat(
                [tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]]
            )
            state[o + "mlp.down_proj.weight"] = tensors[p + "mlp.down_proj.weight"]
        if cfg.is_mla:
            state |= mla_state(cfg, layer, tensors)
            continue
        state[o + "self_attn.qkv_proj.weight"] = torch.cat([tensors[attn + f"{x}_proj.weight"] for x in "qkv"])
        if cfg.attention_bias:
            state[o + "self_attn.qkv_proj.bias"] = torch.cat([tensors[attn + f"{x}_proj.bias"] for x in "qkv"])
        state[o + "self_attn.o_proj.weight"] = tensors[attn + "o_proj.weight"]
        if cfg.qk_norm:
            state |= {o + f"self_attn.{x}_norm.weight": tensors[attn + f"{x}_norm.weight"] for x in "qk"}
    with torch.no_grad():
        params = dict(model.named_parameters()) | dict(model.named_buffers())  # buffers: a router's bias
        for name, value in state.items():
            params[name].copy_(value.float())
    if shard is not None:
        shard_model(model, shard, all_reduce)
    return model


def _checkpoint_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """A dense model's weights under the checkpoint's names (the fused projections split again)."""
    cfg, ours = model.config, model.state_dict()
    tensors = {"model." + name: ours[name] for name in ("embed_tokens.weight", "norm.weight")}
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = ours["lm_head.weight"]
    for name, value in ours.items():
        if name.startswith("layers."):
            layer, _, rest = name.removeprefix("layers.").partition(".")
            p = f"model.layers.{layer}."
            if rest.startswith("self_attn.qkv_proj."):
                kind = rest.rpartition(".")[2]
                for x, part in zip("qkv", value.split([cfg.q_size, cfg.kv_size, cfg.kv_size])):
                    tensors[p + f"self_attn.{x}_proj.{kind}"] = part
            elif rest == "mlp.gate_up_proj.weight":
                gate, up = value.split(cfg.intermediate_size)
                tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"] = gate, up
            else:
                tensors[p + rest] = value
    return tensors


def hf_config_object(cfg: ModelConfig):  # noqa: ANN201  (a transformers PretrainedConfig)
    """The transformers config object for our ModelConfig."""
    from transformers import AutoConfig

    hf = {k: v for k, v in cfg.to_hf_config().items() if k not in ("architectures", "torch_dtype")}
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    config.architectures = [cfg.architecture]
    return config


def save_random_checkpoint(
    cfg: ModelConfig | str,
    out_dir: str | Path,
    seed: int = 0,
    dtype: str = "fp32",
    max_shard_size: str = "2GB",
    tokenizer: bool = True,
) -> Path:
    """Build a randomly initialised HF model of ``cfg``'s architecture with transformers and save it to ``out_dir``,
    with a byte-level BPE tokenizer trained on the shipped public-domain text (``workbench.model.tokenizer``)
    unless ``tokenizer`` is False."""
    if isinstance(cfg, str):
        cfg = ModelConfig.resolve(cfg)
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"unsupported architecture {cfg.architecture}")
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ConfigError(f"{out_dir} exists and is not a folder; a checkpoint is written into a folder")
    import transformers

    config = hf_config_object(cfg)
    torch.manual_seed(seed)
    model_cls = getattr(transformers, cfg.architecture)
    model = model_cls(config).to(torch_dtype(dtype)).eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    if tokenizer:
        from workbench.model.tokenizer import train_tokenizer

        train_tokenizer(cfg).save_pretrained(str(out))  # tokenizer.json and its configs
    return out


def _checkpoint_dir(name_or_path: str | Path) -> Path | None:
    """The checkpoint directory ``name_or_path`` names (a ``config.json`` beside safetensors weights names that
    checkpoint), or None for a preset or a lone config.json."""
    path = Path(name_or_path)
    if path.is_file() and path.name == "config.json":
        path = path.parent
        if not ((path / SINGLE_FILE).exists() or (path / INDEX_FILE).exists()):
            return None
    return path if path.is_dir() else None


def load_model(
    name_or_path: str | Path,
    dtype: str | torch.dtype = "fp32",
    device: str | torch.device = "cpu",
    seed: int = 0,
    tensor_parallel: tuple[int, int] | None = None,
) -> Transformer:
    """A checkpoint directory (real weights) or a preset name / config.json (random weights, seeded).

    A ``config.json`` beside safetensors weights is that checkpoint: its weights are loaded.

    ``tensor_parallel`` ``(rank, size)``: that rank's shard. A checkpoint is read slice by slice; a preset's
    random weights are drawn whole (the same for every size, so shards of one seed add up to the same model)
    and then cut.
    """
    path = _checkpoint_dir(name_or_path)
    if path is not None:
        return load_checkpoint(path, dtype=dtype, device=device, tensor_parallel=tensor_parallel)
    cfg = ModelConfig.resolve(name_or_path)
    if tensor_parallel is None:
        return Transformer.from_config(cfg, dtype=torch_dtype(dtype), device=device, seed=seed)
    shard = TensorParallelShard(cfg, *tensor_parallel)  # cut from the whole model, as from a checkpoint's tensors
    full = _checkpoint_tensors(Transformer.from_config(cfg, dtype=torch.float32, device="cpu", seed=seed))
    tensors = {name: shard.take(value, name) for name, value in full.items()}
    return _model_from_tensors(cfg, tensors, shard).to(device, torch_dtype(dtype)).eval()
