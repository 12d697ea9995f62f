"""Context parallelism (maxtext_rocm/parallel/context.py): attention over sequences split across
mesh `sequence`, ring and all-gather, with causal load balance, on 8 fake CPU devices, against
the 1-device run (the plain "xla" attention), values and gradients."""

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from maxtext_rocm.planner import comm, comm_minimum
from maxtext_rocm import config as config_lib
from maxtext_rocm.trainer import launch
from maxtext_rocm.parallel import sharding
from maxtext_rocm.models.attention import dot_product_attention
from maxtext_rocm.models.blockwise_attention import block_size
from maxtext_rocm.parallel import context, context_blocks
from maxtext_rocm.trainer.step import gradients
from maxtext_rocm.trainer.preflight import check_run

from conftest import small_config
from helpers import assert_close, initial_run, loss_and_grads

SINGLE = {f"mesh.ici.{a}": 1 for a in ("data", "fsdp", "expert", "sequence", "tensor")}
SLOW = pytest.mark.slow
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def packed_segments(rows: int, seq_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(segment ids, per-document positions) of rows packed with documents of random lengths,
    the last one padding (segment 0), as data/packing.py packs them."""
    rng = np.random.default_rng(seed)
    segments = np.zeros((rows, seq_len), np.int32)
    positions = np.zeros((rows, seq_len), np.int32)
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, seq_len - 8), 4, replace=False))
        bounds = [0, *cuts, seq_len - 8, seq_len]
        for doc, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            last = doc == len(bounds) - 2
            segments[r, a:b] = 0 if last else doc + 1
            positions[r, a:b] = 0 if last else np.arange(b - a)
    return segments, positions


# ----------------------------------------------------------------------------------------------
# The layout and its balance


@pytest.mark.parametrize("n_shards", [2, 4, 8])
def test_layout_is_a_permutation_of_chunks_from_both_ends(n_shards):
    lay = context.Layout(n_shards, balanced=True)
    perm = lay.permutation(64 * n_shards)
    assert sorted(perm) == list(range(64 * n_shards))
    chunk = 64 * n_shards // (2 * n_shards)
    per_shard = perm.reshape(n_shards, -1)
    for i, tokens in enumerate(per_shard):  # shard i: chunk i then chunk 2S-1-i, each in order
        np.testing.assert_array_equal(tokens, np.r_[i * chunk:(i + 1) * chunk,
                                                    (2 * n_shards - 1 - i) * chunk:(2 * n_shards - i) * chunk])
    batch = {"inputs": np.arange(2 * 64 * n_shards).reshape(2, -1), "weights": np.ones((2, 64 * n_shards))}
    laid = lay.apply(batch)
    np.testing.assert_array_equal(laid["inputs"][1], batch["inputs"][1][perm])
    np.testing.assert_array_equal(laid["positions"][0], perm)  # the true positions travel with the tokens
    assert context.Layout(n_shards, balanced=False).apply(batch) is batch


@pytest.mark.parametrize("seq_len", [4096, 131072])
@pytest.mark.parametrize("n_shards", [2, 4, 8])
def test_causal_attention_work_is_balanced_within_5_percent(n_shards, seq_len):
    """Unmasked (query, key) pairs of the causal mask per shard, counted from the layout's
    permutation: equal within 5% balanced; contiguous slices give the last shard ~2S-1 times the
    first's work (so the count can tell the two apart)."""
    pairs = context.attention_pairs(context.Layout(n_shards, balanced=True), seq_len)
    assert sum(pairs) == seq_len * (seq_len + 1) // 2  # every pair of the causal mask, once
    assert max(pairs) / min(pairs) - 1 < 0.05, pairs
    contiguous = context.attention_pairs(context.Layout(n_shards, balanced=False), seq_len)
    assert max(contiguous) / min(contiguous) > 2 * n_shards - 1.5
    # What the kernel computes: whole block pairs (4*block^2*head_dim FLOPs each), the diagonal's
    # partly masked ones included, from its own loop bounds (context_blocks._key_blocks) over every
    # (query chunk, key chunk) a ring or a gather brings together
    lay = context.Layout(n_shards, balanced=True)
    local = seq_len // n_shards
    chunk = local // lay.chunks
    block = block_size(chunk)
    computed = []
    for shard in range(n_shards):
        count = 0
        for q_start in lay.starts(shard, local):
            for k_start in (s for other in range(n_shards) for s in lay.starts(other, local)):
                for i in range(chunk // block):
                    first, last = context_blocks._key_blocks(q_start + i * block, k_start, block, chunk // block, 0)
                    count += int(last) - int(first)
        computed.append(count)
    assert max(computed) / min(computed) - 1 < 0.05, computed


# ----------------------------------------------------------------------------------------------
# The attention function alone, against the 1-device attention


def attention_setup(mesh_sizes, mode, window, segmented, balanced=True, seq_len=256, b=2, dtype=np.float32):
    """(mesh, the sharded loss of laid-out q, k, v, the 1-device loss, (q, k, v), permutation)."""
    cfg = config_lib.defaults()
    for axis in cfg.mesh.ici:
        cfg.mesh.ici[axis] = mesh_sizes.get(axis, 1)
    n = int(np.prod(list(mesh_sizes.values())))
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:n])
    model_cfg = ml_collections.FrozenConfigDict(dict(context_parallel=mode, context_load_balance=balanced,
                                                     sliding_window=window))
    attend = context.context_attention(model_cfg, mesh)
    lay = context.mesh_layout(model_cfg, mesh)
    rng = np.random.default_rng(0)
    heads, kv_heads, head_dim = HEADS, KV_HEADS, HEAD_DIM
    q, k, v, w = (rng.standard_normal((b, seq_len, h, head_dim)).astype(dtype)
                  for h in (heads, kv_heads, kv_heads, heads))
    seg = packed_segments(b, seq_len, 1)[0] if segmented else None

    def reference(q, k, v):
        out = dot_product_attention(q, k, v, segment_ids=None if seg is None else jnp.asarray(seg),
                                    implementation="xla", sliding_window=window)
        return jnp.sum(out * w)

    perm = lay.permutation(seq_len)
    laid_seg = None if seg is None else jnp.asarray(seg[:, perm])

    def sharded(q, k, v):
        return jnp.sum(attend(q, k, v, laid_seg) * w[:, perm])

    return mesh, sharded, reference, (q, k, v), perm


def attention_case(mesh_sizes, mode, window, segmented, balanced=True, seq_len=256, b=2):
    mesh, sharded, reference, (q, k, v), perm = attention_setup(mesh_sizes, mode, window, segmented, balanced,
                                                                 seq_len, b)
    want = jax.value_and_grad(reference, argnums=(0, 1, 2))(q, k, v)
    with jax.set_mesh(mesh):
        value, grads = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1, 2)))(q[:, perm], k[:, perm], v[:, perm])
    unlaid = np.argsort(perm)
    return (value, tuple(np.asarray(g)[:, unlaid] for g in grads)), want


