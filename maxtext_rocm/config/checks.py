"""The checks of keys taken together: every combination of keys the trainer relies on, and the
mesh shape it implies, one readable function per group, after each key's own check (its type,
allowed values and range, as declared: config/declared.py). Each failure is a `ConfigError`
with one sentence naming the key and what would be valid. Nothing here reads a file: what the
config names on disk (data, tokenizer, template, checkpoints, output_dir) is checked by
trainer/preflight.py. `maxtext_rocm.config` re-exports `validate`, `mesh_shape`, `axis_sizes` and
`global_batch_size`.
"""

from __future__ import annotations

import math
import re
from typing import Mapping

import ml_collections

from maxtext_rocm.config import declared
from maxtext_rocm.config.checks_options import check_rope_yarn, check_sinks
from maxtext_rocm.config.choices import (BUILT_IN_REWARDS, CHAT_TEMPLATES, MESH_AXES, MOE_FAMILIES,
                                         VIRTUAL_STAGE_SCHEDULES)
from maxtext_rocm.config.mesh_sizes import axis_sizes, mesh_shape  # noqa: F401  (part of this module's interface)
from maxtext_rocm.config.pipeline_counts import (  # noqa: F401  (read from here by parallel/ and the planner)
    AUTO_MICROBATCHES_PER_STAGE, chunks_per_device, interleaved, pipeline_microbatches)
from maxtext_rocm.errors import ConfigError


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: ml_collections.ConfigDict, device_count: int | None = None,
             process_count: int = 1) -> None:
    """Checks every key on its own, then every combination of keys.

    With `device_count`, also that the mesh's axes fill the devices. What needs the model's
    kernels or the sharding rules (head sizes a kernel serves, batches and parameters that must
    divide over the mesh), and what the config names on disk, is checked by trainer/preflight.py,
    above the models in the import order.
    """
    declared.check_values(cfg)
    _check_model(cfg.model, cfg.train.seq_len)
    _check_layer_kinds(cfg.model)
    check_sinks(cfg.model, cfg.mesh)
    _check_pipeline(cfg.pipeline)
    _validate_1f1b(cfg)  # first: what 1f1b refuses, it refuses on every jax
    _validate_gradient_reduce(cfg)
    _check_train(cfg)
    _check_grpo(cfg)
    _check_lora(cfg.lora, cfg.model, cfg.mesh)
    _check_data(cfg)
    _check_eval(cfg.eval)
    _check_log(cfg.log)
    _check_distributed(cfg.distributed)
    _check_mesh(cfg.mesh)
    if device_count is not None:
        mesh_shape(cfg.mesh, device_count, process_count)  # the axes fill the devices


ATTENTION_KINDS = ("full", "sliding")


def _check_layer_kinds(m) -> None:
    """model.attention_kinds against the window. Stacks whose layers differ run under every layout
    (each layer takes its index: models/layer_kinds.py)."""
    kinds = tuple(m.attention_kinds)
    _require(all(kind in ATTENTION_KINDS for kind in kinds),
             f"model.attention_kinds={','.join(map(str, kinds))} is not valid; list the kinds of the layers' "
             f"repeating unit from {', '.join(ATTENTION_KINDS)} (e.g. sliding,sliding,full)")
    _require("sliding" not in kinds or bool(m.sliding_window),
             f"model.attention_kinds={','.join(kinds)} has sliding layers but model.sliding_window is "
             f"{m.sliding_window}; set the window's size, or make every kind full")


def _check_model(m, seq_len: int) -> None:
    _require(m.n_heads % m.n_kv_heads == 0,
             f"model.n_heads={m.n_heads} must be a multiple of model.n_kv_heads={m.n_kv_heads} "
             "(grouped-query attention shares each kv head among n_heads/n_kv_heads query heads)")
    _require(m.head_dim % 2 == 0, f"model.head_dim={m.head_dim} must be even for rotary embeddings")
    if m.rope_scaling is not None:
        _validate_rope_scaling(m.rope_scaling)
    check_rope_yarn(m)
    _check_moe(m, seq_len)


