"""LoRA (maxtext_rocm/finetune/lora.py): adapters against a naive merged-weight reference, the
frozen base, sharding, resume and the config's refusals. The Hugging Face side (merged and PEFT
exports) is in tests/test_lora_export.py."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm.api import load_params
from maxtext_rocm.config import ConfigError
from maxtext_rocm.train import Trainer
from maxtext_rocm.trainer import launch
from maxtext_rocm.resolve import Target, resolve
from maxtext_rocm.trainer.step import gradients, summed_loss

from conftest import small_config
from helpers import assert_close, initial_run

ONE_DEVICE = {f"mesh.ici.{a}": 1 for a in ("data", "fsdp", "expert", "sequence", "tensor")}
RANK, ALPHA = 4, 8.0


def lora_config(tmp_path, **overrides):
    return small_config(**{**ONE_DEVICE, "lora.rank": RANK, "lora.alpha": ALPHA, "output_dir": str(tmp_path),
                           "train.per_device_batch_size": 2, **overrides})


def base_model(cfg, run):
    """The same model without LoRA (lora.rank=0), on the run's mesh."""
    plain = copy.deepcopy(cfg)
    plain.lora.rank = 0
    device = run.mesh.devices.flat[0]
    plain = resolve(plain, run.mesh, Target.of_device(device))
    return launch.model_for_mesh(plain, launch.run_policy(plain, device), run.mesh)


def with_random_b(adapters, seed=0):
    """The adapters with B drawn at random (B = 0 at the start gives A no gradient), each leaf in
    its own sharding; the same numbers whatever the mesh."""
    rng = np.random.default_rng(seed)

    def draw(path, x):
        if jax.tree_util.keystr(path).endswith("['b']"):
            return jax.device_put(rng.normal(0, 0.2, x.shape).astype(np.float32), x.sharding)
        return x
    return jax.tree_util.tree_map_with_path(draw, adapters)


def strip_key(tree, key):
    """`tree` with every dict level named `key` spliced into its parent."""
    if not isinstance(tree, dict):
        return tree
    if key in tree:
        return strip_key({**{k: v for k, v in tree.items() if k != key}, **tree[key]}, key)
    return {k: strip_key(v, key) for k, v in tree.items()}


def naive_merge(frozen, adapters, scale):
    """W + scale * A B written out for each adapted kernel: A [layers, *in, r], B [layers, r, *out]."""
    merged = jax.tree_util.tree_map(lambda x: x, frozen)
    for path, a in jax.tree_util.tree_flatten_with_path(adapters)[0]:
        names = [k.key for k in path]
        if names[-1] != "a":
            continue
        layer = names[:-2]  # .../NAME/dot/a -> .../NAME
        b = adapters
        parent = merged
        for name in names[:-1]:
            b = b[name]
        for name in layer:
            parent = parent[name]
        b = b["b"]
        w = parent["kernel"]
        n_layers, r = a.shape[0], a.shape[-1]
        product = jnp.einsum("lir,lro->lio", a.reshape(n_layers, -1, r), b.reshape(n_layers, r, -1))
        parent["kernel"] = w + scale * product.reshape(w.shape)
    return merged


# CI budget: bf16 (between the two) runs with -m slow.
@pytest.mark.parametrize("policy", ["fp32", pytest.param("bf16", marks=pytest.mark.slow),
                                    pytest.param("fp8", marks=pytest.mark.slow)])
def test_step_zero_loss_equals_the_base_models(policy, tmp_path, devices):
    """B = 0: the first loss is the base model's on the same parameters, to the bit; applied
    without its adapters the LoRA model is the base (DPO's reference policy). Under remat."""
    cfg = lora_config(tmp_path, **{"precision.policy": policy, "model.remat": "minimal"})
    run = initial_run(cfg, devices[:1])
    batch = run.batch(0)
    base = base_model(cfg, run)
    assert all(x.dtype == (jnp.float32 if policy == "fp32" else jnp.bfloat16)
               for x in jax.tree_util.tree_leaves(run.state.frozen)), "the base is held in the compute dtype"
    fp8 = run.state.fp8 or None  # fp8: fresh scaling state, which the LoRA dot keeps one level down
    base_fp8 = strip_key(fp8, "base") if fp8 else None
    with run.sharding_rules():
        lora_loss = jax.jit(lambda p, f, b: summed_loss(p, run.model, b, 0.0, fp8, f)[0])(
            run.state.params, run.state.frozen, batch)
        without_adapters = jax.jit(lambda f, b: summed_loss(f, run.model, b, 0.0, fp8)[0])(run.state.frozen, batch)
        base_loss = jax.jit(lambda f, b: summed_loss(f, base, b, 0.0, base_fp8)[0])(run.state.frozen, batch)
    assert float(lora_loss) == float(base_loss) == float(without_adapters)