@pytest.mark.parametrize("mesh_sizes, mode, window, segmented", [
    ({"sequence": 4}, "ring", 48, True),
    ({"sequence": 2, "fsdp": 2, "tensor": 2}, "all_gather", 40, True),
    pytest.param({"sequence": 8}, "ring", 0, True, marks=SLOW),
    pytest.param({"sequence": 8}, "all_gather", 24, False, marks=SLOW),
    pytest.param({"sequence": 2, "fsdp": 2, "tensor": 2}, "ring", 40, True, marks=SLOW),
])
def test_attention_matches_one_device(mesh_sizes, mode, window, segmented):
    got, want = attention_case(mesh_sizes, mode, window, segmented)
    assert_close(got, want)


@SLOW
def test_batch_split_over_expert_too_matches_one_device():
    got, want = attention_case({"sequence": 2, "expert": 2, "fsdp": 2}, "ring", 40, True, b=4)
    assert_close(got, want)


def test_a_batch_the_mesh_cannot_split_is_still_exact():
    """2 rows over 4 batch shards: the fallback (GSPMD's attention under the true indices' mask)."""
    got, want = attention_case({"sequence": 2, "expert": 2, "fsdp": 2}, "ring", 40, True, b=2)
    assert_close(got, want)


def test_unbalanced_ring_matches_one_device():
    got, want = attention_case({"sequence": 4}, "ring", 40, True, balanced=False)
    assert_close(got, want)