def _check_moe(m, seq_len: int) -> None:
    """Mixture-of-experts keys against the family and each other."""
    if m.family not in MOE_FAMILIES:
        _require(m.n_experts == 1,
                 f"model.n_experts={m.n_experts} has no effect on model.family={m.family!r}; "
                 f"use a mixture-of-experts family ({', '.join(MOE_FAMILIES)}) for a mixture of experts")
        _require(m.moe_mlp_dim == 0,
                 f"model.moe_mlp_dim={m.moe_mlp_dim} has no effect on model.family={m.family!r}, which has no "
                 "experts; set it to 0 and give the feed-forward's size as model.mlp_dim")
        return
    _require(m.n_experts >= 2,
             f"model.n_experts={m.n_experts} is not valid for model.family={m.family!r}; a mixture needs at "
             "least 2 experts (use a dense family such as 'llama' for a dense model)")
    _require(1 <= m.experts_per_token <= m.n_experts,
             f"model.experts_per_token={m.experts_per_token} must lie between 1 and model.n_experts={m.n_experts}")
    # Under "capacity" each expert takes factor * seq_len * k / E tokens of a sequence; below one
    # slot the layer could not hold a single token (models/moe.py, expert_capacity).
    slots = m.moe_capacity_factor * seq_len * m.experts_per_token / m.n_experts
    _require(m.moe_impl != "capacity" or slots >= 1,
             f"model.moe_capacity_factor={m.moe_capacity_factor} gives each expert {slots:.3g} slots per "
             f"sequence of train.seq_len={seq_len} (factor * seq_len * experts_per_token / n_experts), less "
             f"than one token; use model.moe_capacity_factor >= "
             f"{m.n_experts / (seq_len * m.experts_per_token):.3g} or model.moe_impl='dropless'")


def _check_pipeline(pipe) -> None:
    _require(pipe.gradient_reduce == "per_iteration" or pipe.weight_gather == "once",
             "pipeline.gradient_reduce='once' needs the weights gathered once too; set pipeline.weight_gather='once'")
    _require(pipe.repeats == 1 or pipe.schedule in VIRTUAL_STAGE_SCHEDULES,
             f"pipeline.repeats={pipe.repeats} needs a schedule with virtual stages (circular or 1f1b), which "
             f"pipeline.schedule={pipe.schedule!r} is not; set pipeline.repeats=1 or pipeline.schedule='circular' "
             "or '1f1b'")


def _validate_gradient_reduce(cfg) -> None:
    """pipeline.gradient_reduce="once" runs the pipeline manual over the batch axes
    (parallel/pipeline/gather.per_batch_shard): what would need a global view of the batch there
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
    its last stage (parallel/pipeline/tail.py): 1f1b refuses them, gpipe and gpipe_recompute then
    run the head on every stage instead (parallel/pipeline/layout.loss_on_the_last_stage)."""
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
    (parallel/pipeline/one_f_one_b.py): what has no such loss, or reduces over the batch otherwise, is refused."""
    if cfg.pipeline.schedule != "1f1b":
        return
    for refused, what in loss_tail_refusals(cfg):
        _require(not refused, f"pipeline.schedule='1f1b' does not run with {what}; "
                              "use pipeline.schedule='gpipe' or 'gpipe_recompute'")


def installed_jax() -> tuple[int, ...]:
    """The installed jax's version as numbers, read without importing jax."""
    from importlib.metadata import version
    return tuple(int(part) for part in version("jax").split(".")[:3] if part.isdigit())


def _check_train(cfg) -> None:
    t = cfg.train
    _require(t.objective != "dpo" or t.z_loss_weight == 0,
             f"train.z_loss_weight={t.z_loss_weight} applies to the language-model loss only; set it to 0 "
             "with train.objective='dpo'")
    _require(t.compilation_cache.strip() != "",
             f"train.compilation_cache must be 'auto', 'off' or a directory, got {t.compilation_cache!r}")


def _check_grpo(cfg) -> None:
    """GRPO's keys against the data, the layout and the loop (its rewards are imported by preflight)."""
    t, data = cfg.train, cfg.data
    _require((t.objective == "grpo") == (data.format == "prompt"),
             "train.objective='grpo' samples completions of prompts and data.format='prompt' holds them; set both, "
             f"or neither (now train.objective={t.objective!r}, data.format={data.format!r})")
    if t.objective != "grpo":
        return
    check_reward_names(cfg.grpo)
    _require(cfg.grpo.max_new_tokens < t.seq_len,
             f"grpo.max_new_tokens={cfg.grpo.max_new_tokens} leaves no room for a prompt in train.seq_len={t.seq_len}; "
             "raise train.seq_len or lower grpo.max_new_tokens")
    _require(not t.eval_every, f"train.eval_every={t.eval_every} has no held-out loss to evaluate under "
             "train.objective='grpo' (its data are prompts); set it to 0 and evaluate with python -m maxtext_rocm.eval")
    _require(t.z_loss_weight == 0, f"train.z_loss_weight={t.z_loss_weight} applies to the language-model loss only; "
             "set it to 0 with train.objective='grpo'")
    _require(not data.epochs, f"data.epochs={data.epochs} does not apply to train.objective='grpo', whose prompts "
             "repeat pass after pass for train.steps steps; set it to 0 and choose train.steps")
    for axis in ("stage", "sequence"):
        sizes = [cfg.mesh[group][axis] for group in ("ici", "dcn")]
        _require(all(size == 1 for size in sizes),
                 f"train.objective='grpo' samples with a KV cache, which does not yet run with mesh {axis} > 1 "
                 f"(mesh.ici.{axis}={sizes[0]}, mesh.dcn.{axis}={sizes[1]}); set both to 1 and use fsdp or tensor")


