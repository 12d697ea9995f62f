"""Every default of a run, in one nested ConfigDict: a group per part of the trainer (`model`, `mesh`,
`precision`, `optimizer`, `data`, `checkpoint`, `train`, `dpo`, `lora`, `log`, `distributed`, `pipeline`), each key
with a comment saying what it does. Presets (configs/NAME.py) start from `defaults()`."""

from __future__ import annotations

import ml_collections

from maxtext_rocm.config.choices import MESH_AXES


def defaults() -> ml_collections.ConfigDict:
    """Every key the trainer reads, with its default. Presets start from here."""
    cfg = ml_collections.ConfigDict()
    cfg.name = "run"
    cfg.output_dir = ""  # empty: runs/<name>

    cfg.model = dict(
        family="llama",
        vocab_size=32000,
        d_model=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=4,
        head_dim=64,
        mlp_dim=1024,
        rope_theta=500000.0,
        # None, or the Llama 3.1 frequency scaling:
        # dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
        rope_scaling=None,
        norm_eps=1e-5,
        tie_embeddings=False,
        scan_layers=True,
        remat="full",
        # The loss runs the LM head and cross-entropy over this many sequence positions at a time
        # (maxtext_rocm/numerics/cross_entropy.py), so full [tokens, vocab] fp32 logits never exist; 0: unchunked.
        loss_chunk_len=64,
        attention="auto",  # "xla", "cudnn", "blockwise", "auto" (by device; models/attention.py)
        embed_init_std=0.02,
        # Attention to at most this many tokens back, the query included; None or 0: off.
        sliding_window=0,
        # q/k/v and gate/up each as one dot over their kernels side by side, so that tensor
        # parallelism reduces x's gradient once per group (5 all-reduces per layer, not 8). The
        # parameters are the same either way. "auto": on when mesh tensor > 1; on one device the
        # separate dots are faster (docs/figures.md#separate-or-fused-projections-on-one-device).
        # fp8 always keeps one dot per weight.
        fuse_projections="auto",
        # Attention under mesh sequence > 1 (maxtext_rocm/parallel/context.py): "all_gather" (K/V
        # gathered once per layer), "ring" (K/V blocks passed around the axis), "auto" (all_gather).
        # Nothing changes with sequence = 1.
        context_parallel="auto",
        # Causal load balance under sequence = S: shard i holds chunks i and 2S-1-i of 2S, so every
        # shard does the same attention work (train.seq_len must divide into 2S chunks).
        context_load_balance=True,
        # Mixture of experts (family "mixtral"; a dense "llama" keeps n_experts=1). See models/moe.py.
        n_experts=1,
        experts_per_token=1,
        moe_impl="auto",  # "dropless" (ragged_dot), "capacity" (drops overflow), "dense", "auto"
        moe_capacity_factor=1.25,  # "capacity": slots per expert = factor x an even share of tokens
        moe_aux_loss_weight=0.02,  # load balancing, scaled as Mixtral's (balanced = experts_per_token)
        moe_router_z_loss_weight=0.0,  # ST-MoE router z-loss; 0 = off (still reported)
    )
    # Mesh axis sizes; -1 fills what the other axes leave. ICI axes span the devices of one host
    # (fast links), DCN axes span hosts. The product of both must equal the device count.
    cfg.mesh = dict(
        ici={axis: (-1 if axis == "fsdp" else 1) for axis in MESH_AXES},
        dcn={axis: 1 for axis in MESH_AXES},
    )
    # Pipeline parallelism over the `stage` mesh axis (maxtext_rocm/parallel/pipeline.py): the
    # scanned layers split into mesh stage-many contiguous stages; each step's batch (per
    # gradient-accumulation micro-batch) flows through them in `microbatches` pieces.
    cfg.pipeline = dict(
        # 0 (auto): the most, up to 4 per stage, that split each batch shard's sequences evenly
        # (config_checks.pipeline_microbatches); more shrink the bubble ((S-1)/(M+S-1) for gpipe)
        # and each microbatch's saved activations, at smaller matmuls.
        microbatches=0,
        # "gpipe": all microbatches forward, then all backward (autodiff of the loop); "circular":
        # each microbatch goes round the stages `repeats` times, bubble (S-1)/(R M+S-1); "gpipe_recompute":
        # gpipe's bubble, a hand-written backward that recomputes each stage per microbatch, so a
        # stage keeps one microbatch's layer residuals, not M (one more forward per step); "1f1b":
        # each microbatch's backward as soon as its loss exists, at most 2S - 1 microbatches'
        # residuals; with repeats > 1 interleaved, bubble (S-1)/(R M+S-1), M a multiple of S.
        schedule="gpipe",
        repeats=1,  # virtual stages per device (circular, and 1f1b: interleaved; the others take 1)
        # When a stage's ZeRO-3-sharded weights (fsdp, and sequence/expert for dense ones) are
        # gathered. "per_iteration": where the loop's body uses them, as GSPMD places it: g times in
        # each of the M + S - 1 iterations (g = 2 under remat), the bubble's too. "once": before the
        # loop, one gather a step (parallel/pipeline_gather.py), at the memory of the stage's
        # weights held whole in fp32 for the step (the fit check counts it). The gradient is still
        # reduce-scattered per iteration unless gradient_reduce="once".
        weight_gather="per_iteration",
        # "once" (with weight_gather "once"): the loop runs on each batch shard's rows, manual over
        # the batch axes, so each device sums its own weight gradient over the iterations and it is
        # reduce-scattered once a step, after the loop; at the memory of that sum, the stage's
        # gradient whole in fp32. Dense models, no fp8, mesh sequence 1, jax 0.10 (jax 0.12's XLA
        # aborts its nested shard_maps: refused there).
        gradient_reduce="per_iteration",
    )
    cfg.precision = dict(
        policy="bf16",  # "fp32", "bf16", or "fp8" (bf16 with fp8 matmuls; see maxtext_rocm/numerics/fp8.py)
        fp8_format="auto",  # "ocp" (e4m3fn/e5m2), "fnuz" (e4m3fnuz/e5m2fnuz, gfx942), "auto": by device
        fp8_scaling="delayed",  # "delayed" (amax history) or "current" (this step's amax)
        amax_history_len=1024,
        fp8_lm_head=False,  # the LM head stays in bf16 unless this is set
    )
    cfg.optimizer = dict(
        lr=3e-4,
        warmup_steps=100,
        schedule="cosine",
        min_lr_ratio=0.1,  # the cosine schedule ends at lr * min_lr_ratio
        weight_decay=0.1,
        clip_norm=1.0,  # 0 turns clipping off
        b1=0.9,
        b2=0.95,
        eps=1e-8,
    )
    # tokenizer: "byte", or a tokenizer.json / SentencePiece .model / tiktoken rank file (data/tokenizer.py)
    cfg.data = dict(
        source="synthetic", seed=0, tokenizer="byte",
        # data.source="files" (maxtext_rocm/data/files.py): comma-separated files or globs of
        # .jsonl / .parquet / .txt / .arrayrecord (pre-tokenized by scripts/pretokenize.py).
        paths="", eval_paths="",
        text_field="text",  # the JSON Lines field / Parquet column holding the text
        # What each JSON line holds (data/formats.py, docs/finetuning.md): "text" (data.text_field),
        # "chat" ({"messages": [{"role", "content"}, ...]}), "prompt_completion" ({"prompt",
        # "completion"}) or "preference" ({"prompt", "chosen", "rejected"}: rows in pairs, for DPO).
        format="text",
        # The Jinja template chats are rendered with: "" the tokenizer's own (chat_template.jinja or
        # tokenizer_config.json's chat_template beside data.tokenizer), a file, or built-in "llama3".
        chat_template="",
        train_on_prompt=False,  # chat/prompt_completion: train every token, not only the assistant's
        add_bos=True, add_eos=True,  # around each document, where the tokenizer has them
        # How documents become rows (data/packing.py): "concat" fills every row to the last token,
        # documents continuing into the next row (no padding but at the end of finite data);
        # "best_fit" keeps documents whole (best-fit over data.packing_window documents; the rest of
        # a row is padding, reported as padding_fraction); "none": one document per row, truncated.
        packing="concat",
        packing_window=512,  # best_fit: documents packed together; more: less padding, more memory
        epochs=0,  # passes over data.paths before the run stops with an error; 0: no limit
        prefetch=4,  # batches a background thread builds ahead of the step
        # Processes that tokenize documents ahead of that thread, for each data-loading process (a
        # tokenizer holds Python's lock: threads would not help); 0 or 1: the thread tokenizes.
        # Same batches and resume position whatever the number (data/workers.py).
        workers=0,
        # Resume over data files that changed since the checkpoint (appended, replaced, removed), or
        # with another number of data-loading processes mid-epoch: refused (one sentence) unless true.
        allow_changed=False,
    )
    cfg.train = dict(
        steps=1000,
        per_device_batch_size=4,
        seq_len=2048,
        grad_accum=1,
        seed=0,
        z_loss_weight=0.0,
        # A step whose loss or gradients are inf/NaN: "skip" drops its update and counts it;
        # "stop" keeps the last good state, checkpoints it and exits non-zero.
        on_nonfinite="skip",
        # Under "skip", this many bad steps in a row stop the run (exit 3) with the last good
        # state saved: divergence that dropping steps cannot cure is never hidden.
        max_skipped_steps=5,
        eval_every=0,  # steps between evaluations on the eval split (data.eval_paths for files); 0: off
        eval_steps=10,  # batches per evaluation
        # JAX's persistent compilation cache, so a restarted run (preemption, resume) loads its
        # compiled programs instead of compiling them again (maxtext_rocm/trainer/compilation.py):
        # "auto": $JAX_COMPILATION_CACHE_DIR if set, else output_dir/compilation_cache; "off"; or a directory.
        compilation_cache="auto",
        # The hang watchdog (maxtext_rocm/runtime/watchdog.py): no step finished for this many seconds ->
        # every thread's Python stack to stderr and output_dir/hang-*.txt, exit status 4, so a
        # scheduler restarts the run from its last checkpoint; 0 = off. It must exceed the longest
        # pause between two steps (an evaluation, the blocking part of a checkpoint save).
        hang_timeout_s=0.0,
        # The watchdog's limit from launch to the end of the first step (restore and compilation
        # included, which take far longer than a step); 0: 10 x hang_timeout_s.
        startup_timeout_s=0.0,
        # What the step minimises: "lm" (next-token cross-entropy on the tokens with weight) or
        # "dpo" (preference pairs against a frozen reference; maxtext_rocm/finetune/dpo.py,
        # docs/dpo.md), which reads the `dpo` group.
        objective="lm",
    )
    # Direct Preference Optimization (train.objective="dpo"; TRL's sigmoid loss).
    cfg.dpo = dict(
        beta=0.1,  # how far the policy may move from the reference: rewards are beta x log-ratios
        # Conservative DPO: the share of pairs assumed mislabelled (TRL's label_smoothing); 0: plain DPO.
        label_smoothing=0.0,
    )
    cfg.checkpoint = dict(
        enabled=True,
        every=1000,  # steps between saves; 0 saves only at the end (and on preemption)
        keep=3,  # the newest `keep` checkpoints survive...
        keep_period=0,  # ...plus every keep_period-th step, if > 0
        async_save=True,  # write in the background while training goes on
        resume="auto",  # "auto" (newest complete checkpoint), "never", a step, or a checkpoint path
        load_params_from="",  # a run dir, checkpoint or params export to start from (fresh optimizer)
    )
    # LoRA (maxtext_rocm/finetune/lora.py): low-rank adapters beside a frozen base held in the
    # compute dtype; only the adapters are trained, checkpointed and given optimizer state. The
    # base is checkpoint.load_params_from (or, without it, train.seed's initialisation).
    cfg.lora = dict(
        rank=0,  # the adapters' rank r; 0: off (every parameter is trained)
        alpha=16.0,  # the low-rank path is scaled by alpha / rank (PEFT's lora_alpha)
        # the dense layers that get adapters: any of q, k, v, o (attention), gate, up, down (MLP)
        targets=("q", "k", "v", "o", "gate", "up", "down"),
        dropout=0.0,  # dropout on the adapters' input during training (PEFT's lora_dropout)
        # A resume or a reader (verify, export, generate, to-hf) on another base than the one the
        # run recorded (its checksums; a seed-made base's train.seed) is refused; True goes on with
        # the new base on purpose, with a warning (finetune/lora_base.py).
        allow_base_change=False,
    )
    cfg.log = dict(
        every=10,
        tensorboard=True,  # OUTPUT_DIR/tensorboard event files
        # A Weights & Biases run with the same scalars and the resolved config ("" = off; needs
        # pip install -e '.[wandb]'); WANDB_MODE=offline keeps it in OUTPUT_DIR/wandb, for `wandb sync`.
        wandb_project="",
        wandb_run_name="",  # "" lets W&B name the run
        peak_tflops=0.0,  # > 0 overrides the per-device peak table (used for MFU)
        # (start, end): a jax.profiler trace of steps start..end-1 (0-based) into
        # output_dir/profile, for TensorBoard's profile plugin; (0, 0) = off.
        profile_steps=(0, 0),
    )
    # Multi-process start-up (maxtext_rocm/runtime/distributed.py). Unset keys are found from the
    # environment (JAX_*, SLURM, Open MPI, Kubernetes); one process needs none of them.
    cfg.distributed = dict(
        coordinator="",  # HOST:PORT of process 0
        num_processes=0,  # 0: detect
        process_id=-1,  # -1: detect
        init_timeout_s=300,  # give up (exit 2) if the processes have not all met by then
        heartbeat_timeout_s=100,  # a process silent this long is dead and the others stop
    )
    # Locked: a preset or a notebook that sets a key no part of the trainer reads (a typo such as
    # `cfg.model.dmodel = ...`) fails at once instead of training with the default silently.
    # Existing keys stay writable; `set_key` and `.unlocked()` are the way to add one on purpose.
    cfg.lock()
    return cfg


# ----------------------------------------------------------------------------------------------
# Loading presets and applying overrides