@pytest.mark.parametrize("mode, blocks_per_hop", [("ring", 3), pytest.param("all_gather", 2, marks=SLOW)])
def test_kv_bytes_are_the_minimum(mode, blocks_per_hop):
    """One attention's forward and backward (no remat), counted in the compiled program by comm.py:
    all_gather sends (S-1) local K/V blocks gathering and (S-1) reduce-scattering dK/dV; ring
    sends K/V S-1 hops forward, then K/V and the dK/dV sums S-1 hops each backward. A ring that
    sent its sums a hop too many (home after S, as it once did) sends 1/(3(S-1)) more and fails."""
    S, seq_len, b = 4, 256, 2
    mesh, sharded, _, (q, k, v), perm = attention_setup({"sequence": S}, mode, 0, False, seq_len=seq_len, b=b)
    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(sharded, argnums=(0, 1, 2))).lower(q[:, perm], k[:, perm], v[:, perm]).compile()
    measured = comm.account(compiled.as_text(), comm.MeshLayout.of(mesh, compiled=compiled))
    assert not measured["unknown_trip_count_loops"]
    sent = sum(row["bytes"] for row in measured["rows"] if row["axes"] == "sequence")
    T = b * seq_len // S  # tokens per device
    block = 2 * T * KV_HEADS * HEAD_DIM * 4  # one device's K and V, fp32
    assert sent == blocks_per_hop * (S - 1) * block
    m = ml_collections.ConfigDict(dict(n_layers=1, d_model=64, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                       mlp_dim=128, vocab_size=128, n_experts=1, experts_per_token=1,
                                       tie_embeddings=True, remat="none", context_parallel=mode))
    train = ml_collections.ConfigDict(dict(per_device_batch_size=b / S, seq_len=seq_len, grad_accum=1))
    terms = {t["term"]: t for t in comm_minimum.minimum(m, train, "fp32", {"sequence": S})["terms"]}
    assert terms["sequence K/V"]["cpu_bytes"] == sent


def test_ring_sends_dkv_in_the_kv_dtype():
    """Under bf16 the ring's dK/dV partial sums cross in bf16, as the all-gather's reduce-scatter
    does (fp32 sums would double the backward's bytes on a GPU). Read from the lowered program:
    XLA:CPU's float normalization shows every collective as f32 once compiled."""
    mesh, sharded, _, (q, k, v), perm = attention_setup({"sequence": 4}, "ring", 0, False, dtype=jnp.bfloat16)
    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(sharded, argnums=(0, 1, 2))).lower(q[:, perm], k[:, perm], v[:, perm]).as_text()
    operands = re.findall(r"collective_permute.*?: \(tensor<([^>]*)>", text)
    # In the program text: K, V in the forward's loop; in the backward K, V before and in its
    # loop, dK, dV in it and after it (home)
    assert len(operands) == 10 and all(o.endswith("bf16") for o in operands), operands


def test_sequence_one_keeps_the_models_own_attention():
    mesh = sharding.make_mesh(ml_collections.ConfigDict(
        {"ici": {a: 1 for a in config_lib.MESH_AXES}, "dcn": {a: 1 for a in config_lib.MESH_AXES}}), jax.devices()[:1])
    assert context.context_attention(ml_collections.ConfigDict(
        dict(context_parallel="ring", context_load_balance=True, sliding_window=0)), mesh) is None


# ----------------------------------------------------------------------------------------------
# The whole model at the lengths (2,048 and 4,096 tokens): loss and gradients of a packed,
# windowed batch against one device. A 64-wide, 2-layer model keeps each case to seconds of
# compute; the compiles dominate (10-20 s a case on 2 busy cores), so CI runs one and the rest of
# the matrix is slow.

ROWS, WINDOW = 2, 300  # the window spans 2-5 chunks of a shard's keys and binds inside documents


def model_config(tmp, seq_len, **overrides):
    return small_config(**{**SINGLE, "train.seq_len": seq_len, "model.sliding_window": WINDOW,
                           "output_dir": str(tmp), **overrides})


def packed_batch(vocab: int, seq_len: int) -> dict:
    rng = np.random.default_rng(3)
    segments, positions = packed_segments(ROWS, seq_len, 2)
    return {"inputs": rng.integers(0, vocab, (ROWS, seq_len)).astype(np.int32),
            "targets": rng.integers(0, vocab, (ROWS, seq_len)).astype(np.int32),
            "weights": (segments > 0).astype(np.float32), "positions": positions, "segment_ids": segments}


def packed_loss_and_grads(cfg, devices):
    """Loss and gradients of the packed batch at initialisation, the batch laid out and placed by
    the Trainer's path (launch.place_batch); helpers.initial_run skips the train step's compile."""
    run = initial_run(cfg, devices)
    host = packed_batch(cfg.model.vocab_size, cfg.train.seq_len)
    batch = launch.place_batch(host, run.layout, sharding.batch_sharding(run.mesh),
                               {k: v.dtype for k, v in host.items()}, ROWS)
    fn = jax.jit(lambda p, b: gradients(p, run.model, b, 1, 0.0))
    with run.sharding_rules():
        grads, _, metrics = fn(run.state.params, batch)
    return float(metrics["loss"]), jax.tree_util.tree_map(np.asarray, grads), run


