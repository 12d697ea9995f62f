"""The declared keys of what is trained and how it is laid out: `model`, `mesh`, `pipeline`,
`precision` (config/declared.py assembles them; the run's other groups: config/keys_run.py)."""

from __future__ import annotations

from maxtext_rocm.config.schema import Group, Key

# `stage` outermost: a pipeline moves only activations between stages, so it takes the slowest
# links (DCN) and leaves the fast ones to the axes with a collective in every layer.
MESH_AXES = ("stage", "data", "fsdp", "expert", "sequence", "tensor")
POSITIVE = dict(above=0)
# model.family names the architecture as Hugging Face does (convert/families.py maps each to its
# classes and the layer options it fixes); these replace the dense feed-forward by a mixture of experts.
DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
MOE_FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")

MODEL = Group("The transformer: its family, sizes and how its layers compute.", {
    "family": Key("llama", "the architecture, named as Hugging Face's model_type: dense llama, mistral, "
                           "qwen2, qwen3, gemma3; mixtral, qwen3_moe and gpt_oss (mixtures of experts)",
                  choices=DENSE_FAMILIES + MOE_FAMILIES),
    "vocab_size": Key(32000, "rows of the token embedding and the LM head", **POSITIVE),
    "d_model": Key(256, "the hidden size", **POSITIVE),
    "n_layers": Key(4, "transformer blocks", **POSITIVE),
    "n_heads": Key(4, "query heads", **POSITIVE),
    "n_kv_heads": Key(4, "key/value heads (grouped-query attention shares each among n_heads / n_kv_heads)",
                      **POSITIVE),
    "head_dim": Key(64, "the size of each head (even, for rotary embeddings)", **POSITIVE),
    "mlp_dim": Key(1024, "the hidden size of each SwiGLU feed-forward (of each expert in a mixture, unless "
                         "model.moe_mlp_dim says otherwise)", **POSITIVE),
    "moe_mlp_dim": Key(0, "the hidden size of each expert in a mixture where it is not model.mlp_dim (Qwen3-MoE's "
                          "moe_intermediate_size beside its intermediate_size); 0: mlp_dim", at_least=0,
                       valid="an expert's hidden size >= 1, or 0 for model.mlp_dim"),
    "rope_theta": Key(500000.0, "the rotary embeddings' base frequency", above=0),
    "rope_scaling": Key(None, "None, or Llama 3.1's frequency scaling: {factor, low_freq_factor, "
                              "high_freq_factor, original_max_position}", kind=dict, nullable=True),
    "rope_yarn": Key(None, "None, or YaRN's frequency scaling (gpt-oss): {factor, beta_fast, beta_slow, "
                           "original_max_position, truncate, attention_factor}, the last scaling rotated q and k",
                     kind=dict, nullable=True),
    "norm_eps": Key(1e-5, "RMSNorm's epsilon", above=0),
    "tie_embeddings": Key(False, "the LM head shares the token embedding's weights"),
    "scan_layers": Key(True, "the blocks as one scanned layer (fast compiles; a pipeline needs it)"),
    "remat": Key("full", "what the backward keeps of each block's forward: none (all), full (its input), "
                         "minimal (projection outputs), save_dots (every matmul output)",
                 choices=("none", "full", "minimal", "save_dots")),
    "loss_chunk_len": Key(64, "sequence positions the fused LM head and cross-entropy compute at a time, so "
                              "full [tokens, vocab] logits never exist; 0: unchunked", at_least=0,
                          valid="a chunk length >= 1, or 0 for unchunked logits"),
    "attention": Key("auto", "xla, cudnn, blockwise or pallas; auto picks by device, dtype and sequence length",
                     choices=("xla", "cudnn", "blockwise", "pallas", "auto")),
    "embed_init_std": Key(0.02, "the standard deviation of the embedding's initialisation", above=0),
    "sliding_window": Key(0, "attention to at most this many tokens back, the query included; 0 or None: off",
                          kind=int, nullable=True, at_least=0, valid="a number of tokens, or 0 or None for off"),
    "attention_kinds": Key((), "the repeating unit of the layers' attention kinds, full or sliding (within "
                               "model.sliding_window), as Hugging Face's layer_types: Gemma 3's five sliding to one "
                               "full; empty: every layer full, or sliding where sliding_window is set",
                           kind=tuple, valid="a list of full and sliding, repeats allowed (e.g. sliding,full)"),
    "rope_local_theta": Key(None, "the rope base of sliding layers under attention_kinds (Gemma 3: 10000); None: "
                                  "rope_theta and rope_scaling, as full layers", kind=float, nullable=True, above=0,
                            valid="a rope base > 0, or None for rope_theta"),
    "rope_linear_factor": Key(1.0, "positions divided by this in full layers' rope (Gemma 3's linear scaling)",
                              at_least=1),
    "norm_unit_offset": Key(False, "each RMSNorm scales by 1 + w, w stored zero-centred (Gemma)"),
    "post_norms": Key(False, "an RMSNorm on the attention's and the MLP's outputs too, before each residual add "
                             "(Gemma 3)"),
    "scale_embeddings": Key(False, "the embedding multiplied by sqrt(d_model) (Gemma)"),
    "query_pre_attn_scalar": Key(None, "attention scores scaled by this ** -0.5 (Gemma 3); None: head_dim ** -0.5",
                                 kind=float, nullable=True, above=0, valid="a number > 0, or None for head_dim"),
    "mlp_activation": Key("silu", "the gated MLP's activation: silu (SwiGLU), gelu_tanh (GeGLU, Gemma) or "
                                  "clamped_silu (gpt-oss: (clip(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = "
                                  "min(gate, 7))", choices=("silu", "gelu_tanh", "clamped_silu")),
    "qk_norm": Key(False, "an RMSNorm over each head's queries and keys before rope (Qwen3)"),
    "qkv_bias": Key(False, "biases on the query, key and value projections (Qwen2.5)"),
    "out_bias": Key(False, "a bias on the attention's output projection (gpt-oss)"),
    "attention_sinks": Key(False, "a learned logit per query head in each softmax's denominator, attending to "
                                  "nothing (gpt-oss); runs under model.attention xla and blockwise"),
    "fuse_projections": Key("auto", "q/k/v and gate/up as one dot each, so tensor parallelism reduces x's "
                                    "gradient once per group; auto: on when mesh tensor > 1 (fp8 keeps one dot "
                                    "per weight)", choices=("auto", "on", "off")),
    "context_parallel": Key("auto", "attention under mesh sequence > 1: all_gather (K/V gathered once per layer) "
                                    "or ring (K/V blocks passed around); auto: all_gather",
                            choices=("auto", "all_gather", "ring")),
    "context_load_balance": Key(True, "under mesh sequence = S, shard i holds chunks i and 2S-1-i of 2S, so "
                                      "every shard does the same causal attention work"),
    "n_experts": Key(1, "experts per MoE layer (mixtral, qwen3_moe, gpt_oss); 1 for a dense family", at_least=1),
    "experts_per_token": Key(1, "experts each token is routed to (top-k)", at_least=1),
    "moe_impl": Key("auto", "dropless (ragged_dot), capacity (drops what overflows), dense (every expert on "
                            "every token); auto: dropless", choices=("auto", "dropless", "capacity", "dense")),
    "moe_renormalize": Key(True, "the chosen experts' router weights rescaled to sum to one (Mixtral; "
                                 "Qwen3-MoE's norm_topk_prob)"),
    "moe_router": Key("softmax_topk", "softmax_topk: a softmax over every expert, then the top k (Mixtral, "
                                      "Qwen3-MoE); topk_softmax: the top k logits, then a softmax over them "
                                      "(gpt-oss; moe_renormalize has nothing left to do)",
                      choices=("softmax_topk", "topk_softmax")),
    "moe_bias": Key(False, "biases on the router's logits and on each expert's gate, up and down projections "
                           "(gpt-oss)"),
    "moe_capacity_factor": Key(1.25, "under capacity: slots per expert = factor x an even share of tokens",
                               above=0),
    "moe_aux_loss_weight": Key(0.02, "the load-balancing loss's weight, scaled as Mixtral's", at_least=0),
    "moe_router_z_loss_weight": Key(0.0, "ST-MoE's router z-loss weight; 0: off (still reported)", at_least=0),
}, page="configs.md")


