"""The compile report under a pipeline, and the FLOPs check: the compiled step's dot FLOPs, counted
by comm.py's HLO walker, against the one FLOPs formula (metrics.executed_flops_per_token)."""

import jax
import jax.numpy as jnp
import pytest
from ml_collections import ConfigDict

from conftest import small_config
from maxtext_rocm.planner import comm, comm_minimum, report as compile_lib
from maxtext_rocm.reporting import metrics
from maxtext_rocm.numerics import precision
from maxtext_rocm.models.llama import REMAT_POLICIES
from maxtext_rocm.planner.estimates import loop_shape


def _tiny(stage: int, **overrides):
    cfg = small_config(**{"mesh.ici.stage": stage, "mesh.ici.fsdp": 8 // stage, "model.n_layers": 4,
                          "model.remat": "full", "train.per_device_batch_size": 2, **overrides})
    cfg.model.attention = "xla"  # the one whose dot FLOPs are all visible (no run-time loop bounds)
    return cfg


def _by_hand_per_token(remat: str) -> dict[str, float]:
    """small_config's Llama with 4 layers, worked out here: d 64, 4 heads (2 kv) of 16, mlp 128,
    vocab 128, seq 32."""
    attention_proj, ffn = 64 * 64 + 2 * 64 * 32 + 64 * 64, 3 * 64 * 128
    scores_fwd = 4 * 32 * 4 * 16  # QK^T and AV, 2 FLOPs per MAC, unmasked, per layer
    # full: every forward dot but the down projection (its output is the block's, already kept) again;
    # minimal: the attention scores only (the projections are kept)
    recompute = {"full": 2 * (attention_proj + 2 * 64 * 128) + scores_fwd, "minimal": scores_fwd, "none": 0}[remat]
    return {"layers": 4 * (6 * (attention_proj + ffn) + 3 * scores_fwd + recompute), "head": 6 * 64 * 128}


# CI budget: the pipeline case (~12 s) runs by default; the unpipelined one (~8 s) only in the slow run
@pytest.mark.parametrize("stage, microbatches", [pytest.param(1, 0, marks=pytest.mark.slow), (2, 4)])
def test_compiled_dot_flops_equal_the_analytic_count(devices, stage, microbatches):
    """Compiled on 8 fake devices (fsdp=8; stage=2 x fsdp=4 with 4 microbatches): the compiled
    step runs the analytic FLOPs and nothing more, remat's recompute and the bubble's
    (M+S-1)/M = 5/4 included, and the LM head on the last stage's S x its share of the tokens."""
    cfg = _tiny(stage, **{"pipeline.microbatches": microbatches})
    r = compile_lib.analyse(cfg, "mi355x", 8, comm=stage > 1)
    hand = _by_hand_per_token("full")
    tokens = 16 * 32 / 8  # per device, before the pipeline's shares
    bubble = 5 / 4 if stage > 1 else 1
    expected = tokens * (hand["layers"] * bubble + hand["head"] * stage)
    assert r.flops.analytic_dot_flops.total == pytest.approx(expected, rel=1e-12)
    assert not r.flops.compiled_flops_lower_bound
    assert r.flops.compiled_dot_flops == pytest.approx(expected, rel=1e-3)  # measured: equal
    # The activation estimate against XLA:CPU's buffer assignment (which upcasts and does not schedule
    # for memory like a GPU): measured 0.67 (fsdp=8) and 0.70 (stage=2) here, where the two gathered
    # fp32 layers of the estimate weigh most; 1.13 to 1.26 at tiny_llama's size (docs/figures.md).
    assert 0.5 <= r.compiled.memory.activations_bytes / r.memory.analytic_activations_bytes <= 1.6
    if stage > 1:  # without the bubble's term the check fails by its 25%
        assert r.flops.compiled_dot_flops / (expected - tokens * hand["layers"] / 4) > 1.2
        # per device, fp32: 2 of the 4 layers' weights split 4 ways by fsdp, their norm scales whole,
        # and a row each of the embedding table and the head (the first stage's the table, the
        # last's the head, split by fsdp: pipeline/layout.py); the final norm on both stages
        layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128
        assert r.stages.layer_param_bytes == 4 * (2 * layer / 4 + 2 * 2 * 64 + 2 * 128 * 64 / 4)
        assert r.stages.other_param_bytes == 4 * 64
        assert r.stages.replicated_over_stage == ["final_norm/scale"]
        # between the stages: each microbatch's block output forward and its cotangent back, 2 x 128
        # tokens per device x d 64 in fp32; the loop moves the bubble's too: its permutes are exactly
        # (M+S-1)/M = 5/4 of that, the schedule's floor
        between = r.comm["stages"]
        batch_shard = 128 * 64 * 4
        assert between["minimum_bytes"] == 2 * batch_shard and between["link"] == "ICI"
        permutes = sum(row["bytes"] for row in r.comm["rows"]
                       if row["kind"] == "collective-permute" and row["axes"] == "stage")
        assert permutes == 5 / 4 * between["minimum_bytes"]
        # the rest, once a step: the final norm's scale's gradient summed over the stages, plus
        # scalars. The tail runs on the last stage, where the table and head are stored
        # (pipeline/layout.py); 40,996 B while the last stage's output went to the other stage and
        # the table's gradient was summed over the stages' lookups; 90,148 B while the embeddings
        # were looked up once and sent to the stages, their cotangent summed back; 147,492 B with
        # the shift as all-to-alls and the last stage's output sent to every stage each
        # iteration, when permutes were 3/2 of the minimum)
        assert between["other_bytes"] <= 64 * 4 + 64


