"""The analytic minimum of bytes leaving each device per train step, for a layout.

Every parallel layout must move some data; this is the least a ring-collective implementation of
that layout sends, per device, per step, counted as comm.py counts the compiled program (bytes
leaving one device: all-gather (N-1)/N x result, reduce-scatter (N-1)/N x input, all-reduce
2(N-1)/N x size, all-to-all (N-1)/N x size). The report holds the compiled program to it.

Symbols (mesh axis sizes from the config's resolved mesh shape, ICI x DCN):
    D = data, Fs = fsdp, E = expert, S = sequence, t = tensor
    F  = Fs*S*E   the ZeRO-3 group of dense weights (the "embed" axis, maxtext_rocm/parallel/sharding.py)
    Fe = Fs*S     the ZeRO-3 group of expert weights (split over E, gathered over the rest)
    Nb = D*Fs*E*S the devices that hold different tokens
    A  = train.grad_accum micro-batches; T = tokens per device per micro-batch
         = per_device_batch_size * seq_len * t / A
    L layers, d d_model, V vocab, k experts_per_token, kv = n_kv_heads*head_dim
    P_l  = one layer's dense matmul weights split by tensor: (q,k,v,o + gate,up,down)/t, or for a
           MoE layer (q,k,v,o)/t + the router d*n_experts
    P_e  = one layer's expert weights per expert-axis shard: 3*d*mlp*n_experts/(E*t)
    w  = bytes of a gathered weight, g = gathers per layer per micro-batch, c = activation bytes,
    4  = bytes of a gradient element: the parameters' dtype, fp32 under every policy of
         maxtext_rocm/numerics/precision.py (`param_bytes` sets another; the formulas below write it 4)

Terms (each is 0 when its axis has size 1):
    layer weights   A*L*(g*w + 4)*(F-1)/F*P_l          ZeRO-3: gathered for the forward and
                                                        again for the remat'd backward (g=2; g=1
                                                        with remat "none", where the forward's
                                                        gathered copy may be kept), gradient
                                                        reduce-scattered
    expert weights  A*L*(g*w + 4)*(Fe-1)/Fe*P_e
    LM head         A*(w + 4)*(F-1)/F*d*V/t            gathered once per micro-batch (forward and
                                                        backward share it), reduce-scattered once
    embedding       untied: A*min((w + 4)*(F-1)/F*d*V/t, the table gathered and reduce-scattered,
                                  (F-1)/F*2*T*d*c      or its rows exchanged (the embedding is
                                  + (F-1)*T*4)         split along d: token ids all-gathered, rows
                                                        and their gradients all-to-all'ed)
                    tied: 0 (the head's gather and reduce-scatter serve it)
    data parallel   2*(D-1)/D*4*(L*(P_l/F + P_e/Fe) + (1 or 2)*d*V/(F*t))
                                                        the sharded gradients all-reduced over
                                                        `data`, once per step
    norm scales     2*(Nb-1)/Nb*4*(2L+1)*d              replicated: gradients all-reduced
    tensor          A*(n_t*L + 2)*2*(t-1)/t*T*d*c       n_t=5 under remat "full": 2 in the forward
                                                        (attention out, MLP down), 1 in the recompute
                                                        (attention out feeds the MLP; the MLP's output
                                                        is not needed by the backward), 2 in the
                                                        backward (input gradients of the fused q,k,v
                                                        and of gate/up); n_t=4 otherwise (nothing
                                                        recomputed, or the projections' outputs
                                                        kept); +2: the embedding's output (a vocab
                                                        shard's rows) and the head's input gradient
    expert          A*n_e*L*(E-1)/E*T*k*d*c             dispatch and combine all-to-alls: 2 in the
                                                        forward, 1 (dispatch) in the recompute, 2 in
                                                        the backward: n_e=5 under any remat policy
                                                        (no policy keeps an all-to-all's output),
                                                        4 with remat "none"; capacity slots beyond
                                                        T*k are overhead, not minimum
    sequence        A*L*(g + 1 + r)*2*(S-1)*T*kv/t*c    K and V all-gathered (forward, recompute),
                                                        their gradients reduce-scattered; r=1 under
                                                        model.context_parallel "ring", else 0: a
                                                        ring's backward has not kept the K/V blocks
                                                        that passed, so they go round again (S-1
                                                        hops) beside the dK/dV sums (S-1 hops)

PIPELINE (mesh stage = P > 1, pipeline.microbatches M; maxtext_rocm/parallel/pipeline/): each
stage's devices hold L/P layers and see the whole batch shard (the batch is not split over
`stage`), in M microbatches. The terms above then read per stage, with L -> L/P, A -> A*M for
the layers (each microbatch gathers the stage's weights and reduce-scatters their gradients, as a
gradient-accumulation micro-batch does) and T the tokens per device per microbatch; the
embedding and LM head run outside the pipeline, once per micro-batch on all of its tokens. One term
is added:
    stage activations  A*M*R*2*T*d*c                   each microbatch's block output crosses each
                                                        stage boundary forward, its cotangent back
                                                        (a busiest inner stage sends both), R times
                                                        under a circular schedule of R repeats
pipeline.schedule="gpipe_recompute" (parallel/pipeline/gpipe_recompute.py) runs each stage's forward once
more in its backward, so everything a forward sends is sent once more per microbatch: g -> g+1
(the layer and expert weights gathered again; the sequence term's K/V gathers), n_t -> n_t+2 (the
forward's two all-reduces per layer), n_e -> n_e+2 (dispatch and combine). The minimum of that
algorithm, as remat's recompute is counted in the terms above; comparing it with GPipe's says
what the schedule costs in bytes. pipeline.schedule="1f1b" (parallel/pipeline/one_f_one_b.py) gathers a
stage's weights again in each microbatch's backward, as remat does: g = 2 under remat "none" too.
Under pipeline.weight_gather="once" (parallel/pipeline/gather.py) the stage's weights are gathered
once per pipeline run, in the parameters' dtype (4 bytes on the GPU too), and their gradient
reduce-scattered once per microbatch (A*M), or once per run under pipeline.gradient_reduce="once":
the layer and expert weight terms read
    L*(A_head*4 + A_r*4)*(F-1)/F*P_l                   (Fe and P_e for the experts' weights)
with A_head = train.grad_accum and A_r = A (A_head under gradient_reduce "once"). The compiled
program reduce-scatters per iteration, the bubble's too, unless gradient_reduce="once".
The bubble's iterations are not in the minimum: the loop of M + P - 1 iterations also moves
(and gathers weights for) the data of idle stages, P - 1 iterations of it, which a schedule that
skipped idle stages would not; the measured figure includes them, so the pipeline's ratio is at
least (M + P - 1)/M on those terms.

Dtypes: every term is in 4-byte elements in the CPU figure, the dtype XLA:CPU shows (its float
normalization turns bf16 all-gathers, all-reduces, reduce-scatters and all-to-alls into f32 ones,
checked on jax 0.10.2; so on the CPU a weight cast to bf16 before its gather cannot be seen in
the bytes, only in the HLO's converts), except the layers' weights under fp8: their all-gathers
show as f16 there (2 bytes; measured on tiny_llama:fp8 and 405B:fp8, jax 0.10.2), so the CPU
figure takes w = 2 for them. The GPU figure takes c = 2 under bf16 and fp8, 4 under
fp32; w = the smaller of c and the parameters' bytes (weights cast to bf16 before the gather, fp8
quantizing after it); gradients in the parameters' dtype.

Not counted: the per-token softmax statistics a vocab-split loss all-reduces ([T] scalars, under
tensor), the router's auxiliary-loss statistics, the optimizer's global gradient norm (one scalar),
and metrics.
"""

