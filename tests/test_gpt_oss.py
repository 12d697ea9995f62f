"""gpt-oss's layer options, each against an independent reference: attention sinks in the blockwise
attention against the "xla" one (values and gradients, the sinks' own included), the clamped
experts with biases on every MoE path against the dense one, YaRN against transformers' own
frequencies, MXFP4 against transformers' dequantization, the import of an MXFP4 checkpoint, and
the config checks that refuse what cannot take sinks or YaRN. The whole model against transformers
(logits, generation, round trip, a sharded run): tests/test_families.py."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm.models import moe
from maxtext_rocm.models.attention import attention_mask, implementation_for, masked_attention
from maxtext_rocm.models.blockwise_attention import blockwise_attention
from maxtext_rocm.models.layers import rope_attention_factor, yarn_inv_frequencies

YARN = {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position": 4096, "truncate": False,
        "attention_factor": None}


# ----------------------------------------------------------------------------------------------
# Attention sinks


@pytest.mark.parametrize("window", [0, 12])
def test_blockwise_sinks_match_the_xla_attention_values_and_gradients(window):
    """Four blocks of 8 (a window of 12 spans two), 4 query heads on 2 kv heads, sinks of both
    signs: the outputs and the gradients of q, k, v and the sinks equal the "xla" attention's."""
    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v = (jax.random.normal(key, (2, 32, heads, 8)) for key, heads in zip(keys, (4, 2, 2)))
    sinks = jnp.array([-1.0, 0.5, 2.0, 0.0])
    probe = jax.random.normal(keys[3], (2, 32, 4, 8))

    def xla(q, k, v, sinks):
        return masked_attention(q, k, v, attention_mask(32, None, window), sinks=sinks)

    def blockwise(q, k, v, sinks):
        return blockwise_attention(q, k, v, sliding_window=window, block=8, sinks=sinks)

    def loss(f):
        return lambda *args: jnp.sum(f(*args) * probe)

    np.testing.assert_allclose(blockwise(q, k, v, sinks), xla(q, k, v, sinks), atol=1e-5)
    ours = jax.grad(loss(blockwise), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    reference = jax.grad(loss(xla), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    assert np.abs(reference[3]).min() > 1e-3  # the sinks' gradient is compared where it is not zero
    for name, a, b in zip("qkvs", ours, reference):
        np.testing.assert_allclose(a, b, atol=1e-4, err_msg=name)


def test_a_sink_takes_its_share_of_each_row():
    """One key, one head: the query's weight on it is 1 / (1 + exp(sink - score)), not 1."""
    q, k = jnp.ones((1, 1, 1, 4)), jnp.ones((1, 1, 1, 4))
    v = jnp.full((1, 1, 1, 4), 3.0)
    out = masked_attention(q, k, v, attention_mask(1, None), sinks=jnp.array([2.0]))
    score = 4 * 4 ** -0.5
    np.testing.assert_allclose(out, 3.0 / (1 + math.exp(2.0 - score)), rtol=1e-6)


def test_auto_never_picks_a_kernel_without_sinks():
    assert implementation_for("auto", "cuda", jnp.bfloat16, 4096) == "cudnn"
    assert implementation_for("auto", "cuda", jnp.bfloat16, 4096, sinks=True) == "blockwise"


# ----------------------------------------------------------------------------------------------
# The experts: clamped SwiGLU with biases, on every path


def _experts(seed=0, n_experts=4, d=16, f=8, batch=2, seq=24, k=2):
    keys = jax.random.split(jax.random.key(seed), 9)
    x = jax.random.normal(keys[0], (batch, seq, d))
    logits = jax.random.normal(keys[1], (batch, seq, n_experts))
    _, weights, experts = moe.route(logits, k, kind="topk_softmax")
    # wide enough that the clamp at 7 bites on some rows, both ways on up
    gate, up = (3.0 * jax.random.normal(key, (n_experts, d, f)) for key in keys[2:4])
    down = jax.random.normal(keys[4], (n_experts, f, d)) * 0.3
    gate_bias, up_bias = (jax.random.normal(key, (n_experts, f)) for key in keys[5:7])
    return x, weights, experts, gate, up, down, gate_bias, up_bias


@pytest.mark.parametrize("path", ["blocked", "ragged", "capacity"])
def test_clamped_experts_with_biases_match_the_dense_path(path):
    """Values and gradients (tokens, router weights, every kernel and bias) of the dropless paths
    (the CPU's blocked loop with its hand-written backward, ragged_dot) and capacity (with room
    for every token) against the dense reference, differentiated by JAX."""
    x, weights, experts, gate, up, down, gate_bias, up_bias = _experts()
    hidden = jnp.einsum("bsd,edf->bsef", x, gate)
    assert float(jnp.mean(hidden > 7)) > 0.05 and float(jnp.mean(jnp.abs(jnp.einsum("bsd,edf->bsef", x, up)) > 7)) > 0.05
    probe = jax.random.normal(jax.random.key(7), x.shape)
    ffn = dict(activation="clamped_silu")

    def run(f):
        def objective(x, weights, gate, up, down, gate_bias, up_bias):
            out = f(x, weights, experts, gate, up, down, **ffn, gate_bias=gate_bias, up_bias=up_bias)
            return jnp.sum(out * probe)
        return jax.value_and_grad(objective, argnums=tuple(range(7)))(x, weights, gate, up, down, gate_bias, up_bias)

    paths = {"blocked": lambda *a, **kw: moe.dropless_experts(*a, block=8, **kw),
             "ragged": lambda *a, **kw: moe.dropless_experts(*a, block=0, **kw),
             "capacity": lambda *a, **kw: moe.capacity_experts(*a, capacity=24, **kw)}
    value, grads = run(paths[path])
    ref_value, ref_grads = run(moe.dense_experts)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for name, a, b in zip(("x", "weights", "gate", "up", "down", "gate_bias", "up_bias"), grads, ref_grads):
        assert np.abs(np.asarray(b)).max() > 0, name
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)


def test_clamped_silu_is_transformers_gate():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from maxtext_rocm.models.activations import gated

    config = transformers.GptOssConfig(hidden_size=8, intermediate_size=6, num_local_experts=2)
    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)
    gate_up = np.random.default_rng(0).normal(0, 6, (5, 12)).astype(np.float32)
    theirs = experts._apply_gate(torch.tensor(gate_up)).numpy()
    np.testing.assert_allclose(gated("clamped_silu", gate_up[:, 0::2], gate_up[:, 1::2]), theirs, rtol=1e-6)