@pytest.fixture(scope="module")
def packed_reference(tmp_path_factory):
    """seq_len -> the 1-device (loss, gradients), each computed once per module."""
    cache = {}

    def one_device(seq_len):
        if seq_len not in cache:
            cfg = model_config(tmp_path_factory.mktemp("one"), seq_len, **{"train.per_device_batch_size": ROWS})
            cache[seq_len] = packed_loss_and_grads(cfg, jax.devices()[:1])[:2]
        return cache[seq_len]

    return one_device


@pytest.mark.parametrize("mesh, mode, seq_len", [
    ({"sequence": 8}, "ring", 2048),
    pytest.param({"sequence": 2, "fsdp": 2, "tensor": 2}, "all_gather", 2048, marks=SLOW),
    pytest.param({"sequence": 2}, "ring", 2048, marks=SLOW),
    pytest.param({"sequence": 2}, "all_gather", 2048, marks=SLOW),
    pytest.param({"sequence": 4}, "ring", 2048, marks=SLOW),
    pytest.param({"sequence": 4}, "all_gather", 2048, marks=SLOW),
    pytest.param({"sequence": 8}, "all_gather", 2048, marks=SLOW),
    pytest.param({"sequence": 2, "fsdp": 2, "tensor": 2}, "ring", 2048, marks=SLOW),
    pytest.param({"sequence": 4, "fsdp": 2}, "ring", 2048, marks=SLOW),
    pytest.param({"sequence": 8}, "ring", 4096, marks=SLOW),
    pytest.param({"sequence": 8}, "all_gather", 4096, marks=SLOW),
    pytest.param({"sequence": 2, "fsdp": 2, "tensor": 2}, "ring", 4096, marks=SLOW),
])
def test_packed_windowed_model_matches_one_device(mesh, mode, seq_len, packed_reference, devices, tmp_path):
    # ROWS sequences whatever the mesh: a fractional per-device batch where devices outnumber them.
    n = int(np.prod(list(mesh.values())))
    cfg = model_config(tmp_path, seq_len, **{f"mesh.ici.{a}": k for a, k in mesh.items()},
                       **{"model.context_parallel": mode, "train.per_device_batch_size": ROWS / n})
    loss, grads, run = packed_loss_and_grads(cfg, devices[:n])
    assert run.model.context_attention is not None and run.layout.chunks == 2
    ref_loss, ref_grads = packed_reference(seq_len)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


@SLOW  # ~50 s on 2 busy cores: two trainers; the packed test above covers a Trainer's layout by default
def test_one_sequence_on_eight_devices_through_the_runs_own_batches(devices, tmp_path):
    """train.per_device_batch_size=0.125: one synthetic sequence split 8 ways, laid out as the
    Trainer lays it out (positions added to a source that has none), against one device."""
    one = small_config(**SINGLE, **{"train.seq_len": 64, "output_dir": str(tmp_path / "one")})
    ref_loss, ref_grads, _ = loss_and_grads(one, devices[:1])
    cfg = small_config(**{**SINGLE, "train.seq_len": 64, "mesh.ici.sequence": 8, "output_dir": str(tmp_path / "cp"),
                          "train.per_device_batch_size": 0.125})
    loss, grads, run = loss_and_grads(cfg, devices)
    assert config_lib.global_batch_size(cfg, 8) == 1 and "positions" in run.batch(0) and run.layout.chunks == 2
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


# ----------------------------------------------------------------------------------------------
# Bad input: one sentence, before anything compiles


@pytest.mark.parametrize("overrides, message", [
    ({"model.context_parallel": "rng"}, "model.context_parallel='rng' is not valid; choose one of"),
    ({"mesh.ici.fsdp": 1, "mesh.ici.sequence": 8, "train.seq_len": 200},
     "train.seq_len=200 does not split into the 2 x sequence = 16 chunks"),
    ({"train.per_device_batch_size": 0.1}, "is 0.8 sequences, not a whole number"),
    ({"mesh.ici.fsdp": 4, "mesh.ici.sequence": 2, "train.per_device_batch_size": 0.25},
     "each micro-batch of 2 sequences does not divide over the 4 batch shards"),
])
def test_bad_context_parallel_inputs(overrides, message):
    cfg = small_config(**{"mesh.ici.fsdp": -1, **overrides})
    with pytest.raises(config_lib.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_run(cfg, 8)


def test_fractional_batch_from_the_command_line():
    cfg = config_lib.load("tiny_llama", ["--config.train.per_device_batch_size=0.125", "--config.mesh.ici.fsdp=1",
                                         "--config.mesh.ici.sequence=8"])
    assert cfg.train.per_device_batch_size == 0.125 and config_lib.global_batch_size(cfg, 8) == 1
    assert config_lib.load("tiny_llama", ["--config.train.per_device_batch_size=2.0"]).train.per_device_batch_size == 2