@pytest.mark.slow  # two MoE programs
@pytest.mark.parametrize("moe_impl", ["dense", "dropless"])
def test_mixtral_attention_takes_adapters(moe_impl, tmp_path, devices):
    """Mixtral's attention takes adapters (its experts refuse them): step 0 is the base's loss."""
    cfg = lora_config(tmp_path, **{"model.family": "mixtral", "model.n_experts": 4, "model.experts_per_token": 2,
                                   "model.moe_impl": moe_impl, "lora.targets": ("q", "v")})
    run = initial_run(cfg, devices[:1])
    base = base_model(cfg, run)
    with run.sharding_rules():
        out = jax.jit(lambda p, f, b: gradients(p, run.model, b, 1, 0.0, None, frozen=f))(
            run.state.params, run.state.frozen, run.batch(0))
        sums = jax.jit(lambda f, b: summed_loss(f, base, b, 0.0)[1])(run.state.frozen, run.batch(0))
    assert float(out.metrics["loss"]) == pytest.approx(float(sums["ce"] / sums["tokens"]), rel=1e-6)
    assert set(out.grads["layers"]["attention"]) == {"q", "v"}


def test_adapter_gradients_equal_the_merged_weight_reference(tmp_path, devices):
    """d loss / d(A, B) through the low-rank path inside the dot equals jax.grad through the
    explicitly merged kernels W + (alpha / r) A B of the plain model."""
    cfg = lora_config(tmp_path)
    run = initial_run(cfg, devices[:1])
    adapters, batch = with_random_b(run.state.params), run.batch(0)
    base = base_model(cfg, run)
    with run.sharding_rules():
        got = jax.jit(jax.value_and_grad(lambda p, f, b: summed_loss(p, run.model, b, 0.0, None, f)[0]))(
            adapters, run.state.frozen, batch)
        want = jax.jit(jax.value_and_grad(lambda p, f, b: summed_loss(naive_merge(f, p, ALPHA / RANK), base, b, 0.0)[0]))(
            adapters, run.state.frozen, batch)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree_util.tree_leaves(got[1]))


@pytest.mark.slow  # ~20 s idle; the default run checks the adapters' numerics without dropout
def test_dropout_acts_only_when_the_step_passes_a_key(tmp_path, devices):
    """lora.dropout drops inputs of the low-rank path in the train step (a key from train.seed and
    the step) and nowhere else: without a key the loss is the dropout-free one."""
    from maxtext_rocm.trainer.step import lora_dropout_key

    cfg = lora_config(tmp_path, **{"lora.dropout": 0.5})
    run = initial_run(cfg, devices[:1])
    adapters, batch = with_random_b(run.state.params), run.batch(0)
    key = lora_dropout_key(run.model, cfg.train.seed, run.state.step)
    assert key is not None
    loss = jax.jit(lambda p, f, b, k: summed_loss(p, run.model, b, 0.0, None, f, k)[0])
    with run.sharding_rules():
        plain = float(loss(adapters, run.state.frozen, batch, None))
        dropped = [float(loss(adapters, run.state.frozen, batch, jax.random.fold_in(key, i))) for i in range(2)]
    assert plain not in dropped and dropped[0] != dropped[1]


# CI budget: fsdp alone runs with -m slow; fsdp4-tensor2 shards over both axes.
@pytest.mark.parametrize("mesh", [pytest.param({"mesh.ici.fsdp": 8}, marks=pytest.mark.slow),
                                  {"mesh.ici.fsdp": 4, "mesh.ici.tensor": 2}], ids=["fsdp8", "fsdp4-tensor2"])