def reward_weights(grpo_cfg) -> tuple[float, ...]:
    """grpo.reward_weights as numbers, one per reward (all 1 when empty), or a ConfigError."""
    names, given = tuple(grpo_cfg.rewards), tuple(grpo_cfg.reward_weights)
    if not given:
        return (1.0,) * len(names)
    try:
        weights = tuple(float(w) for w in given)
    except (TypeError, ValueError):
        weights = ()
    if len(weights) != len(names) or not all(math.isfinite(w) for w in weights):
        raise ConfigError(f"grpo.reward_weights={','.join(map(str, given))} must be {len(names)} finite numbers, one "
                          f"per reward of grpo.rewards={','.join(names)} (or empty: every weight 1)")
    return weights


def check_reward_names(grpo_cfg) -> None:
    """What the config alone can say of grpo.rewards (its imports are load_rewards')."""
    names = tuple(grpo_cfg.rewards)
    if not names:
        raise ConfigError("grpo.rewards is empty; name at least one reward: answer, format, length or "
                          "module:function")
    for name in names:
        if name not in BUILT_IN_REWARDS and not re.fullmatch(r"[\w.]+:\w+", name):
            raise ConfigError(f"grpo.rewards names {name!r}, which is neither a built-in reward "
                              f"({', '.join(BUILT_IN_REWARDS)}) nor module:function")
    reward_weights(grpo_cfg)
    try:
        re.compile(grpo_cfg.format_pattern)
    except re.error as error:
        raise ConfigError(f"grpo.format_pattern={grpo_cfg.format_pattern!r} is not a regular expression ({error}); "
                          "give one Python's re module compiles") from None


def grpo_batch_problem(global_batch: int, group_size: int) -> str | None:
    """Why a GRPO batch cannot hold whole groups of completions, or None."""
    if global_batch % group_size == 0:
        return None
    return (f"train.objective='grpo' samples grpo.group_size={group_size} completions of each prompt, but the global "
            f"batch is {global_batch} sequences; make it a multiple of {group_size} (train.per_device_batch_size x "
            "devices), or change grpo.group_size")


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


def _check_lora(lora, m, mesh) -> None:
    if lora.rank == 0:
        return
    experts = sorted(set(lora.targets) & {"gate", "up", "down"}) if m.family in MOE_FAMILIES else []
    _require(not experts,
             f"lora.targets names {', '.join(experts)}, which in a {m.family} model are the experts' weights, "
             "and LoRA adapts no experts (their grouped matmuls have no low-rank path); use q, k, v, o")
    sizes = lora_matrix_sizes(m)
    for target in lora.targets:
        _require(lora.rank <= min(sizes[target]),
                 f"lora.rank={lora.rank} is larger than the {target} matrix allows "
                 f"({sizes[target][0]} x {sizes[target][1]}); use lora.rank <= {min(sizes[target])}")
    stages = [mesh[group]["stage"] for group in ("ici", "dcn")]
    _require(all(s == 1 for s in stages),
             f"lora.rank={lora.rank} does not run under a pipeline (mesh.ici.stage={stages[0]}, "
             f"mesh.dcn.stage={stages[1]}); set both to 1 and use fsdp or tensor to spread the model")