def test_top_k_then_softmax_routes_as_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.GptOssConfig(hidden_size=8, num_local_experts=6, num_experts_per_tok=3)
    router = transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter(config)
    with torch.no_grad():
        router.weight.normal_()
        router.bias.normal_()
    x = np.random.default_rng(1).normal(size=(10, 8)).astype(np.float32)
    with torch.no_grad():
        logits, scores, indices = router(torch.tensor(x))
    _, weights, experts = moe.route(jnp.asarray(logits.numpy()), 3, kind="topk_softmax")
    np.testing.assert_array_equal(experts, indices.numpy())
    np.testing.assert_allclose(weights, scores.numpy(), rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# YaRN


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("head_dim, theta, factor, original", [(64, 150000.0, 32.0, 4096), (16, 10000.0, 16.0, 16)])
def test_yarn_frequencies_and_attention_factor_are_transformers(truncate, head_dim, theta, factor, original):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    config = transformers.GptOssConfig(head_dim=head_dim, max_position_embeddings=int(original * factor),
                                       rope_parameters={"rope_type": "yarn", "rope_theta": theta, "factor": factor,
                                                        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
                                                        "original_max_position_embeddings": original})
    inv_freq, attention_factor = _compute_yarn_parameters(config)
    yarn = dict(YARN, factor=factor, original_max_position=original, truncate=truncate)
    np.testing.assert_allclose(yarn_inv_frequencies(head_dim, theta, yarn), inv_freq.numpy(), rtol=1e-6)
    assert rope_attention_factor(yarn) == pytest.approx(attention_factor, rel=1e-12)
    assert rope_attention_factor(dict(yarn, attention_factor=1.25)) == 1.25


# ----------------------------------------------------------------------------------------------
# MXFP4


def _mxfp4(shape, seed=0):
    """Random MXFP4 blocks [..., G, 16] and scales [..., G] around 2^0 (every nibble occurs)."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (*shape, 16), dtype=np.uint8),
            rng.integers(120, 135, shape, dtype=np.uint8))


def test_mxfp4_dequantization_is_transformers():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from maxtext_rocm.convert.mxfp4 import dequantize

    blocks, scales = _mxfp4((3, 10, 2))  # 3 experts, 10 output rows, 2 groups of 32 inputs
    theirs = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32).numpy()
    ours = dequantize(blocks, scales)
    assert ours.shape == theirs.shape == (3, 64, 10)
    np.testing.assert_array_equal(ours, theirs)
    assert len(np.unique(ours)) > 50  # not a degenerate draw (15 codes x 15 scales, with overlaps)


def test_from_hf_dequantizes_mxfp4_experts_and_both_commands_say_so(tmp_path, capsys):
    """A tiny gpt-oss whose experts are stored as MXFP4 (blocks and scales in place of gate_up_proj
    and down_proj, quantization_config in config.json): from-hf places transformers' dequantized
    tensors (gate and up from the even and odd columns), says so in one line, and to-hf says what
    it writes instead."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from maxtext_rocm.convert import from_hf
    from maxtext_rocm.convert.__main__ import main as convert_main

    config = transformers.GptOssConfig(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(config).save_pretrained(tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    expected = {}
    for i in range(2):
        prefix = f"model.layers.{i}.mlp.experts."
        for name, rows, groups in (("gate_up_proj", 64, 2), ("down_proj", 64, 1)):  # rows: outputs; 32 inputs a group
            del tensors[prefix + name]
            blocks, scales = _mxfp4((4, rows, groups), seed=10 * i + len(name))
            tensors[f"{prefix}{name}_blocks"], tensors[f"{prefix}{name}_scales"] = blocks, scales
            expected[i, name] = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales),
                                                           dtype=torch.float32).numpy()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config))

    cfg, params = from_hf(tmp_path / "hf", {"model.scan_layers": False})
    for i in range(2):
        experts = params[f"layers_{i}"]["moe"]
        np.testing.assert_array_equal(experts["gate"], expected[i, "gate_up_proj"][..., 0::2])
        np.testing.assert_array_equal(experts["up"], expected[i, "gate_up_proj"][..., 1::2])
        np.testing.assert_array_equal(experts["down"], expected[i, "down_proj"])

    capsys.readouterr()
    assert convert_main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "export")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"note: {tmp_path / 'hf'}'s mxfp4 weights were dequantized to float32, the precision training keeps; "
        "to-hf writes them unquantized")
    assert convert_main(["to-hf", str(tmp_path / "export"), str(tmp_path / "hf_out"), "--dtype", "bfloat16"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "note: the original's weights were mxfp4; this export writes them unquantized, as bfloat16 "
        "(training kept them in float32)")
    written = json.loads((tmp_path / "hf_out" / "config.json").read_text())
    assert "quantization_config" not in written
    assert load_file(str(tmp_path / "hf_out" / "model.safetensors"))[
        "model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)


def test_from_hf_refuses_an_mxfp4_tensor_without_its_scales(tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import load_file, save_file

    from maxtext_rocm.convert import ConvertError, from_hf

    config = transformers.GptOssConfig(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       num_local_experts=4, num_experts_per_tok=2)
    transformers.GptOssForCausalLM(config).save_pretrained(tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.down_proj"]
    tensors["model.layers.0.mlp.experts.down_proj_blocks"] = _mxfp4((4, 64, 1))[0]
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConvertError, match="tensor model.layers.0.mlp.experts.down_proj_scales is missing from"):
        from_hf(tmp_path / "hf")


# ----------------------------------------------------------------------------------------------
# The config checks


def _gpt_oss_like(**overrides):
    from conftest import small_config

    return small_config(**{"model.attention_sinks": True, "model.rope_yarn": dict(YARN), **overrides})


@pytest.mark.parametrize("attention", ["cudnn", "pallas"])
def test_sinks_refuse_kernels_without_them(attention):
    with pytest.raises(config_lib.ConfigError, match=f"model.attention='{attention}' has no attention sinks, which "
                                                     "model.attention_sinks=True asks for; use model.attention xla, "
                                                     "blockwise, auto"):
        config_lib.validate(_gpt_oss_like(**{"model.attention": attention}))


def test_sinks_refuse_context_parallelism():
    cfg = _gpt_oss_like(**{"mesh.ici.sequence": 2, "mesh.ici.fsdp": 4})
    with pytest.raises(config_lib.ConfigError, match="model.attention_sinks=True does not yet run with mesh sequence > 1"):
        config_lib.validate(cfg)


@pytest.mark.parametrize("change, sentence", [
    ({"truncate": None}, "model.rope_yarn.truncate=None is not valid; it takes true or false"),
    ({"beta_fast": "32"}, "model.rope_yarn.beta_fast='32' is not valid; it takes a number > 0"),
    ({"factor": 0.5}, "model.rope_yarn.factor must be >= 1, got 0.5"),
    ({"mscale": 1.0}, "model.rope_yarn needs exactly the keys factor, beta_fast, beta_slow, original_max_position, "
                      "truncate, attention_factor; unknown mscale"),
])
def test_rope_yarn_is_checked_in_one_sentence(change, sentence):
    cfg = _gpt_oss_like(**{"model.rope_yarn": {**YARN, **change}})
    with pytest.raises(config_lib.ConfigError, match=sentence.replace("(", r"\(").replace(")", r"\)")):
        config_lib.validate(cfg)


def test_export_refuses_gpt_oss_options_under_another_family(tmp_path):
    pytest.importorskip("safetensors")
    from maxtext_rocm.convert import ConvertError, to_hf

    cfg = _gpt_oss_like()
    with pytest.raises(ConvertError, match=r"model.attention_sinks=True cannot be written as a LlamaForCausalLM"):
        to_hf(cfg, {}, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------
# The new weights under a mesh: sinks and the attention output's bias with the heads and d_model,
# the router's and experts' biases with their experts


GPT_OSS_LIKE = {"model.family": "gpt_oss", "model.n_layers": 3, "model.attention_kinds": ("sliding", "full"),
                "model.sliding_window": 8, "model.n_experts": 4, "model.experts_per_token": 2, "model.qkv_bias": True,
                "model.out_bias": True, "model.attention_sinks": True, "model.moe_bias": True,
                "model.moe_router": "topk_softmax", "model.mlp_activation": "clamped_silu",
                "model.rope_yarn": dict(YARN, factor=8.0, original_max_position=16)}


# CI budget: blockwise by default (the sharded run of tests/test_families.py covers xla on fsdp x expert)
@pytest.mark.parametrize("attention", [pytest.param("xla", marks=pytest.mark.slow), "blockwise"])
def test_gpt_oss_options_under_fsdp_tensor_and_expert_match_one_device(attention, devices, tmp_path):
    """Loss and every gradient (sinks, biases and the router's included) on fsdp 2 x tensor 2 x
    expert 2 equal one device's."""
    from conftest import small_config
    from helpers import assert_close, loss_and_grads

    single = {f"mesh.ici.{axis}": 1 for axis in config_lib.MESH_AXES}
    options = {**GPT_OSS_LIKE, "model.attention": attention}
    one = small_config(**options, **single, **{"train.per_device_batch_size": 8, "output_dir": str(tmp_path / "one")})
    ref_loss, ref_grads, _ = loss_and_grads(one, devices[:1])
    new = [ref_grads["layers"]["attention"][name] for name in ("sinks", "o_bias")]
    new += [ref_grads["layers"]["moe"][name] for name in ("router_bias", "gate_bias", "up_bias", "down_bias")]
    assert all(np.abs(np.asarray(g)).max() > 0 for g in new)  # the comparison covers gradients that are not zero
    mesh = {**single, "mesh.ici.fsdp": 2, "mesh.ici.tensor": 2, "mesh.ici.expert": 2}
    loss, grads, _ = loss_and_grads(small_config(**options, **mesh, **{"output_dir": str(tmp_path / "mesh")}), devices)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