def test_sharded_adapters_equal_the_unsharded_run(mesh, tmp_path, devices):
    """A shards like W's input, B like W's output; loss and adapter gradients match one device."""
    results = {}
    for name, layout, devs in (("one", ONE_DEVICE, devices[:1]), ("mesh", mesh, devices)):
        cfg = lora_config(tmp_path / name, **{**ONE_DEVICE, **layout, "train.per_device_batch_size": 8 // len(devs)})
        run = initial_run(cfg, devs)
        adapters = with_random_b(run.state.params)
        with run.sharding_rules():
            out = jax.jit(lambda p, f, b: gradients(p, run.model, b, 1, 0.0, None, frozen=f))(
                adapters, run.state.frozen, run.batch(0))
        results[name] = (float(out.metrics["loss"]), jax.tree_util.tree_map(np.asarray, out.grads), run)
    run = results["mesh"][2]
    q = run.state.params["layers"]["attention"]["q"]["dot"]
    spec_a, spec_b = q["a"].sharding.spec, q["b"].sharding.spec
    kernel_spec = run.state.frozen["layers"]["attention"]["q"]["kernel"].sharding.spec
    assert spec_a[1] == kernel_spec[1] and spec_b[2:] == kernel_spec[2:], (spec_a, spec_b, kernel_spec)
    assert spec_a[-1] is None and spec_b[1] is None  # the rank axis is replicated
    assert_close(results["mesh"][0], results["one"][0])
    assert_close(results["mesh"][1], results["one"][1])


@pytest.mark.slow  # three trainers: ~4 minutes under this CPU's shared load
def test_training_moves_only_the_adapters_and_resumes_bit_exact(tmp_path, devices):
    """Adam moments exist for the adapters alone, the base stays as it was, checkpoints hold no
    base, and a resumed run (base reloaded, adapters restored) ends where an uninterrupted one does."""
    overrides = {"train.steps": 4, "checkpoint.every": 2, "checkpoint.async_save": False, "log.every": 1,
                 "optimizer.lr": 1e-2, "optimizer.warmup_steps": 0}
    whole = Trainer(lora_config(tmp_path / "whole", **overrides), devices=devices[:1], log=lambda *_: None)
    frozen_before = jax.tree_util.tree_map(np.asarray, whole.state.frozen)
    adapters_before = jax.tree_util.tree_map(np.asarray, whole.state.params)
    whole.run()
    adam = whole.state.opt_state[1][0]
    assert isinstance(adam, optax.ScaleByAdamState)
    assert jax.tree_util.tree_structure(adam.mu) == jax.tree_util.tree_structure(whole.state.params)
    assert jax.tree_util.tree_structure(whole.state.params) != jax.tree_util.tree_structure(whole.state.frozen)
    for a, b in zip(jax.tree_util.tree_leaves(whole.state.frozen), jax.tree_util.tree_leaves(frozen_before)):
        assert np.array_equal(np.asarray(a), b)
    moved = [not np.array_equal(np.asarray(a), b) for a, b in
             zip(jax.tree_util.tree_leaves(whole.state.params), jax.tree_util.tree_leaves(adapters_before))]
    assert all(moved)
    whole.close()
    import orbax.checkpoint as ocp

    saved = ocp.PyTreeCheckpointer().metadata(tmp_path / "whole" / "checkpoints" / "4" / "state").item_metadata.tree
    assert not saved.get("frozen") and "layers" in saved["params"]
    # generate's reader: the merged model, on the base made again from train.seed (on the host: the
    # same numbers but for the last bit, lora_base.py)
    merged = naive_merge(jax.tree_util.tree_map(np.asarray, whole.state.frozen),
                         jax.tree_util.tree_map(np.asarray, whole.state.params), ALPHA / RANK)
    for got, want in zip(jax.tree_util.tree_leaves(load_params(tmp_path / "whole")), jax.tree_util.tree_leaves(merged)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)

    first = Trainer(lora_config(tmp_path / "split", **overrides), devices=devices[:1], log=lambda *_: None)
    first.run(2)
    first.close()
    resumed = Trainer(lora_config(tmp_path / "split", **overrides), devices=devices[:1], log=lambda *_: None)
    assert resumed.step_count == 2
    resumed.run()
    for a, b in zip(jax.tree_util.tree_leaves((resumed.state.params, resumed.state.frozen)),
                    jax.tree_util.tree_leaves((whole.state.params, whole.state.frozen))):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    resumed.close()


@pytest.mark.parametrize("overrides, needle", [
    ({"lora.targets": ("q", "gate_proj")}, "lora.targets=.* use distinct names from q, k, v, o, gate, up, down"),
    ({"lora.rank": 40}, r"lora.rank=40 is larger than the k matrix allows \(64 x 32\); use lora.rank <= 32"),
    ({"lora.rank": -1}, "lora.rank=-1 is not valid"),
    ({"lora.alpha": 0.0}, "lora.alpha"),
    ({"lora.dropout": 1.0}, "lora.dropout"),
    ({"model.family": "mixtral", "model.n_experts": 4, "model.experts_per_token": 2},
     "lora.targets names down, gate, up, which in a mixtral model are the experts' weights"),
    ({"mesh.ici.stage": 2, "mesh.ici.fsdp": 1}, "lora.rank=4 does not run under a pipeline"),
])
def test_bad_lora_settings_are_refused_in_one_sentence(overrides, needle, tmp_path):
    cfg = lora_config(tmp_path, **overrides)
    with pytest.raises(ConfigError, match=needle):
        config_lib.validate(cfg)