def test_minimal_remat_keeps_the_projections_under_the_pipelines_vmap(capsys):
    """The stages run as a vmap (parallel/pipeline/), which gives every dot the stage as a batch
    axis: "minimal" must still keep a projection's output, as it does without the vmap."""
    dot = precision.policy_from_config(ConfigDict({"policy": "fp32"})).dot_general

    def block(x, w1, w2):
        return dot(jnp.sin(dot(x, w1, (((1,), (0,)), ((), ())))), w2, (((1,), (0,)), ((), ())))
    stage = jax.checkpoint(block, policy=REMAT_POLICIES["minimal"])
    x, w1, w2 = jnp.ones((1, 4, 8)), jnp.ones((1, 8, 16)), jnp.ones((1, 16, 8))
    jax.ad_checkpoint.print_saved_residuals(lambda *a: jax.vmap(stage)(*a).sum(), x, w1, w2)
    saved = [line.split()[0] for line in capsys.readouterr().out.splitlines() if "from the argument" not in line]
    assert saved == ["f32[1,4,16]"]  # the first projection's output; was none before its name


@pytest.mark.slow  # CI budget (~12 s): one more pipeline compile
def test_minimal_remat_under_a_pipeline_recomputes_only_attention():
    """Compiled FLOPs of stage=2 x fsdp=4 with remat "minimal": the analytic count with only the
    attention scores recomputed (it compiled to full's 105,906,176 while the vmap hid the projections)."""
    r = compile_lib.analyse(_tiny(2, **{"pipeline.microbatches": 4, "model.remat": "minimal"}), "mi355x", 8)
    hand = _by_hand_per_token("minimal")
    expected = 16 * 32 / 8 * (hand["layers"] * 5 / 4 + hand["head"] * 2)
    assert r.flops.compiled_dot_flops == pytest.approx(expected, rel=1e-3) and expected < 105_906_176 / 1.2


def test_the_walker_counts_dots_in_loops_and_fusions():
    """Hand-written HLO: a dot in a fusion in a 3-trip loop, a convolution, and a second dot that a
    doubled layer would add; the counter sees each."""
    def module(extra: str = "") -> str:
        return f"""HloModule m, num_partitions=1

%fused (p0: f32[8,16], p1: f32[16,4]) -> f32[8,4] {{
  %p0 = f32[8,16]{{1,0}} parameter(0)
  %p1 = f32[16,4]{{1,0}} parameter(1)
  ROOT %d = f32[8,4]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%body (t: (s32[], f32[8,16], f32[16,4])) -> (s32[], f32[8,16], f32[16,4]) {{
  %t = (s32[], f32[8,16]{{1,0}}, f32[16,4]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %a = f32[8,16]{{1,0}} get-tuple-element(%t), index=1
  %b = f32[16,4]{{1,0}} get-tuple-element(%t), index=2
  %f = f32[8,4]{{1,0}} fusion(%a, %b), kind=kOutput, calls=%fused
  {extra}
  ROOT %r = (s32[], f32[8,16]{{1,0}}, f32[16,4]{{1,0}}) tuple(%i, %a, %b)
}}

%cond (t: (s32[], f32[8,16], f32[16,4])) -> pred[] {{
  %t = (s32[], f32[8,16]{{1,0}}, f32[16,4]{{1,0}}) parameter(0)
  ROOT %c = pred[] constant(true)
}}

ENTRY %main (x: f32[8,16], w: f32[16,4], img: f32[1,6,6,3], k: f32[3,3,3,5]) -> f32[1,4,4,5] {{
  %x = f32[8,16]{{1,0}} parameter(0)
  %w = f32[16,4]{{1,0}} parameter(1)
  %img = f32[1,6,6,3]{{3,2,1,0}} parameter(2)
  %k = f32[3,3,3,5]{{3,2,1,0}} parameter(3)
  %z = s32[] constant(0)
  %init = (s32[], f32[8,16]{{1,0}}, f32[16,4]{{1,0}}) tuple(%z, %x, %w)
  %loop = (s32[], f32[8,16]{{1,0}}, f32[16,4]{{1,0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"3"}}}}
  ROOT %conv = f32[1,4,4,5]{{3,2,1,0}} convolution(%img, %k), window={{size=3x3}}, dim_labels=b01f_01io->b01f
}}
"""
    layout = comm.MeshLayout.from_shape({"a": 1})
    dot, conv = 2 * 8 * 4 * 16, 2 * (4 * 4 * 5) * (3 * 3 * 3)
    assert comm.account(module(), layout)["dot_flops"] == 3 * dot + conv
    doubled = "%g = f32[8,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}"
    assert comm.account(module(doubled), layout)["dot_flops"] == 6 * dot + conv