def feed_forward_dim(m) -> int:
    """The hidden size of the stack's feed-forward layers: each expert's in a mixture
    (model.moe_mlp_dim, or mlp_dim where it is 0), mlp_dim in a dense model. A mixture is told by
    n_experts > 1, as the planner's formulas tell it, which also take model groups written by hand
    without the newer keys (moe_mlp_dim then 0)."""
    return (m.n_experts > 1 and m.get("moe_mlp_dim", 0)) or m.mlp_dim


def _mesh_axes(fill: str | None, where: str) -> Group:
    return Group(f"Axis sizes {where}; -1 fills what the other axes leave.", {
        axis: Key(-1 if axis == fill else 1, f"devices along `{axis}` {where}", at_least=-1,
                  valid="a positive size or -1 to fill")
        for axis in MESH_AXES})


MESH = Group("Mesh axis sizes: ici spans the devices of one host, dcn the hosts; the product of both is the "
             "device count.", {
                 "ici": _mesh_axes("fsdp", "within a host (fast links)"),
                 "dcn": _mesh_axes(None, "across hosts"),
             }, page="parallelism.md")

PIPELINE_SCHEDULES = ("gpipe", "circular", "gpipe_recompute", "1f1b")
VIRTUAL_STAGE_SCHEDULES = ("circular", "1f1b")  # those that run pipeline.repeats chunks per device
PIPELINE_WEIGHT_GATHERS = ("per_iteration", "once")

