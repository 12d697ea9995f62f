"""Validation of a run's config: every key and every combination the trainer relies on, and the
mesh shape it implies. Each failure is a `ConfigError` with one sentence naming the key and what
would be valid. `maxtext_rocm.config` re-exports `validate`, `mesh_shape`, `axis_sizes` and
`global_batch_size`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import ml_collections

from maxtext_rocm.config.choices import (
    ATTENTION_IMPLEMENTATIONS, CHAT_TEMPLATES, CONTEXT_PARALLEL_MODES, DATA_FORMATS, DATA_SOURCES, FP8_FORMATS,
    FP8_SCALINGS, LORA_TARGETS, MESH_AXES, MODEL_FAMILIES, MOE_IMPLEMENTATIONS, NONFINITE_ACTIONS, NUMBER_RANGES,
    OBJECTIVES, PIPELINE_SCHEDULES, PIPELINE_WEIGHT_GATHERS, PRECISION_POLICIES, PROJECTION_FUSIONS, REMAT_POLICIES,
    SCHEDULES, VIRTUAL_STAGE_SCHEDULES)
from maxtext_rocm.errors import ConfigError
from maxtext_rocm.config.mesh_sizes import axis_sizes, mesh_shape  # noqa: F401  (part of this module's interface)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _one_of(key: str, value: Any, valid: Iterable[Any]) -> None:
    valid = tuple(valid)
    _require(value in valid, f"{key}={value!r} is not valid; choose one of {', '.join(map(repr, valid))}")


def _positive(cfg, *keys: str) -> None:
    for key in keys:
        group, name = key.split(".")
        _require(cfg[group][name] > 0, f"{key} must be positive, got {cfg[group][name]!r}")


def range_text(bounds) -> str:
    """`(0, True, 1, False)` as '>= 0 and < 1'."""
    low, low_in, high, high_in = bounds
    parts = ([f"{'>=' if low_in else '>'} {low}"] if low is not None else []) + \
        ([f"{'<=' if high_in else '<'} {high if high < 2**32 else '2**' + str(high.bit_length() - 1)}"]
         if high is not None else [])
    return " and ".join(parts)


def _leaves(node, prefix=""):
    """(dotted key, value) for every leaf of a config, nested dicts (model.rope_scaling) included."""
    for key, value in node.items():
        if isinstance(value, (Mapping, ml_collections.ConfigDict)):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _validate_numbers(cfg) -> None:
    """The general rules for numbers, before any key-specific check (which could compare inf or
    NaN without complaint, or fail on them with a traceback): every float is finite, and every key
    in NUMBER_RANGES lies in its range."""
    for key, value in _leaves(cfg):
        bounds = NUMBER_RANGES.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if bounds is not None:
                raise ConfigError(f"{key}={value!r} is a {type(value).__name__}; it takes a number "
                                  f"{range_text(bounds)}")
            continue
        low, low_in, high, high_in = bounds or (None, True, None, True)
        ok = (math.isfinite(value)
              and (low is None or value > low or (low_in and value == low))
              and (high is None or value < high or (high_in and value == high)))
        wanted = " ".join(filter(None, ["a finite number" if isinstance(value, float) else "an integer",
                                        range_text(bounds) if bounds else ""]))
        _require(ok, f"{key}={value!r} is not valid; use {wanted}")


def validate(cfg: ml_collections.ConfigDict, device_count: int | None = None,
             process_count: int = 1) -> None:
    """Checks every key and every combination of keys, and the data files the config names.

    With `device_count`, also that the mesh's axes fill the devices. What needs the model's
    kernels or the sharding rules (head sizes a kernel serves, batches and parameters that must
    divide over the mesh) is checked by trainer/preflight.py, above the models in the import order.
    """
    _validate_numbers(cfg)
    m = cfg.model
    _one_of("model.family", m.family, MODEL_FAMILIES)
    _positive(cfg, "model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads",
              "model.n_kv_heads", "model.head_dim", "model.mlp_dim")
    _require(m.n_heads % m.n_kv_heads == 0,
             f"model.n_heads={m.n_heads} must be a multiple of model.n_kv_heads={m.n_kv_heads} "
             "(grouped-query attention shares each kv head among n_heads/n_kv_heads query heads)")
    _require(m.head_dim % 2 == 0, f"model.head_dim={m.head_dim} must be even for rotary embeddings")
    _one_of("model.remat", m.remat, REMAT_POLICIES)
    _one_of("model.attention", m.attention, ATTENTION_IMPLEMENTATIONS)
    _one_of("model.fuse_projections", m.fuse_projections, PROJECTION_FUSIONS)
    _one_of("model.context_parallel", m.context_parallel, CONTEXT_PARALLEL_MODES)
    _require(isinstance(m.context_load_balance, bool),
             f"model.context_load_balance takes true or false, not {m.context_load_balance!r}")
    _require(m.loss_chunk_len >= 0, f"model.loss_chunk_len must be >= 0 (0: unchunked), got {m.loss_chunk_len}")
    if m.rope_scaling is not None:
        _validate_rope_scaling(m.rope_scaling)
    _validate_moe(m, cfg.train.seq_len)

    _validate_pipeline(cfg.pipeline)
    _validate_1f1b(cfg)  # first: what 1f1b refuses, it refuses on every jax
    _validate_gradient_reduce(cfg)

    p = cfg.precision
    _one_of("precision.policy", p.policy, PRECISION_POLICIES)
    _one_of("precision.fp8_format", p.fp8_format, FP8_FORMATS)
    _one_of("precision.fp8_scaling", p.fp8_scaling, FP8_SCALINGS)
    _positive(cfg, "precision.amax_history_len")

    o = cfg.optimizer
    _one_of("optimizer.schedule", o.schedule, SCHEDULES)
    _require(o.warmup_steps >= 0, f"optimizer.warmup_steps must be >= 0, got {o.warmup_steps!r}")

    t = cfg.train
    _positive(cfg, "train.steps", "train.seq_len", "train.grad_accum")
    _one_of("train.on_nonfinite", t.on_nonfinite, NONFINITE_ACTIONS)
    _one_of("train.objective", t.objective, OBJECTIVES)
    if t.objective == "dpo":
        _validate_dpo(cfg)
    _require(t.max_skipped_steps >= 1,
             f"train.max_skipped_steps must be >= 1 (bad steps in a row before the run stops), got {t.max_skipped_steps}")
    _require(isinstance(t.compilation_cache, str) and t.compilation_cache.strip() != "",
             f"train.compilation_cache must be 'auto', 'off' or a directory, got {t.compilation_cache!r}")

    c = cfg.checkpoint
    _require(c.every >= 0, f"checkpoint.every must be >= 0, got {c.every}")
    _require(c.keep >= 1, f"checkpoint.keep must be >= 1, got {c.keep}")
    _require(c.keep_period >= 0, f"checkpoint.keep_period must be >= 0, got {c.keep_period}")
    _require(c.resume in ("auto", "never") or c.resume.isdigit() or Path(c.resume).is_dir(),
             f"checkpoint.resume={c.resume!r} is not valid; use 'auto', 'never', a step number "
             "or the path of an existing checkpoint directory")
    _require(not c.load_params_from or Path(c.load_params_from).is_dir(),
             f"checkpoint.load_params_from={c.load_params_from!r} is not a directory")

    _validate_lora(cfg.lora, m, cfg.mesh)

    _one_of("data.source", cfg.data.source, DATA_SOURCES)
    _one_of("data.format", cfg.data.format, DATA_FORMATS)
    _require(cfg.data.format == "text" or cfg.data.source == "files",
             f"data.format={cfg.data.format!r} reads your own JSON Lines records; set data.source='files' and "
             "data.paths, or use data.format='text'")
    _require(cfg.data.format != "preference" or cfg.train.objective == "dpo",
             "data.format='preference' lays out chosen/rejected pairs for train.objective='dpo'; set that, or "
             "train on responses alone with data.format='prompt_completion' or 'chat'")
    _require(cfg.train.objective != "dpo" or cfg.data.source != "files" or cfg.data.format == "preference",
             f"train.objective='dpo' trains on pairs, but data.format={cfg.data.format!r} gives none; set "
             "data.format='preference' (JSON Lines of prompt, chosen and rejected)")
    template = cfg.data.chat_template
    _require(isinstance(template, str) and (template in ("", *CHAT_TEMPLATES) or Path(template).expanduser().is_file()),
             f"data.chat_template={template!r} is neither a file nor a built-in template; use a Jinja file, "
             f"{', '.join(map(repr, CHAT_TEMPLATES))}, or '' for the tokenizer's own")
    _require(isinstance(cfg.data.epochs, int) and cfg.data.epochs >= 0,
             f"data.epochs={cfg.data.epochs!r} is not valid; use a number of passes >= 1, or 0 for no limit")
    _require(cfg.data.prefetch >= 1, f"data.prefetch must be >= 1 (batches built ahead), got {cfg.data.prefetch}")
    from maxtext_rocm.data.checks import DataError
    from maxtext_rocm.data.packing import packing_mode

    try:
        packing_mode(cfg.data.packing)
    except DataError as error:
        raise ConfigError(str(error)) from None
    _require(cfg.data.packing_window >= 1,
             f"data.packing_window must be >= 1 (documents best-fit together), got {cfg.data.packing_window}")
    _require(isinstance(cfg.data.workers, int) and not isinstance(cfg.data.workers, bool) and cfg.data.workers >= 0,
             f"data.workers={cfg.data.workers!r} is not valid; use a number of tokenizing processes >= 2, or 0 "
             "for the background thread alone")
    _require(t.eval_every >= 0, f"train.eval_every must be >= 0 (0: no evaluation), got {t.eval_every}")
    _require(t.eval_steps >= 1, f"train.eval_steps must be >= 1, got {t.eval_steps}")
    if cfg.data.source == "files":
        _require(bool(cfg.data.paths), "data.source='files' needs data.paths: files or globs of .jsonl, "
                 ".parquet, .txt or .arrayrecord, comma-separated")
        _require(not t.eval_every or bool(cfg.data.eval_paths),
                 f"train.eval_every={t.eval_every} with data.source='files' needs data.eval_paths "
                 "(held-out files); or set train.eval_every=0")
        from maxtext_rocm.data.files import check_inputs

        check_inputs(cfg.data, m.vocab_size, t.seq_len)  # files exist, are not empty, have the text field
    if cfg.data.source == "embedded":
        from maxtext_rocm.data.tokenizer import ByteTokenizer

        need = ByteTokenizer.vocab_size
        _require(m.vocab_size >= need,
                 f"model.vocab_size={m.vocab_size} is smaller than the byte tokenizer's {need} ids "
                 f"that data.source='embedded' needs; use model.vocab_size >= {need}")
    tokenizer = cfg.data.get("tokenizer", "byte")
    if tokenizer not in ("", "byte"):
        from maxtext_rocm.data.tokenizer import check_vocab, load_tokenizer

        _require(cfg.data.source != "embedded",
                 f"data.tokenizer={tokenizer!r} cannot apply to data.source='embedded', whose corpus is "
                 "byte-tokenized; use data.tokenizer='byte' with it")
        check_vocab(load_tokenizer(tokenizer), m.vocab_size, tokenizer)


    _positive(cfg, "log.every")
    profile = tuple(cfg.log.profile_steps)
    _require(len(profile) == 2 and all(isinstance(s, int) for s in profile)
             and (profile == (0, 0) or 0 <= profile[0] < profile[1]),
             f"log.profile_steps must be (start, end) with 0 <= start < end, or (0, 0) for off; got {profile}")

    if cfg.output_dir:
        _validate_output_dir(cfg.output_dir)

    d = cfg.distributed
    _require(d.num_processes >= 0, f"distributed.num_processes must be >= 0 (0: detect), got {d.num_processes}")
    _require(d.process_id >= -1, f"distributed.process_id must be >= 0, or -1 to detect, got {d.process_id}")
    _require(d.num_processes == 0 or d.process_id < d.num_processes,
             f"distributed.process_id={d.process_id} must be below distributed.num_processes={d.num_processes}")
    _positive(cfg, "distributed.init_timeout_s", "distributed.heartbeat_timeout_s")

    for group in ("ici", "dcn"):
        for axis in MESH_AXES:
            size = cfg.mesh[group][axis]
            _require(size == -1 or size >= 1,
                     f"mesh.{group}.{axis}={size} is not valid; use a positive size or -1 to fill")
        fills = [a for a in MESH_AXES if cfg.mesh[group][a] == -1]
        _require(len(fills) <= 1,
                 f"mesh.{group} has -1 on {', '.join(fills)}; at most one axis per group may fill")

    if device_count is not None:
        mesh_shape(cfg.mesh, device_count, process_count)  # the axes fill the devices


def _validate_dpo(cfg) -> None:
    """train.objective="dpo" beside the key it cannot honour (the batch's pairs are checked
    against the mesh by trainer/preflight.py)."""
    _require(cfg.train.z_loss_weight == 0,
             f"train.z_loss_weight={cfg.train.z_loss_weight} applies to the language-model loss only; set it to 0 "
             "with train.objective='dpo'")


def dpo_batch_problem(global_batch: int, grad_accum: int, process_groups: int) -> str | None:
    """Why a DPO batch cannot hold whole preference pairs (rows 2i, 2i+1) in every micro-batch and
    on every data-loading process, or None."""
    if global_batch % (2 * grad_accum * process_groups) == 0:
        return None
    return (f"train.objective='dpo' needs whole preference pairs in every train.grad_accum={grad_accum} micro-batch "
            f"and on each of the {process_groups} data-loading processes, but the global batch is {global_batch} "
            f"sequences; make it a multiple of {2 * grad_accum * process_groups} (train.per_device_batch_size x "
            "devices)")


def lora_matrix_sizes(m) -> dict[str, tuple[int, int]]:
    """(inputs, outputs) of each matrix LoRA can adapt in model group `m`."""
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    return {"q": (m.d_model, q), "k": (m.d_model, kv), "v": (m.d_model, kv), "o": (q, m.d_model),
            "gate": (m.d_model, m.mlp_dim), "up": (m.d_model, m.mlp_dim), "down": (m.mlp_dim, m.d_model)}


def _validate_lora(lora, m, mesh) -> None:
    _require(isinstance(lora.rank, int) and lora.rank >= 0,
             f"lora.rank={lora.rank!r} is not valid; use the adapters' rank >= 1, or 0 for no LoRA")
    targets = lora.targets
    _require(not isinstance(targets, str) and len(targets) > 0 and all(t in LORA_TARGETS for t in targets)
             and len(set(targets)) == len(targets),
             f"lora.targets={targets!r} is not valid; use distinct names from {', '.join(LORA_TARGETS)}")
    _require(isinstance(lora.allow_base_change, bool),
             f"lora.allow_base_change={lora.allow_base_change!r} is not valid; use True or False")
    if lora.rank == 0:
        return
    experts = sorted(set(targets) & {"gate", "up", "down"}) if m.family == "mixtral" else []
    _require(not experts,
             f"lora.targets names {', '.join(experts)}, which in a mixtral model are the experts' weights, "
             "and LoRA adapts no experts (their grouped matmuls have no low-rank path); use q, k, v, o")
    sizes = lora_matrix_sizes(m)
    for target in targets:
        _require(lora.rank <= min(sizes[target]),
                 f"lora.rank={lora.rank} is larger than the {target} matrix allows "
                 f"({sizes[target][0]} x {sizes[target][1]}); use lora.rank <= {min(sizes[target])}")
    stages = [mesh[group]["stage"] for group in ("ici", "dcn")]
    _require(all(s == 1 for s in stages),
             f"lora.rank={lora.rank} does not run under a pipeline (mesh.ici.stage={stages[0]}, "
             f"mesh.dcn.stage={stages[1]}); set both to 1 and use fsdp or tensor to spread the model")


def _validate_moe(m, seq_len: int) -> None:
    """Mixture-of-experts keys (and the sliding window, which any family may use)."""
    window = m.sliding_window
    _require(window is None or (isinstance(window, int) and window >= 0),
             f"model.sliding_window={window!r} is not valid; use a number of tokens, or 0 or None for off")
    if m.family != "mixtral":
        _require(m.n_experts == 1,
                 f"model.n_experts={m.n_experts} has no effect on model.family={m.family!r}; "
                 "use model.family='mixtral' for a mixture of experts")
        return
    _require(m.n_experts >= 2,
             f"model.n_experts={m.n_experts} is not valid for model.family='mixtral'; a mixture needs at "
             "least 2 experts (use model.family='llama' for a dense model)")
    _require(1 <= m.experts_per_token <= m.n_experts,
             f"model.experts_per_token={m.experts_per_token} must lie between 1 and model.n_experts={m.n_experts}")
    _one_of("model.moe_impl", m.moe_impl, MOE_IMPLEMENTATIONS)
    # Under "capacity" each expert takes factor * seq_len * k / E tokens of a sequence; below one
    # slot the layer could not hold a single token (models/moe.py, expert_capacity).
    slots = m.moe_capacity_factor * seq_len * m.experts_per_token / m.n_experts
    _require(m.moe_impl != "capacity" or slots >= 1,
             f"model.moe_capacity_factor={m.moe_capacity_factor} gives each expert {slots:.3g} slots per "
             f"sequence of train.seq_len={seq_len} (factor * seq_len * experts_per_token / n_experts), less "
             f"than one token; use model.moe_capacity_factor >= "
             f"{m.n_experts / (seq_len * m.experts_per_token):.3g} or model.moe_impl='dropless'")


def _validate_pipeline(pipe) -> None:
    _one_of("pipeline.schedule", pipe.schedule, PIPELINE_SCHEDULES)
    _one_of("pipeline.weight_gather", pipe.weight_gather, PIPELINE_WEIGHT_GATHERS)
    _one_of("pipeline.gradient_reduce", pipe.gradient_reduce, PIPELINE_WEIGHT_GATHERS)
    _require(pipe.gradient_reduce == "per_iteration" or pipe.weight_gather == "once",
             "pipeline.gradient_reduce='once' needs the weights gathered once too; set pipeline.weight_gather='once'")
    _require(isinstance(pipe.microbatches, int) and pipe.microbatches >= 0,
             f"pipeline.microbatches={pipe.microbatches!r} is not valid; use a count >= 1, or 0 to choose "
             "(up to 4 per stage, as the batch allows)")
    _require(isinstance(pipe.repeats, int) and pipe.repeats >= 1,
             f"pipeline.repeats={pipe.repeats!r} is not valid; use a count >= 1 of virtual stages per device")
    _require(pipe.repeats == 1 or pipe.schedule in VIRTUAL_STAGE_SCHEDULES,
             f"pipeline.repeats={pipe.repeats} needs a schedule with virtual stages (circular or 1f1b), which "
             f"pipeline.schedule={pipe.schedule!r} is not; set pipeline.repeats=1 or pipeline.schedule='circular' "
             "or '1f1b'")


def _validate_gradient_reduce(cfg) -> None:
    """pipeline.gradient_reduce="once" runs the pipeline manual over the batch axes
    (parallel/pipeline_gather.per_batch_shard): what would need a global view of the batch there
    is refused."""
    if cfg.pipeline.gradient_reduce != "once":
        return
    m, mesh = cfg.model, cfg.mesh
    sequence = [mesh[group]["sequence"] for group in ("ici", "dcn")]
    refusals = [
        (m.n_experts > 1,
         f"model.n_experts={m.n_experts} (the router's statistics and the expert exchange span the batch)"),
        (cfg.precision.policy == "fp8", "precision.policy='fp8' (its scales come from amaxes over the whole batch)"),
        (any(s != 1 for s in sequence), f"mesh.ici.sequence={sequence[0]}, mesh.dcn.sequence={sequence[1]} "
                                        "(context parallelism's own exchange)"),
        # Its shard_map over the batch axes holds the stages' own shard_maps over `stage`; jax 0.12's
        # lowering names the nested manual axes out of mesh order and XLA aborts the compile
        # ("Manual axes must be sorted by mesh axis index", jax 0.12.0.1). jax 0.10 runs it.
        (installed_jax() >= (0, 11), f"jax {'.'.join(map(str, installed_jax()))} (XLA aborts compiling its "
                                     "nested shard_maps there; it runs on jax 0.10)"),
    ]
    for refused, what in refusals:
        _require(not refused, f"pipeline.gradient_reduce='once' does not run with {what}; "
                              "set pipeline.gradient_reduce='per_iteration'")


def loss_tail_refusals(cfg) -> list[tuple[bool, str]]:
    """(applies, what) for each setting under which a pipeline cannot run the fused head loss on
    its last stage (parallel/pipeline_tail.py): 1f1b refuses them, gpipe and gpipe_recompute then
    run the head on every stage instead (parallel/pipeline_layout.loss_on_the_last_stage)."""
    m = cfg.model
    return [
        (m.loss_chunk_len <= 0, f"model.loss_chunk_len={m.loss_chunk_len} (it runs the fused, chunked head loss; "
                                "use a chunk length > 0)"),
        (not m.tie_embeddings and cfg.precision.fp8_lm_head,
         "precision.fp8_lm_head=True (an fp8 head keeps the model's own head, not the fused loss)"),
        (cfg.train.get("objective", "lm") != "lm",
         f"train.objective={cfg.train.objective!r} (a per-pair objective needs every row's value first)"),
        (cfg.pipeline.gradient_reduce != "per_iteration", "pipeline.gradient_reduce='once'"),
    ]


def _validate_1f1b(cfg) -> None:
    """pipeline.schedule="1f1b" runs the fused head loss inside the pipeline, per microbatch
    (parallel/pipeline_1f1b.py): what has no such loss, or reduces over the batch otherwise, is refused."""
    if cfg.pipeline.schedule != "1f1b":
        return
    for refused, what in loss_tail_refusals(cfg):
        _require(not refused, f"pipeline.schedule='1f1b' does not run with {what}; "
                              "use pipeline.schedule='gpipe' or 'gpipe_recompute'")


def installed_jax() -> tuple[int, ...]:
    """The installed jax's version as numbers, read without importing jax."""
    from importlib.metadata import version
    return tuple(int(part) for part in version("jax").split(".")[:3] if part.isdigit())