def test_pipeline_minimum_by_hand():
    """stage=2 x fsdp=4, 4 microbatches: per stage 2 of the 4 layers, gathered and reduce-scattered
    once per microbatch, and each microbatch's activations over the stage boundary and back."""
    cfg = small_config(**{"model.n_layers": 4, "model.remat": "full", "train.per_device_batch_size": 2})
    least = comm_minimum.minimum(cfg.model, cfg.train, "fp32", {"stage": 2, "fsdp": 4}, microbatches=4)
    terms = {t["term"]: t["cpu_bytes"] for t in least["terms"]}
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128
    assert terms["layer weights"] == pytest.approx(4 * 2 * (2 * 4 + 4) * 3 / 4 * layer)
    tokens = 2 * 32 * 2  # a stage's device carries 2x the per-device batch (not split over stage)
    assert terms["stage activations"] == pytest.approx(2 * tokens * 64 * 4)
    assert terms["LM head"] == pytest.approx((4 + 4) * 3 / 4 * 64 * 128)
    assert sum(terms.values()) == pytest.approx(least["cpu_bytes"])
    # the loop a circular schedule or a padded stack runs (exact against compiled FLOPs on the pipeline branch)
    gpipe, circular = cfg.pipeline.to_dict(), {**cfg.pipeline.to_dict(), "schedule": "circular", "repeats": 2}
    assert loop_shape(ConfigDict(gpipe), 126, 8, 8) == (15, 16)  # 405B on 8 stages: 2 empty slots
    assert loop_shape(ConfigDict(circular), 4, 2, 4) == (9, 1)
    assert metrics.train_flops_per_token(cfg.model, 32) == pytest.approx(
        sum(v for k, v in metrics.executed_flops_per_token(cfg.model, 32, "none").items()
            if k in ("layers", "LM head", "causal attention")))


@pytest.mark.slow  # CI budget (~10 s): one more compile
def test_fp8_layer_weights_meet_their_minimum_in_the_cpu_dtype(tmp_path):
    """Under fp8 XLA:CPU shows the layers' weight all-gathers as f16, not f32 like the other
    policies' (comm_minimum.py, Dtypes): the compiled tiny_llama:fp8 on fsdp=8 sits at its
    minimum, not below it (it read 0.68 with 4-byte weights)."""
    import json
    out = tmp_path / "r.json"
    args = ["configs/tiny_llama.py:fp8", "--target=mi355x:8", "--comm", f"--json={out}",
            "--config.model.scan_layers=true", "--config.model.remat=full", "--config.precision.fp8_scaling=current"]
    assert compile_lib.main(args) == 0
    assert json.loads(out.read_text())["comm"]["ratio"] == pytest.approx(1.0, abs=2e-3)


def test_a_converted_stack_counts_the_checkpoint_save_in_the_fit():
    """Circular, or a stack the stages do not divide, trains in its own order and saves in model
    order: between steps the state's layer leaves (parameters, Adam's mu and nu) exist twice; so do
    an untied table's, stored on the first stage (pipeline/layout.py)."""
    def save_peak_over_the_state(cfg):
        r = compile_lib.analyse(cfg, "mi355x", 8, compile_it=False)
        peak = r.memory.checkpoint_save_peak_bytes
        return None if peak is None else peak - (r.memory.params_bytes + r.memory.opt_state_bytes +
                                                 r.memory.fp8_state_bytes)
    # fp32 per device, x 3 (parameter, mu, nu): 2 slots of one stage's layers split 4 ways by
    # fsdp, their 2 norm scales whole; the table's and the head's rows split 4 ways
    layer, table = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128, 128 * 64
    three_layers = _tiny(2, **{"model.n_layers": 3})  # 3 layers in 2 x 2 slots: converted at every save
    assert save_peak_over_the_state(three_layers) == 3 * 4 * (2 * layer / 4 + 2 * 2 * 64 + 2 * table / 4)
    assert save_peak_over_the_state(_tiny(2)) == 3 * 4 * 2 * table / 4
    assert save_peak_over_the_state(_tiny(2, **{"model.tie_embeddings": True})) is None


