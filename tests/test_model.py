"""The Llama decoder: shapes, causality, parameter count, and logits equal to transformers' Llama."""

import dataclasses
import json
import math

import pytest
import torch

from picotron.config import PRESETS, ModelConfig
from picotron.hf import config_from_hf, load_hf_llama
from picotron.model import Llama, loss_fn
from picotron.tolerance import LOSS_ATOL, assert_close, compare_all, llama_roundings

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_seq_len=32)


def small_model(**overrides) -> Llama:
    torch.manual_seed(0)
    return Llama(ModelConfig(**{**SMALL, **overrides}))


def test_logits_shape_and_dtype():
    logits = small_model()(torch.randint(0, 64, (3, 10)))
    assert logits.shape == (3, 10, 64) and logits.dtype == torch.float32


def test_causal_future_token_does_not_change_past_logits():
    model = small_model()
    ids = torch.randint(0, 64, (2, 16))
    changed = ids.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 64
    before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :9], after[:, :9], rtol=0, atol=0)
    assert (before[:, 9:] - after[:, 9:]).abs().max() > 1e-4


def test_rope_depends_only_on_relative_positions():
    # Shifting every position by the same offset leaves q.k unchanged: what context
    # parallelism relies on when a rank's positions do not start at 0.
    model = small_model()
    ids = torch.randint(0, 64, (2, 12))
    n = llama_roundings(model.config, 12, 2 * 12)   # float32 round-off of the model (picotron.tolerance)
    shifted = model(ids, position_ids=torch.arange(12) + 7)
    assert_close(shifted, model(ids), n=n)
    per_row = model(ids, position_ids=torch.stack([torch.arange(12), torch.arange(12) + 20]))
    assert_close(per_row, model(ids), n=n)


def test_too_long_sequence_is_refused():
    with pytest.raises(ValueError, match="max_seq_len=32"):
        small_model()(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_num_params_matches_config_on_meta(name):
    config = ModelConfig.preset(name)
    with torch.device("meta"):
        model = Llama(config)
    assert model.num_params() == config.num_params()


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("tied", [True, False])
def test_gqa_and_tied_variants_train(kv_heads, tied):
    model = small_model(num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.embed.weight) == tied
    assert model.num_params() == model.config.num_params()
    ids = torch.randint(0, 64, (2, 8))
    loss = loss_fn(model(ids[:, :-1]), ids[:, 1:])
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_init_is_seeded_and_scales_output_projections():
    a, b = small_model(), small_model()
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    big = small_model(hidden_size=128, intermediate_size=512, num_layers=8)
    expected = 0.02 / math.sqrt(2 * 8)
    assert big.layers[0].attn.o_proj.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert big.layers[0].mlp.down_proj.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert big.layers[0].attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_meta_build_then_to_empty_and_init_weights_equals_direct_build():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(ModelConfig(**SMALL))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    assert model.lm_head.weight is model.embed.weight
    direct = small_model()      # its __init__ drew from the RNG too (nn.Linear's own init): reseed
    torch.manual_seed(0)
    direct.init_weights()
    ids = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(model(ids), direct(ids), rtol=0, atol=0)


def test_loss_of_uniform_logits_is_log_vocab():
    assert loss_fn(torch.zeros(2, 5, 64), torch.randint(0, 64, (2, 5))).item() == pytest.approx(math.log(64))


def test_unknown_rope_type_is_refused():
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        small_model(rope_scaling={"rope_type": "yarn", "factor": 4.0})


# ---- Hugging Face checkpoints ------------------------------------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def save_hf_llama(folder, tied=False, rope=None, **save_kwargs):
    """A small random transformers LlamaForCausalLM saved to `folder`; returns the model."""
    transformers = pytest.importorskip("transformers")
    rope = rope or {"rope_type": "default", "rope_theta": 10000.0}
    if int(transformers.__version__.split(".")[0]) < 5:   # the layout before rope_parameters (4.x)
        rope_kwargs = {"rope_theta": rope["rope_theta"],
                       "rope_scaling": None if rope["rope_type"] == "default" else
                       {k: v for k, v in rope.items() if k != "rope_theta"}}
    else:
        rope_kwargs = {"rope_parameters": rope}
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied, rms_norm_eps=1e-5,
        attn_implementation="sdpa", **rope_kwargs)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():   # larger than the 0.02 init, and norms != 1, so a wrong mapping shows
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(folder, **save_kwargs)
    return model


@pytest.mark.parametrize("tied, rope, shard", [(True, None, None), (False, None, None),
                                               (False, LLAMA3_ROPE, None), (True, LLAMA3_ROPE, "40KB")])
def test_logits_equal_transformers(tmp_path, tied, rope, shard):
    hf_model = save_hf_llama(tmp_path, tied=tied, rope=rope, **({"max_shard_size": shard} if shard else {}))
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    model = load_hf_llama(tmp_path)
    assert (model.lm_head.weight is model.embed.weight) == tied
    assert model.config.rope_scaling == (None if rope is None else {k: v for k, v in rope.items() if k != "rope_theta"})
    ids = torch.randint(0, 256, (2, 100))      # beyond original_max_position_embeddings=32
    with torch.no_grad():
        expected = hf_model(ids).logits
        actual = model(ids)
    assert_close(actual, expected, n=llama_roundings(model.config, 100, 2 * 100))   # float32 round-off


