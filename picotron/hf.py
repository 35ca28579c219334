"""Load a Hugging Face Llama checkpoint folder (config.json + *.safetensors) into `picotron.model.Llama`.

tests/test_model.py checks that its logits equal transformers' for the same checkpoint.

picotron's decoder holds the same tensors as transformers' `LlamaForCausalLM` under shorter
names, and applies RoPE with the same "rotate_half" convention, so loading is a rename and a
copy: no weight is permuted or reshaped. Only the `safetensors` package is needed;
transformers is never imported here (tests use it, through the optional `[hf]` extra, to
check that both models give the same logits).

Anything picotron's model cannot represent exactly (biases, another activation, another RoPE
variant, partial rotary) is refused with a ValueError that names the config key
and its value, rather than loaded into a model that would silently compute something else.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from picotron.config import ModelConfig
from picotron.model import Llama

# Keys whose value must be exactly this for picotron's model to compute what the checkpoint means.
_REQUIRED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
             "attention_dropout": 0.0, "partial_rotary_factor": 1.0}

# Keys config_from_hf cannot do without (the others have transformers' defaults).
_NEEDED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

# Hugging Face name pieces -> picotron's; applied in order to every tensor name.
_RENAMES = [("model.embed_tokens.", "embed."), ("model.norm.", "norm."), ("model.layers.", "layers."),
            (".self_attn.", ".attn."), (".input_layernorm.", ".attn_norm."),
            (".post_attention_layernorm.", ".mlp_norm.")]


def config_from_hf(folder_or_dict: str | Path | dict) -> ModelConfig:
    """A ModelConfig from a Hugging Face Llama config.json (a folder holding it, or its dict)."""
    hf = folder_or_dict if isinstance(folder_or_dict, dict) else _read_json(_folder(folder_or_dict) / "config.json")
    if hf.get("model_type") != "llama":
        raise ValueError(f"model_type={hf.get('model_type')!r}: picotron loads only 'llama' checkpoints")
    missing = [key for key in _NEEDED if key not in hf]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}: it is not a complete Llama config; use the "
                         f"config.json saved with the checkpoint (save_pretrained writes it)")
    for key, wanted in _REQUIRED.items():
        if key in hf and hf[key] != wanted:
            raise ValueError(f"config.json has {key}={hf[key]!r} but picotron's Llama supports only "
                             f"{key}={wanted!r}; this checkpoint cannot be loaded exactly")
    rope_theta, rope_scaling = _rope_from_hf(hf)
    heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),              # transformers' LlamaConfig defaults
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        init_std=hf.get("initializer_range", 0.02),
    )


def _rope_from_hf(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config layout.

    transformers < 5 writes top-level `rope_theta` and `rope_scaling` ({"rope_type" or "type": ...});
    transformers 5 writes one `rope_parameters` dict holding rope_theta and the type.
    """
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"rope_parameters={params!r} sets a different RoPE per layer type; "
                         f"picotron supports one RoPE for all layers")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported; "
                         f"picotron rotates every channel of a head")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"rope_type={rope_type!r} is not supported; picotron implements 'default' and 'llama3'")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise ValueError(f"llama3 rope scaling {params!r} lacks {missing}")
    return theta, {"rope_type": "llama3", "factor": params["factor"],
                   "low_freq_factor": params["low_freq_factor"], "high_freq_factor": params["high_freq_factor"],
                   "original_max_position_embeddings": params.get("original_max_position_embeddings",
                                                                  hf.get("max_position_embeddings"))}


def hf_name_to_picotron(name: str) -> str:
    """model.layers.3.self_attn.q_proj.weight -> layers.3.attn.q_proj.weight, and so on."""
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name


def load_hf_llama(folder: str | Path) -> Llama:
    """Build a fp32 Llama from a Hugging Face checkpoint folder, checking every tensor name and shape."""
    folder = _folder(folder)
    model = Llama(config_from_hf(folder))
    tensors = {hf_name_to_picotron(name): t for name, t in _read_safetensors(folder).items()
               if not name.endswith("rotary_emb.inv_freq")}       # old checkpoints saved this table
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)   # tied: transformers ignores it too and reuses the embedding
    expected = {name: p.shape for name, p in model.named_parameters()}  # a tied lm_head is not listed
    _check_names_and_shapes(folder, expected, tensors)
    model.load_state_dict(tensors, strict=False)   # strict=False only for the tied lm_head alias
    return model


def _check_names_and_shapes(folder: Path, expected: dict, tensors: dict) -> None:
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint {folder} does not match picotron's Llama: missing tensors {missing}, "
                         f"unexpected tensors {unexpected} (names after renaming to picotron's)")
    wrong = [f"{n}: checkpoint {tuple(t.shape)} vs model {tuple(expected[n])}"
             for n, t in tensors.items() if t.shape != expected[n]]
    if wrong:
        raise ValueError(f"checkpoint {folder} has tensors of the wrong shape for its config.json: {wrong}")


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards listed in model.safetensors.index.json."""
    from safetensors.torch import load_file   # imported here: only checkpoint loading needs it

    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(_read_json(index)["weight_map"].values()))
    elif (folder / "model.safetensors").exists():
        shards = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {folder}; "
                                f"picotron reads only safetensors checkpoints (re-save with "
                                f"save_pretrained(..., safe_serialization=True))")
    tensors = {}
    for shard in shards:
        tensors.update(load_file(folder / shard))
    return tensors


def _folder(folder: str | Path) -> Path:
    """`folder` as a Path, with FileNotFoundError naming the fix unless it is a folder holding config.json."""
    folder = Path(folder)
    what = ("is a file" if folder.is_file() else "does not exist" if not folder.exists() else
            "has no config.json" if not (folder / "config.json").is_file() else "")
    if what:
        raise FileNotFoundError(f"{folder} {what}: point to a Hugging Face checkpoint folder, the one holding "
                                f"config.json and model.safetensors (e.g. what huggingface_hub.snapshot_download "
                                f"returns)")
    return folder


def _read_json(path: Path) -> dict:
    """A JSON file of the checkpoint; FileNotFoundError or ValueError naming the file if it cannot be read."""
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: point to a Hugging Face checkpoint folder")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}); "
                         f"download it again") from None