# At most this many microbatches per stage under auto: GPipe's bubble (S-1)/(M+S-1) is ~47% at
# M = S (8 stages) and ~18% at M = 4S; past that each microbatch's matmuls shrink for little gain.
AUTO_MICROBATCHES_PER_STAGE = 4


def pipeline_microbatches(pipe, stages: int, sequences_per_shard: int) -> int:
    """pipeline.microbatches resolved. 0 (auto): the most, up to 4 per stage, that split each batch
    shard's `sequences_per_shard` (per train.grad_accum micro-batch) evenly; fewer than the stages
    only where the batch allows no more."""
    if pipe.microbatches:
        return pipe.microbatches
    counts = [m for m in range(1, AUTO_MICROBATCHES_PER_STAGE * stages + 1) if sequences_per_shard % m == 0]
    if interleaved(pipe):  # in groups of the stages (parallel/pipeline_1f1b_order.py), where the batch allows
        counts = [m for m in counts if m % stages == 0] or counts
    return max(counts)


def chunks_per_device(pipe) -> int:
    """R: the chunks of layers each stage device runs, pipeline.repeats under the schedules with
    virtual stages (circular, 1f1b), 1 otherwise."""
    return pipe.repeats if pipe.schedule in VIRTUAL_STAGE_SCHEDULES else 1