def test_config_from_old_transformers_layout():
    old = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
           "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0}}
    config = config_from_hf(old)
    assert (config.num_key_value_heads, config.head_dim, config.rope_theta) == (4, 16, 500000.0)
    assert config.rope_scaling["original_max_position_embeddings"] == 64
    assert config.tie_word_embeddings is False and config.rms_norm_eps == 1e-6


@pytest.mark.parametrize("key, value, message", [
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("attention_bias", True, "attention_bias=True"),
    ("model_type", "mistral", "model_type='mistral'"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, "rope_type='yarn'"),
])
def test_unsupported_config_is_refused(tmp_path, key, value, message):
    save_hf_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_hf_llama(tmp_path)


@pytest.mark.parametrize("change", ["drop", "add"])
def test_missing_or_unexpected_tensor_is_refused(tmp_path, change):
    from safetensors.torch import load_file, save_file

    save_hf_llama(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    if change == "drop":
        del tensors["model.layers.1.mlp.up_proj.weight"]
        message = r"missing tensors \['layers.1.mlp.up_proj.weight'\]"
    else:
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
        message = r"unexpected tensors \['layers.0.attn.q_proj.bias'\]"
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        load_hf_llama(tmp_path)


# ---- mixture of experts (chapter 07) ----------------------------------------------------------------

MOE = dict(SMALL, num_experts=4, experts_per_token=2)


@pytest.mark.parametrize("moe_every, tied", [(1, True), (2, False)])
def test_moe_layers_and_parameter_count(moe_every, tied):
    model = small_model(**MOE, moe_every=moe_every, tie_word_embeddings=tied)
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == (["MoE", "MoE"] if moe_every == 1 else ["MLP", "MoE"])   # layers i with (i + 1) % moe_every == 0
    assert model.num_params() == model.config.num_params()
    dense = ModelConfig(**SMALL, tie_word_embeddings=tied)
    per_moe_layer = 3 * 32 * 64 * 3 + 32 * 4                                  # three more experts + the router
    assert model.config.num_params() == dense.num_params() + len(model.moe_layers()) * per_moe_layer
    active = model.config.num_params() - len(model.moe_layers()) * 2 * 3 * 32 * 64   # two of four experts idle
    assert model.config.num_active_params() == active and dense.num_active_params() == dense.num_params()


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_moe_recomputation_gives_identical_gradients(recompute):
    ids = torch.randint(0, 64, (2, 12))
    grads = {}
    for mode in ("none", recompute):
        model = small_model(**MOE, recompute=mode)
        (loss_fn(model(ids[:, :-1]), ids[:, 1:]) + model.aux_loss()).backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads["none"].items():
        torch.testing.assert_close(grads[recompute][name], grad, rtol=0, atol=0)


def test_dense_model_has_no_aux_loss():
    model = small_model()
    model(torch.randint(0, 64, (2, 8)))
    assert model.moe_layers() == [] and model.aux_loss().item() == 0.0


@pytest.mark.parametrize("change, message", [
    (dict(num_experts=-1), "num_experts=-1"),
    (dict(experts_per_token=5), "experts_per_token=5 must be between 1 and num_experts=4"),
    (dict(moe_capacity_factor=0.0), "moe_capacity_factor=0.0 must be > 0"),
    (dict(moe_aux_loss_coef=-0.1), "moe_aux_loss_coef=-0.1 must be >= 0"),
    (dict(moe_every=3), "moe_every=3 leaves no MoE layer among num_layers=2"),
])
def test_bad_moe_settings_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        small_model(**{**MOE, **change})


def test_triton_norms_by_config_compute_what_torch_norms_compute():
    """norm_impl="triton" builds picotron.kernels.rmsnorm.TritonRMSNorm (the Triton interpreter on a CPU): the same
    state dict, loss and gradients as the torch RMSNorm."""
    pytest.importorskip("triton")
    from picotron.kernels.runtime import kernel_device
    device = kernel_device()                     # the interpreter's CPU, or the GPU the kernels are compiled for
    config = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4,
                         num_key_value_heads=2)
    torch.manual_seed(0)
    plain = Llama(config).to(device)
    kernels = Llama(dataclasses.replace(config, norm_impl="triton")).to(device)
    kernels.load_state_dict(plain.state_dict())
    assert type(kernels.norm).__name__ == "TritonRMSNorm" and type(plain.norm).__name__ == "RMSNorm"
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    losses = [loss_fn(m(ids[:, :-1]), ids[:, 1:]) for m in (plain, kernels)]
    for loss in losses:
        loss.backward()
    assert abs(losses[1].item() - losses[0].item()) < LOSS_ATOL          # the course's claim for fp32 losses
    grads = compare_all({name: q.grad for name, q in kernels.named_parameters()},
                        {name: p.grad for name, p in plain.named_parameters()}, n=llama_roundings(config, 15, 2 * 15))
    assert grads, str(grads)
    with torch.no_grad():                        # init_weights resets every norm, of either kind, to ones
        for name, q in kernels.named_parameters():
            if "norm" in name:
                q.fill_(2.0)
    kernels.init_weights()
    assert all((q == 1).all() for name, q in kernels.named_parameters() if "norm" in name)
    with pytest.raises(ValueError, match="norm_impl='cuda'; choose one of \\('torch', 'triton'\\)"):
        Llama(dataclasses.replace(config, norm_impl="cuda"))