from __future__ import annotations

from maxtext_rocm.config.checks import chunks_per_device
from maxtext_rocm.config.choices import feed_forward_dim

GRAD_BYTES = 4  # parameters and gradients are fp32 under every policy (precision.Policy.param_dtype)


def _params(m, t: int, E: int) -> tuple[float, float]:
    """(P_l, P_e): one layer's dense matmul weights per tensor shard, and its expert weights per
    expert x tensor shard."""
    attention = (2 * m.n_heads + 2 * m.n_kv_heads) * m.head_dim * m.d_model
    if m.n_experts > 1:
        return attention / t + m.d_model * m.n_experts, 3 * m.d_model * feed_forward_dim(m) * m.n_experts / (E * t)
    return (attention + 3 * m.d_model * m.mlp_dim) / t, 0.0


def pipeline_options(pipeline_cfg) -> dict:
    """minimum()'s pipeline keywords as a run's `pipeline` config sets them."""
    return {"repeats": chunks_per_device(pipeline_cfg),
            "stage_recompute": pipeline_cfg.schedule == "gpipe_recompute",
            "backward_gathers": pipeline_cfg.schedule == "1f1b",
            "weight_gather": pipeline_cfg.weight_gather, "gradient_reduce": pipeline_cfg.gradient_reduce}