def interleaved(pipe) -> bool:
    """Interleaved 1F1B: pipeline.schedule="1f1b" with pipeline.repeats > 1, which runs
    microbatches in groups of the stages."""
    return pipe.schedule == "1f1b" and pipe.repeats > 1


def _validate_rope_scaling(scaling) -> None:
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position")
    if not isinstance(scaling, Mapping) and not isinstance(scaling, ml_collections.ConfigDict):
        raise ConfigError(f"model.rope_scaling must be None or a dict with keys {', '.join(keys)}")
    missing = [k for k in keys if k not in scaling]
    extra = [k for k in scaling.keys() if k not in keys]
    _require(not missing and not extra,
             f"model.rope_scaling needs exactly the keys {', '.join(keys)}"
             + (f"; missing {', '.join(missing)}" if missing else "")
             + (f"; unknown {', '.join(extra)}" if extra else ""))
    for key in keys:  # numbers, before any comparison (a string here would be a TypeError below)
        value = scaling[key]
        wanted = int if key == "original_max_position" else (int, float)
        _require(isinstance(value, wanted) and not isinstance(value, bool),
                 f"model.rope_scaling.{key}={value!r} is a {type(value).__name__}; it takes "
                 + ("an integer (a number of positions)" if wanted is int else "a number"))
    _require(scaling["factor"] >= 1, f"model.rope_scaling.factor must be >= 1, got {scaling['factor']}")
    _require(0 < scaling["low_freq_factor"] < scaling["high_freq_factor"],
             "model.rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
             f"{scaling['low_freq_factor']} and {scaling['high_freq_factor']}")
    _require(scaling["original_max_position"] > 0, "model.rope_scaling.original_max_position must be positive")