def test_the_loop_does_not_save_the_stages_weights_per_iteration(devices):
    """GPipe picks each stage's layers by a static index: a slice that varied with the iteration
    was saved by the loop's autodiff once per iteration, M + S - 1 copies of the stage's weights
    (here 3 x 0.81 MB more temporaries; 70B on 4 stages: 161 GiB of XLA buffers instead of 106).
    A weight-heavy tiny model (mlp 2048, 8 tokens) so that the copies would dominate."""
    cfg = _tiny(2, **{"model.mlp_dim": 2048, "train.per_device_batch_size": 1, "train.seq_len": 8,
                      "pipeline.microbatches": 2})
    r = compile_lib.analyse(cfg, "mi355x", 8)
    measured_without_copies = 5_736_872  # jax 0.10.2's buffer assignment; with the copies 8,173,416
    assert r.compiled.memory.temp_bytes < measured_without_copies + r.stages.layer_param_bytes


def test_circular_estimate_counts_the_chunk_weights_saved_per_iteration():
    """Circular's chunk changes per iteration, so its weights are saved once per iteration (70B, 4
    stages x 2 repeats on 4x8: the estimate with them 127.7 GiB of activations, XLA:CPU 135.3)."""
    cfg = _tiny(2, **{"pipeline.schedule": "circular", "pipeline.repeats": 2, "pipeline.microbatches": 2})
    r = compile_lib.analyse(cfg, "mi355x", 8, compile_it=False)
    # 2 x 2 + 2 - 1 = 5 iterations, each saving one of the device's 2 chunks: half its layer slots
    assert r.memory.analytic_activation_terms_bytes["circular chunk weights"] == 5 * r.stages.layer_param_bytes / 2
    assert "circular chunk weights" not in compile_lib.analyse(
        _tiny(2), "mi355x", 8, compile_it=False).memory.analytic_activation_terms_bytes


def test_the_batch_search_resolves_auto_microbatches_for_each_trial_batch():
    """analyse resolves pipeline.microbatches=0 for the configured batch (4 per device: 8 per
    batch shard, M = 8); the search's trial batches (1 per device: 2 per shard) resolve it afresh
    instead of keeping an M that no longer divides them."""
    cfg = _tiny(2, **{"train.per_device_batch_size": 4})
    assert ", 8 microbatches," in compile_lib.analyse(cfg, "mi355x", 8, compile_it=False).pipeline
    found = compile_lib.search(cfg, "mi355x", 8, 0.92, max_compiles=0, log=lambda *_: None, microbatches=0)
    assert found.largest_batch


@pytest.mark.parametrize("remat", ["none", "full"])  # ~5 s and ~4 s on 2 cores
def test_gpipe_recompute_flops_and_activations_against_the_compiled_step(devices, remat):
    """gpipe_recompute's backward runs each stage's forward again from its saved input: the compiled
    dot FLOPs are gpipe's plus one forward of the stack (2N + the unmasked scores per layer, with the
    same bubble), under remat full on top of full's own per-layer recompute. Its saved activations
    are each microbatch's stage input and output plus one microbatch's residuals of the stage's layers."""
    cfg = _tiny(2, **{"pipeline.schedule": "gpipe_recompute", "pipeline.microbatches": 4, "model.remat": remat})
    r = compile_lib.analyse(cfg, "mi355x", 8)
    hand = _by_hand_per_token(remat)
    attention_proj, ffn, scores_fwd = 64 * 64 + 2 * 64 * 32 + 64 * 64, 3 * 64 * 128, 4 * 32 * 4 * 16
    stack_forward = 4 * (2 * (attention_proj + ffn) + scores_fwd)
    tokens, bubble = 16 * 32 / 8, 5 / 4
    expected = tokens * ((hand["layers"] + stack_forward) * bubble + hand["head"] * 2)
    assert r.flops.analytic_dot_flops.total == pytest.approx(expected, rel=1e-12)
    assert r.flops.compiled_dot_flops == pytest.approx(expected, rel=1e-3)
    # activations, fp32: a batch shard of 4 sequences x 32 tokens, d 64; stage inputs and outputs
    # once per microbatch, the stage's 2 layers' residuals for one microbatch (T/M tokens)
    terms = r.memory.analytic_activation_terms_bytes
    shard = 4 * 32 * 64 * 4
    assert terms["stage inputs"] == shard and terms["pipeline loop"] == shard
    gpipe = compile_lib.analyse(_tiny(2, **{"pipeline.microbatches": 4, "model.remat": remat}), "mi355x", 8,
                                compile_it=False)
    assert r.memory.analytic_activations_bytes < gpipe.memory.analytic_activations_bytes
    # against XLA:CPU's buffers (measured 0.88 under remat none, 0.71 under full; gpipe 1.34 and 0.70)
    assert 0.5 <= r.compiled.memory.activations_bytes / r.memory.analytic_activations_bytes <= 1.6