def minimum(model_cfg, train_cfg, policy: str, sizes: dict[str, int], param_bytes: int = GRAD_BYTES,
            microbatches: int = 1, repeats: int = 1, stage_recompute: bool = False,
            weight_gather: str = "per_iteration", gradient_reduce: str = "per_iteration",
            backward_gathers: bool = False) -> dict:
    """The minimum bytes per device per step: {"terms": [...], "cpu_bytes", "gpu_bytes"}, each term
    with its mesh axes, CPU-dtype and GPU-dtype bytes, and its formula with the numbers put in.
    Under a pipeline (sizes["stage"] = P > 1, `microbatches` M, a circular schedule's `repeats` R,
    `stage_recompute` under gpipe_recompute) the terms are per stage: see PIPELINE in this module's
    docstring (`weight_gather`, `gradient_reduce`: its "once")."""
    m = model_cfg
    D, Fs, E, S, t = (sizes.get(a, 1) for a in ("data", "fsdp", "expert", "sequence", "tensor"))
    P = sizes.get("stage", 1)
    M = microbatches if P > 1 else 1
    F, Fe, Nb, A = Fs * S * E, Fs * S, D * Fs * E * S, train_cfg.grad_accum * M
    # Tokens per device per micro-batch: the batch is not split over `stage`, so a stage's devices
    # carry P times the per-device batch; a pipeline's microbatch is 1/M of it.
    T = train_cfg.per_device_batch_size * train_cfg.seq_len * t * P / A
    # a stage's share of the real layers (a padded stack's empty slots are overhead, not minimum)
    L, d, V, k = m.n_layers / P if m.n_layers % P else m.n_layers // P, m.d_model, m.vocab_size, m.experts_per_token
    A_head = train_cfg.grad_accum  # the embedding and LM head run outside the pipeline, on the whole batch
    kv = m.n_kv_heads * m.head_dim
    P_l, P_e = _params(m, t, E)
    again = 1 if stage_recompute and P > 1 else 0  # gpipe_recompute's second forward of each stage
    # 1f1b (`backward_gathers`): a microbatch's backward runs iterations after its forward, so
    # its stage's weights are gathered again for it whatever model.remat keeps.
    g = (1 if m.remat == "none" and not (backward_gathers and P > 1) else 2) + again
    n_t = (5 if m.remat == "full" else 4) + 2 * again
    n_e = (4 if m.remat == "none" else 5) + 2 * again
    moe = m.n_experts > 1
    r_ring = 1 if getattr(m, "context_parallel", "auto") == "ring" else 0  # "auto" is "all_gather"
    # axis labels in the mesh's order (data, fsdp, expert, sequence, tensor), as comm.py writes them
    zero = ",".join(a for a, n in (("fsdp", Fs), ("expert", E), ("sequence", S)) if n > 1)
    zero_e = ",".join(a for a, n in (("fsdp", Fs), ("sequence", S)) if n > 1)
    batch = ",".join(a for a, n in (("data", D), ("fsdp", Fs), ("expert", E), ("sequence", S)) if n > 1)
    gpu_c = 4 if policy == "fp32" else 2
    head_tables = 1 if m.tie_embeddings else 2

    once = P > 1 and weight_gather == "once"
    A_r = A_head if gradient_reduce == "once" else A  # the gradient's reduce-scatters under "once"

    def layer_rows(wl: float, gb: float) -> list[tuple[str, str, float, str]]:
        """The layers' (and experts') weight gathers and gradient reduce-scatters; wl: a layer
        weight's gathered bytes (w but for the CPU's fp8 layers, see Dtypes)."""
        if once:  # one gather (in the parameters' dtype) per pipeline run
            per = A_head * param_bytes + A_r * gb
            return [("layer weights", zero, L * per * (F - 1) / F * P_l,
                     f"L*(A_head*4+A_r*4)*(F-1)/F*P_l = {L}*({A_head}*{param_bytes}+{A_r}*{gb})*({F}-1)/{F}*{P_l:.0f}"),
                    ("expert weights", zero_e, L * per * (Fe - 1) / Fe * P_e,
                     f"L*(A_head*4+A_r*4)*(Fe-1)/Fe*P_e = "
                     f"{L}*({A_head}*{param_bytes}+{A_r}*{gb})*({Fe}-1)/{Fe}*{P_e:.0f}")]
        return [("layer weights", zero, A * L * (g * wl + gb) * (F - 1) / F * P_l,
                 f"A*L*(g*w+4)*(F-1)/F*P_l = {A}*{L}*({g}*{wl}+{gb})*({F}-1)/{F}*{P_l:.0f}"),
                ("expert weights", zero_e, A * L * (g * wl + gb) * (Fe - 1) / Fe * P_e,
                 f"A*L*(g*w+4)*(Fe-1)/Fe*P_e = {A}*{L}*({g}*{wl}+{gb})*({Fe}-1)/{Fe}*{P_e:.0f}")]

    def terms(w: float, c: float, gb: float, wl: float) -> list[tuple[str, str, float, str]]:
        rows = layer_rows(wl, gb) + [
            ("LM head", zero, A_head * (w + gb) * (F - 1) / F * d * V / t,
             f"A*(w+4)*(F-1)/F*d*V/t = {A_head}*({w}+{gb})*({F}-1)/{F}*{d}*{V}/{t}"),
        ]
        if not m.tie_embeddings:
            table = (w + gb) * (F - 1) / F * d * V / t
            exchange = (F - 1) / F * 2 * T * M * d * c + (F - 1) * T * M * 4
            rows.append(("embedding", zero, A_head * min(table, exchange),
                         f"A*min((w+4)*(F-1)/F*d*V/t, (F-1)/F*2*T*d*c+(F-1)*T*4) = {A_head}*min({table:.0f}, {exchange:.0f})"))
        grads = L * (P_l / F + P_e / Fe) + head_tables * d * V / (F * t)
        rows += [
            ("data-parallel gradients", "data", 2 * (D - 1) / D * gb * grads,
             f"2*(D-1)/D*4*(L*(P_l/F+P_e/Fe)+{head_tables}*d*V/(F*t)) = 2*({D}-1)/{D}*{gb}*{grads:.0f}"),
            ("norm scales", batch, 2 * (Nb - 1) / Nb * gb * (2 * L + 1) * d,
             f"2*(Nb-1)/Nb*4*(2L+1)*d = 2*({Nb}-1)/{Nb}*{gb}*{2 * L + 1}*{d}"),
            ("tensor activations", "tensor", (A * n_t * L + 2 * A_head * M) * 2 * (t - 1) / t * T * d * c,
             f"A*(n_t*L+2)*2*(t-1)/t*T*d*c = {A}*({n_t}*{L}+2)*2*({t}-1)/{t}*{T:.0f}*{d}*{c}"),
            ("expert dispatch/combine", "expert", A * n_e * L * (E - 1) / E * T * k * d * c if moe else 0.0,
             f"A*n_e*L*(E-1)/E*T*k*d*c = {A}*{n_e}*{L}*({E}-1)/{E}*{T:.0f}*{k}*{d}*{c}"),
            ("sequence K/V", "sequence", A * L * (g + 1 + r_ring) * 2 * (S - 1) * T * kv / t * c,
             f"A*L*(g+1+r)*2*(S-1)*T*kv/t*c = {A}*{L}*({g}+1+{r_ring})*2*({S}-1)*{T:.0f}*{kv}/{t}*{c}"),
        ]
        if P > 1:
            R = repeats
            rows.append(("stage activations", "stage", A * R * 2 * T * d * c,
                         f"A*M*R*2*T_mb*d*c = {A}*{R}*2*{T:.0f}*{d}*{c}"))
        return rows

    w_gpu = min(gpu_c, param_bytes)
    cpu, gpu = terms(4, 4, 4, 2 if policy == "fp8" else 4), terms(w_gpu, gpu_c, param_bytes, w_gpu)
    out = [{"term": name, "axes": axes or "-", "cpu_bytes": b_cpu, "gpu_bytes": b_gpu,
            "formula": formula, "gpu_formula": gpu_formula}
           for (name, axes, b_cpu, formula), (_, _, b_gpu, gpu_formula) in zip(cpu, gpu) if b_cpu > 0]
    return {"terms": out, "cpu_bytes": sum(r["cpu_bytes"] for r in out),
            "gpu_bytes": sum(r["gpu_bytes"] for r in out),
            "symbols": {"P": P, "M": M, "D": D, "Fs": Fs, "E": E, "S": S, "t": t, "F": F, "Fe": Fe, "Nb": Nb, "A": A,
                        "T": T, "L": L, "d": d, "V": V, "k": k, "kv": kv, "P_l": P_l, "P_e": P_e,
                        "g": g, "r": r_ring, "n_t": n_t, "n_e": n_e, "w_gpu": min(gpu_c, param_bytes), "c_gpu": gpu_c,
                        "grad_bytes_gpu": param_bytes}}