def _validate_output_dir(output_dir: str) -> None:
    """output_dir is, or can become, a writable directory: checked here, so the first thing that
    writes into it (the compilation cache, a checkpoint) is not the one to fail, misleadingly."""
    path = Path(output_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output_dir={output_dir!r} is a file, not a directory; set output_dir to a "
                          "writable directory (a new or existing folder)")
    existing = next((p for p in (path, *path.absolute().parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"output_dir={output_dir!r} lies under {str(existing)!r}, which is a file; "
                          "set output_dir to a writable directory")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir={output_dir!r} cannot be written ({str(existing)!r} is not writable); "
                          "set output_dir to a writable directory")


def global_batch_size(cfg, device_count: int) -> int:
    """Sequences per step: train.per_device_batch_size x devices, a whole number. The per-device
    size may be fractional (MaxText's convention): 0.125 on 8 devices is one sequence, which
    mesh `sequence` splits (a global batch smaller than the device count)."""
    t = cfg.train
    batch = t.per_device_batch_size * device_count
    _require(abs(batch - round(batch)) < 1e-9 and round(batch) >= 1,
             f"train.per_device_batch_size={t.per_device_batch_size} x {device_count} devices is {batch:g} "
             f"sequences, not a whole number; use a multiple of 1/{device_count} (e.g. "
             f"{max(1, round(batch)) / device_count:g})")
    return int(round(batch))