@pytest.mark.parametrize("remat", ["none", "full"])  # ~5 s each on 2 cores
def test_interleaved_1f1b_flops_and_activations_against_the_compiled_step(devices, remat):
    """Two chunks of one layer per device, 4 microbatches: the layers' dots run R M + S - 1 = 9
    iterations' worth of chunks against 8 real passes (plain 1f1b: 5/4), and the residual slots
    are the order's (4 + 2 chunk slots of one layer, against plain 1f1b's 3 stage slots of two)."""
    cfg = _tiny(2, **{"pipeline.schedule": "1f1b", "pipeline.repeats": 2, "pipeline.microbatches": 4,
                      "model.remat": remat})
    r = compile_lib.analyse(cfg, "mi355x", 8)
    hand = _by_hand_per_token(remat)
    tokens = 16 * 32 / 8
    expected = tokens * (hand["layers"] * 9 / 8 + hand["head"] * 2)
    assert r.flops.analytic_dot_flops.total == pytest.approx(expected, rel=1e-12)
    assert r.flops.compiled_dot_flops == pytest.approx(expected, rel=1e-3)
    plain = compile_lib.analyse(_tiny(2, **{"pipeline.schedule": "1f1b", "pipeline.microbatches": 4,
                                            "model.remat": remat}), "mi355x", 8, compile_it=False)
    layers, plain_layers = (x.memory.analytic_activation_terms_bytes["layers"] for x in (r, plain))
    assert layers < plain_layers  # (6 + 2) x 1 layer against (3 + 2) x 2
    # against XLA:CPU's buffers
    assert 0.5 <= r.compiled.memory.activations_bytes / r.memory.analytic_activations_bytes <= 1.6


@pytest.mark.parametrize("remat", ["none", "full"])  # ~5 s each on 2 cores
def test_1f1b_flops_and_activations_against_the_compiled_step(devices, remat):
    """1f1b runs gpipe's forwards and backwards (no stage recompute; under remat none its stage
    checkpoint keeps every matmul's output, recomputing only elementwise work), so the compiled dot
    FLOPs are gpipe's; the head runs once per device, on the last stage alone, whose devices see the
    stage's whole batch shard: the analytic head term stays S x a device's share. Its activations
    are min(2S - 1, M) microbatches' residuals, the embeddings and their cotangents, one
    microbatch's logits and the gathered head."""
    cfg = _tiny(2, **{"pipeline.schedule": "1f1b", "pipeline.microbatches": 4, "model.remat": remat})
    r = compile_lib.analyse(cfg, "mi355x", 8)
    hand = _by_hand_per_token(remat)
    tokens, bubble = 16 * 32 / 8, 5 / 4
    expected = tokens * (hand["layers"] * bubble + hand["head"] * 2)
    assert r.flops.analytic_dot_flops.total == pytest.approx(expected, rel=1e-12)
    assert r.flops.compiled_dot_flops == pytest.approx(expected, rel=1e-3)
    assert r.flops.analytic_dot_flops.redundant_head == 0.0
    terms = r.memory.analytic_activation_terms_bytes
    shard = 4 * 32 * 64 * 4  # a batch shard of 4 sequences x 32 tokens, d 64, fp32
    assert terms["stage inputs"] == 2 * shard and terms["gathered head"] == 4 * 64 * 128
    gpipe = compile_lib.analyse(_tiny(2, **{"pipeline.microbatches": 4, "model.remat": remat}), "mi355x", 8,
                                compile_it=False)
    assert r.memory.analytic_activations_bytes < gpipe.memory.analytic_activations_bytes
    # against XLA:CPU's buffers
    assert 0.5 <= r.compiled.memory.activations_bytes / r.memory.analytic_activations_bytes <= 1.6