def _check_data(cfg) -> None:
    """The data group against the objective and the model; its files are preflight's."""
    data, t = cfg.data, cfg.train
    _require(data.format == "text" or data.source == "files",
             f"data.format={data.format!r} reads your own JSON Lines records; set data.source='files' and "
             "data.paths, or use data.format='text'")
    _require(data.format != "preference" or t.objective == "dpo",
             "data.format='preference' lays out chosen/rejected pairs for train.objective='dpo'; set that, or "
             "train on responses alone with data.format='prompt_completion' or 'chat'")
    _require(t.objective != "dpo" or data.source != "files" or data.format == "preference",
             f"train.objective='dpo' trains on pairs, but data.format={data.format!r} gives none; set "
             "data.format='preference' (JSON Lines of prompt, chosen and rejected)")
    from maxtext_rocm.data.checks import DataError
    from maxtext_rocm.data.packing import packing_mode

    try:
        packing_mode(data.packing)
    except DataError as error:
        raise ConfigError(str(error)) from None
    _check_buckets(data, t.seq_len)
    if data.source == "files":
        _require(bool(data.paths), "data.source='files' needs data.paths: files or globs of .jsonl, "
                 ".parquet, .txt or .arrayrecord, comma-separated")
        _require(not t.eval_every or bool(data.eval_paths),
                 f"train.eval_every={t.eval_every} with data.source='files' needs data.eval_paths "
                 "(held-out files); or set train.eval_every=0")
    if data.source == "embedded":
        from maxtext_rocm.data.tokenizer import ByteTokenizer

        need = ByteTokenizer.vocab_size
        _require(cfg.model.vocab_size >= need,
                 f"model.vocab_size={cfg.model.vocab_size} is smaller than the byte tokenizer's {need} ids "
                 f"that data.source='embedded' needs; use model.vocab_size >= {need}")
        _require(data.tokenizer in ("", "byte"),
                 f"data.tokenizer={data.tokenizer!r} cannot apply to data.source='embedded', whose corpus is "
                 "byte-tokenized; use data.tokenizer='byte' with it")


def _check_buckets(data, seq_len: int) -> None:
    """data.buckets reads as lengths (data/buckets.py), and a list of them names rows that hold one example."""
    from maxtext_rocm.data import buckets

    try:
        lengths = buckets.parse(data.buckets, seq_len)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    explicit = lengths is not None and str(data.buckets).strip() != "auto"
    _require(not explicit or buckets.one_example_rows(data),
             f"data.buckets={data.buckets!r} pads rows that hold one example (data.format chat or prompt_completion "
             f"with data.packing='none', preference pairs, GRPO's prompts), and this run's rows hold packed documents "
             f"(data.source={data.source!r}, data.format={data.format!r}, data.packing={data.packing!r}); set "
             "data.packing='none', or data.buckets='auto'")


def built_in_template(name: str) -> bool:
    """data.chat_template names no file: the tokenizer's own ('') or a built-in one."""
    return name in ("", *CHAT_TEMPLATES)


def _check_eval(e) -> None:
    """The harness's keys together; its task names and include path are lm-eval's to check, at
    start-up (maxtext_rocm/eval/in_training.py), where lm-eval is installed."""
    tasks = tuple(t.strip() for t in e.harness_tasks)
    _require(all(tasks), f"eval.harness_tasks={','.join(e.harness_tasks)!r} holds an empty name; give task names "
             "separated by commas, such as hellaswag,arc_easy")
    _require(bool(tasks) == bool(e.harness_every),
             f"eval.harness_tasks={','.join(tasks)!r} with eval.harness_every={e.harness_every}: set both (tasks, "
             "and the steps between their evaluations, >= 1) or neither")
    _require(e.harness_limit < 1 or float(e.harness_limit).is_integer(),
             f"eval.harness_limit={e.harness_limit} must be a whole number of documents, a fraction below 1, or 0 "
             "for all")


def _check_log(log) -> None:
    profile = tuple(log.profile_steps)
    _require(len(profile) == 2 and all(isinstance(s, int) for s in profile)
             and (profile == (0, 0) or 0 <= profile[0] < profile[1]),
             f"log.profile_steps must be (start, end) with 0 <= start < end, or (0, 0) for off; got {profile}")


def _check_distributed(d) -> None:
    _require(d.process_id >= -1, f"distributed.process_id must be >= 0, or -1 to detect, got {d.process_id}")
    _require(d.num_processes == 0 or d.process_id < d.num_processes,
             f"distributed.process_id={d.process_id} must be below distributed.num_processes={d.num_processes}")


def _check_mesh(mesh) -> None:
    for group in ("ici", "dcn"):
        for axis in MESH_AXES:
            size = mesh[group][axis]
            _require(size == -1 or size >= 1,
                     f"mesh.{group}.{axis}={size} is not valid; use a positive size or -1 to fill")
        fills = [a for a in MESH_AXES if mesh[group][a] == -1]
        _require(len(fills) <= 1,
                 f"mesh.{group} has -1 on {', '.join(fills)}; at most one axis per group may fill")


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