PIPELINE = Group("Pipeline parallelism over the mesh's `stage` axis: the scanned layers split into stages, each "
                 "batch flowing through them in microbatches.", {
                     "microbatches": Key(0, "pieces each (grad_accum micro-)batch flows through the stages in; 0: "
                                            "the most, up to 4 per stage, that split each batch shard evenly",
                                         at_least=0, valid="a count >= 1, or 0 to choose (up to 4 per stage, "
                                                           "as the batch allows)"),
                     "schedule": Key("gpipe", "gpipe (all forward, then all backward), circular (round the stages "
                                              "`repeats` times), gpipe_recompute (a hand-written backward keeping "
                                              "one microbatch's residuals), 1f1b (each backward as soon as its "
                                              "loss exists; interleaved with repeats > 1)",
                                     choices=PIPELINE_SCHEDULES),
                     "repeats": Key(1, "virtual stages per device (circular and 1f1b; the others take 1)", at_least=1,
                                    valid="a count >= 1 of virtual stages per device"),
                     "weight_gather": Key("per_iteration", "when a stage's ZeRO-3-sharded weights are gathered: "
                                                           "per_iteration (where the loop uses them) or once (before "
                                                           "the loop, held whole in fp32 for the step)",
                                          choices=PIPELINE_WEIGHT_GATHERS),
                     "gradient_reduce": Key("per_iteration", "with weight_gather once: once reduce-scatters the "
                                                             "stage's gradient once a step, at the memory of its "
                                                             "fp32 sum (dense, no fp8, sequence 1, jax 0.10)",
                                            choices=PIPELINE_WEIGHT_GATHERS),
                 }, page="parallelism.md")

PRECISION = Group("Number formats: parameters, compute and fp8 matmuls.", {
    "policy": Key("bf16", "fp32, bf16 (fp32 parameters, bf16 compute) or fp8 (bf16 with fp8 matmuls)",
                  choices=("fp32", "bf16", "fp8")),
    "fp8_format": Key("auto", "ocp (e4m3fn/e5m2) or fnuz (e4m3fnuz/e5m2fnuz, gfx942); auto: by device",
                      choices=("auto", "ocp", "fnuz")),
    "fp8_scaling": Key("delayed", "delayed (an amax history) or current (this step's amax)",
                       choices=("delayed", "current")),
    "amax_history_len": Key(1024, "steps of amax history under delayed scaling", **POSITIVE),
    "fp8_lm_head": Key(False, "the LM head in fp8 too (it stays bf16 otherwise)"),
}, page="precision.md")
