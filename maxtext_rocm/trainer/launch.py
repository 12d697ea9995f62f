"""How a run starts: the sharded state, the jitted train step and its compilation, made in an order
that overlaps them (the Trainer's launch choreography; maxtext_rocm/planner/report.py lowers the same step).

The state is made (or restored) in a thread while the main thread traces and lowers the step: XLA
compiles and runs the init program without holding the GIL, and tracing is Python. The init
program is lowered on the main thread first, since lowering is Python too: lowered in the thread,
it and the step's tracing took turns on the GIL and its compilation started late (reference
comparison's MoE model: 0.9 s to lower instead of 0.2). Lowered first, the step's compilation
started 1.6 s after the Trainer did instead of 2.2 for the dense model, 2.0 instead of 2.2 for the
MoE one (2 cores, medians of 3-4 runs).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import NamedTuple

import jax
import jax.extend.core as jax_core
import ml_collections
import numpy as np
from flax import linen as nn

from maxtext_rocm.data.buckets import row_buckets
from maxtext_rocm.finetune import lora, lora_base
from maxtext_rocm.trainer import compilation, optimizer as optim
from maxtext_rocm.parallel import sharding
from maxtext_rocm.config import ConfigError
from maxtext_rocm.trainer.step import create_state, frozen_base, train_step


def run_policy(cfg, device, platform: str | None = None):
    """The precision policy of resolved `cfg` (maxtext_rocm/resolve.py) on `device`, with cfg.lora's
    adapters in its dot (finetune/lora.py) when lora.rank > 0. `platform`: the platform the
    program is for when it is not the device's (the planner's GPU targets, compiled on a CPU)."""
    from maxtext_rocm.numerics.precision import policy_from_config

    return lora.policy_with_lora(policy_from_config(cfg.precision, device, platform=platform), cfg.lora)


def model_for_mesh(cfg, policy, mesh, platform: str | None = None, model_cfg=None):
    """The model, with the mesh-aware algorithms of parallel/ plugged in where the mesh asks for
    them (the expert exchange, the pipeline's layer stack, context-parallel attention): models/
    never sees the mesh itself. `model_cfg`: the model group to build from, when it differs from
    `cfg.model` (the planner's CPU stand-ins for GPU kernels); the strategies read `cfg.model`."""
    from maxtext_rocm.models import build_model
    from maxtext_rocm.parallel import context, experts, pipeline

    return build_model(model_cfg or cfg.model, policy,
                       expert_exchange=experts.expert_exchange(cfg.model, mesh, platform),
                       layer_stack=pipeline.layer_stack(cfg, mesh),
                       context_attention=context.context_attention(cfg.model, mesh))


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """The train state's layout without allocating it, which the Trainer, the AOT fit check and
    the numerical tests share. Under a pipeline that stores the layer stack in its own order
    (parallel/pipeline/layout.py) `init`, `abstract` and `sharding` are the storage order's: what
    the train step sees."""

    init: Callable  # key -> the state, boxed with its logical axes (nn.meta.unbox to use it)
    key: jax.Array  # train.seed's key, which `init` takes
    abstract: object  # the state as ShapeDtypeStructs carrying their shardings
    sharding: object  # the state's NamedShardings
    # The StateConverter between storage and model order, or None where they are the same (no
    # conversion is ever made).
    storage_order: object = None


def stored_state(cfg, model, mesh) -> StateLayout:
    """The state's layout as the train step stores it (see StateLayout)."""
    from maxtext_rocm.parallel.pipeline import layout as storage_layout

    # The optimizer state's layout depends on whether it clips, not on the numbers (trainer/optimizer.py).
    tx = optim.build_optimizer(optim.hyperparameters(cfg.optimizer, cfg.train.steps), optim.clips(cfg.optimizer))
    create = functools.partial(create_state, model=model, tx=tx, batch_shape=(1, min(cfg.train.seq_len, 8)),
                               reference=needs_reference_copy(cfg))
    key = jax.random.key(cfg.train.seed)
    # Flax traces the model's init once, here; `init` replays the recorded program (re-tracing the
    # model cost 0.3-0.5 s of launch at the reference comparison's size).
    jaxpr, boxed = jax.make_jaxpr(create, return_shape=True)(key)
    out_tree = jax.tree_util.tree_structure(boxed)

    def init(k):
        return jax.tree_util.tree_unflatten(out_tree, jax_core.jaxpr_as_fun(jaxpr)(k))

    # Stage-sharded layer leaves keep their spec in storage order: S R K slots divide over stage.
    state_sharding = sharding.logical_to_sharding(nn.get_partition_spec(boxed), mesh)
    storage_order = storage_layout.converter(storage_layout.stack_layout(cfg.pipeline, cfg.model, mesh),
                                             storage_layout.ends_on_their_stages(cfg, mesh), boxed, state_sharding,
                                             mesh)
    shapes = nn.meta.unbox(boxed)
    if storage_order is not None:
        canonical_init, shapes = init, storage_order.storage_shapes(shapes)
        state_sharding = storage_order.storage_sharding

        def init(k):  # noqa: F811 - the stored state is made in one program, never in model order first
            return storage_order.stored(nn.meta.unbox(canonical_init(k)))

    abstract = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      shapes, state_sharding)
    return StateLayout(init, key, abstract, state_sharding, storage_order)


def needs_reference_copy(cfg) -> bool:
    """Whether the state holds a frozen copy of the starting parameters: DPO's reference, and
    GRPO's where its KL term is on (grpo.beta > 0); a LoRA run's frozen base serves as one."""
    wanted = cfg.train.objective == "dpo" or (cfg.train.objective == "grpo" and cfg.grpo.beta > 0)
    return wanted and cfg.lora.rank == 0


def jit_train_step(cfg, model, mesh, state_sharding, batch_sharding):
    """The jitted train step, state donated. Called as step(state, batch, hyperparameters): see
    `optimizer_hyperparameters`. A GRPO run's is trainer/grpo_step.py's, around the same step."""
    frozen = ml_collections.FrozenConfigDict
    if cfg.train.objective == "grpo":
        from maxtext_rocm.trainer.grpo_step import grpo_train_step

        step = functools.partial(grpo_train_step, model=model, clip=optim.clips(cfg.optimizer),
                                 train_cfg=frozen(cfg.train), grpo_cfg=frozen(cfg.grpo))
    else:
        step = functools.partial(train_step, model=model, clip=optim.clips(cfg.optimizer),
                                 train_cfg=frozen(cfg.train), dpo_cfg=frozen(cfg.dpo))
    return jax.jit(
        step,
        in_shardings=(state_sharding, batch_sharding, sharding.replicated(mesh)),
        out_shardings=(state_sharding, sharding.replicated(mesh)),
        donate_argnums=0,
        compiler_options=compilation.step_compiler_options(cfg.precision.policy, mesh.devices.flat[0].platform))


def optimizer_hyperparameters(cfg, mesh, abstract: bool = False) -> dict:
    """The train step's third argument, optim.hyperparameters of the run: fp32 scalars replicated
    over the mesh, made once (every process holds the same values); `abstract`: their shapes only."""
    replicated = sharding.replicated(mesh)
    values = optim.hyperparameters(cfg.optimizer, cfg.train.steps, updates_per_step(cfg))
    if abstract:
        return {name: jax.ShapeDtypeStruct((), np.float32, sharding=replicated) for name in values}
    return {name: jax.make_array_from_callback((), replicated, lambda _, v=value: v)
            for name, value in values.items()}


def updates_per_step(cfg) -> int:
    """Optimizer updates per train step: GRPO's grpo.updates_per_batch, else one."""
    return cfg.grpo.updates_per_batch if cfg.train.objective == "grpo" else 1


@dataclasses.dataclass
class Launched:
    """What `launch` made: the state at `step_count` (with the data position saved beside it, when
    resumed), and the train step, compiled or (on accelerators) still compiling in a thread."""

    state: object
    step_count: int
    data_state: dict | None
    compiled_step: jax.stages.Compiled | Future
    state_sharding: object
    # Storage <-> model order of a pipeline's layer stack (parallel/pipeline/layout.py), or None.
    storage_order: object = None
    # The jitted step that `compiled_step` is compiled from: another row length lowers it again.
    jitted_step: object = None


def launch(cfg, model, mesh, batch_sharding, batch_dtypes, checkpointer, sharding_rules, log) -> Launched:
    """Makes or restores the state and compiles the train step, overlapped (see the module's
    docstring). `sharding_rules()`: the mesh and logical-rule context that tracing reads."""
    layout = stored_state(cfg, model, mesh)
    step = jit_train_step(cfg, model, mesh, layout.sharding, batch_sharding)
    # A local tier's resume (checkpoint.local_dir) reads its state here, into the model order's layout.
    resume = checkpointer.find_resume(resumable_abstract(cfg, layout)) if checkpointer else None
    if checkpointer and checkpointer.tier_line:
        log(checkpointer.tier_line)
    if resume and resume.newest > cfg.train.steps:  # the newest the resume may read
        newest = resume.newest
        raise ConfigError(
            f"train.steps={cfg.train.steps} is below step {newest} of the checkpoint this run resumes "
            f"from in {cfg.output_dir}; raise train.steps above {newest} to train on, or use "
            "another output_dir to start afresh")
    if resume:
        if cfg.checkpoint.load_params_from and not lora.enabled(cfg.lora):  # resume wins; say so, or the user believes the parameters came in
            log(f"warning: checkpoint.load_params_from={cfg.checkpoint.load_params_from!r} is ignored: output_dir "
                f"{cfg.output_dir} holds checkpoint {resume.newest}, which this run resumes from; give the run a new "
                "output_dir to start from those parameters")
    init_jit = jax.jit(lambda k: nn.meta.unbox(layout.init(k)), out_shardings=layout.sharding)
    if resume and lora.enabled(cfg.lora):  # the adapters from the checkpoint, the base from where it always comes
        # Before anything is read: other adapters' settings would otherwise read as "does not fit this model".
        from maxtext_rocm.checkpoint.reading import checkpoint_meta

        newest = resume.step_dir(resume.newest)
        lora_base.check_hyperparameters(lora_base.recorded(checkpoint_meta(newest)), cfg.lora, newest)
        made = compilation.in_thread(restored_lora_state, cfg, compilation.lower_init(init_jit, layout.key),
                                     layout.key, checkpointer, resume, layout.abstract, log)
    elif resume:
        made = compilation.in_thread(restored_state, checkpointer, resume, layout.abstract, log, layout.storage_order)
    elif lora.enabled(cfg.lora):
        made = compilation.in_thread(fresh_lora_state, cfg, compilation.lower_init(init_jit, layout.key),
                                     layout.key, checkpointer, layout.abstract, log)
    else:
        made = compilation.in_thread(fresh_state, cfg.checkpoint, compilation.lower_init(init_jit, layout.key),
                                     layout.key, layout.abstract, log, layout.storage_order)
    def lowered():
        with sharding_rules():
            return lower_step(step, cfg, mesh, layout.abstract, batch_sharding, batch_dtypes)

    if (resume and resume.newest == cfg.train.steps) or cfg.train.objective == "grpo" or \
            row_buckets(cfg.data, cfg.train.seq_len):
        # A finished run relaunched: compiled only if a step runs. GRPO's rows, and rows of one
        # example under data.buckets, come in buckets (data/buckets.py): the full-length step is
        # compiled only if a batch needs it.
        compiled = CompiledOnFirstUse(lowered)
        state, step_count, data_state = made.result()
    elif compilation.compile_overlaps_init():
        compiled = compilation.in_thread(lowered().compile)
        state, step_count, data_state = made.result()
    else:
        lowering = lowered()
        state, step_count, data_state = made.result()
        compiled = lowering.compile()
        compilation.release_freed_host_memory()
    if resume:  # checkpoints the resume skipped or passed over move out of the way of this run's saves
        moved = checkpointer.set_aside(step_count)
        if moved:
            log(f"checkpoints newer than step {step_count} moved to {moved[0].parent}: "
                + ", ".join(p.name for p in moved))
    return Launched(state, step_count, data_state, compiled, layout.sharding, layout.storage_order, step)


class CompiledOnFirstUse(Future):
    """A train step compiled when it is first asked for: a run whose checkpoint is at train.steps
    already (`Trainer.run(n)` past the end, a notebook's `step()`), never for a relaunch that only
    says the run is done (an 8B step takes minutes to compile); and the full-length step of rows
    padded to buckets (GRPO's, data.buckets'), which only a batch that needs the last bucket asks for."""

    def __init__(self, lowered: Callable[[], jax.stages.Lowered]):
        super().__init__()
        self._lowered = lowered

    def result(self, timeout=None):
        if not self.done():
            self.set_result(self._lowered().compile())
        return super().result(timeout)


def lower_step(step, cfg, mesh, abstract, batch_sharding, batch_dtypes, row_length: int | None = None
               ) -> jax.stages.Lowered:
    """The train step lowered from shapes alone (no state needed yet), for rows of train.seq_len
    positions or of `row_length` (a bucket's: data/buckets.py)."""
    from maxtext_rocm.config import global_batch_size

    shape = (global_batch_size(cfg, mesh.size), row_length or cfg.train.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding) for k, dtype in batch_dtypes.items()}
    return step.lower(abstract, batch, optimizer_hyperparameters(cfg, mesh, abstract=True))


def resumable_abstract(cfg, layout):
    """The state a checkpoint holds, abstract: model order (a pipeline stores its own), and for a
    LoRA run no base (its checkpoints hold the adapters; the base comes from where it always does)."""
    abstract = layout.abstract if layout.storage_order is None else layout.storage_order.canonical_abstract
    return abstract.replace(frozen={}) if lora.enabled(cfg.lora) else abstract


def restored_state(checkpointer, resume, abstract, log, storage_order=None):
    """(state, its step, the data position saved with it) from checkpoint `resume`, each array
    directly in its sharding. Checkpoints hold model order: under a `storage_order` converter the
    state is restored so and stored in the pipeline's order once."""
    if storage_order is None:
        state, data_state, step = checkpointer.restore(resume, abstract)
    else:
        state, data_state, step = checkpointer.restore(resume, storage_order.canonical_abstract)
        state = storage_order.to_storage(state)
    log(f"resumed from {resume.where(step)}")
    return state, int(data_state["step"]), data_state


def initialised_state(init_lowered, key, abstract):
    """The state the init program makes from `key` (its compiler options sized by the parameter
    values it makes: the trained ones and a LoRA run's frozen base)."""
    n_values = sum(x.size for x in jax.tree_util.tree_leaves((abstract.params, frozen_base(abstract))))
    return compilation.run_init(init_lowered, key, n_values)


def fresh_state(checkpoint_cfg, init_lowered, key, abstract, log, storage_order=None):
    """(state, 0, None): the lowered init program compiled and run (every array made in its
    sharding), optionally with parameters from another run (checkpoint.load_params_from)."""
    state = initialised_state(init_lowered, key, abstract)
    if checkpoint_cfg.load_params_from:
        from maxtext_rocm.checkpoint import restore_params

        if storage_order is None:
            params = restore_params(checkpoint_cfg.load_params_from, abstract.params)
        else:  # saved in model order
            params = storage_order.params_to_storage(restore_params(checkpoint_cfg.load_params_from,
                                                                    storage_order.canonical_abstract.params))
        state = state.replace(params=params)
        if state.reference:  # the DPO reference is the starting point: these parameters
            from maxtext_rocm.finetune import dpo

            state = state.replace(reference=dpo.refreshed_reference(state.reference, params))
        log(f"parameters from {checkpoint_cfg.load_params_from}; fresh optimizer at step 0")
    return state, 0, None


class LoraBase(NamedTuple):
    """A LoRA run's frozen base as the state holds it, and which base it is (finetune/lora_base.py)."""
    frozen: object
    identity: lora_base.BaseIdentity


def load_lora_base(path, abstract_frozen) -> LoraBase:
    """A LoRA run's frozen base from `path`, verified, in the compute dtype of `abstract_frozen`.
    Read in the stored fp32 (the checksums are of those values) and cast: for a moment the base is
    held twice (fp32 + compute dtype)."""
    from maxtext_rocm.checkpoint.lora_run import loaded_identity
    from maxtext_rocm.checkpoint.reading import restore_params_checked

    stored = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32, sharding=x.sharding),
                                    abstract_frozen)
    base, sums = restore_params_checked(path, stored)
    return LoraBase(jax.tree_util.tree_map(lambda x, a: x.astype(a.dtype), base, abstract_frozen),
                    loaded_identity(path, sums))


def lora_base_of(cfg, initialised_frozen, abstract_frozen) -> LoraBase:
    """The base a LoRA run trains on: checkpoint.load_params_from's, or (without one) train.seed's
    initialisation, `initialised_frozen`, already in the state."""
    from maxtext_rocm.checkpoint.lora_run import seed_identity

    pointer = lora_base.base_pointer(cfg)
    if pointer:
        return load_lora_base(pointer, abstract_frozen)
    return LoraBase(initialised_frozen, seed_identity(cfg.train.seed, initialised_frozen, "train"))


def fresh_lora_state(cfg, init_lowered, key, checkpointer, abstract, log):
    """(state, 0, None) of a new LoRA run: fresh adapters and optimizer on its base, whose identity
    every checkpoint of the run records (`checkpointer.built_from`)."""
    state = initialised_state(init_lowered, key, abstract)
    base = lora_base_of(cfg, state.frozen, abstract.frozen)
    if checkpointer:
        checkpointer.built_from = lora_base.run_record(cfg.lora, base.identity)
    if lora_base.base_pointer(cfg):
        log(f"LoRA base from {cfg.checkpoint.load_params_from}; fresh adapters and optimizer at step 0")
    return state.replace(frozen=base.frozen), 0, None


def restored_lora_state(cfg, init_lowered, key, checkpointer, resume, abstract, log):
    """(state, its step, data position) of a resumed LoRA run: adapters, optimizer state and
    counters from checkpoint `resume` (which holds no base), the base from checkpoint.load_params_from
    as at the start, or, without it, train.seed's initialisation made again; refused (BaseChanged)
    where that base is not the one the checkpoint records, unless lora.allow_base_change."""
    restored, data_state, step = checkpointer.restore(resume, abstract.replace(frozen={}))
    initialised = initialised_state(init_lowered, key, abstract).frozen
    base = lora_base_of(cfg, initialised, abstract.frozen)
    where = resume.step_dir(step)
    from maxtext_rocm.checkpoint.reading import checkpoint_meta

    warning = lora_base.check_base(lora_base.recorded(checkpoint_meta(where)), base.identity, cfg.lora, where,
                                   resuming=True)
    if warning:
        log(f"warning: {warning}")
    checkpointer.built_from = lora_base.run_record(cfg.lora, base.identity)
    log(f"resumed from {resume.where(step)}"
        + (f" (LoRA base from {cfg.checkpoint.load_params_from})" if lora_base.base_pointer(cfg) else ""))
    return restored.replace(frozen=base.frozen), int(data_state["step"]), data_state


def data_sources(cfg, global_batch: int, resumed_data_state: dict | None, mesh=None):
    """(train source, eval source or None) for this process; the train source continues from the
    data position saved with the checkpoint the run resumed from (the files source can). On `mesh`
    a process loads the block of rows its devices hold: processes that differ only in pipeline
    stage (mesh.dcn.stage) hold, and load, the same rows."""
    from maxtext_rocm.data import build_source

    rows = ((jax.process_index(), jax.process_count()) if mesh is None
            else sharding.batch_rows_of_process(mesh, global_batch, cfg.train.seq_len))

    def source(split):
        return build_source(cfg.data, vocab_size=cfg.model.vocab_size, global_batch=global_batch,
                            seq_len=cfg.train.seq_len, process_index=rows[0], process_count=rows[1], split=split)

    data = source("train")
    if resumed_data_state and hasattr(data, "restore"):
        data.restore(resumed_data_state)
    return data, (source("eval") if cfg.train.eval_every else None)


def place_batch(host: dict, layout, batch_sharding, dtypes: dict, global_batch: int) -> dict:
    """This process's rows of a host batch, laid out over `sequence` (parallel/context.py's
    Layout) and assembled into one global sharded array each, `global_batch` rows in all."""
    return {k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(v, dtypes[k]),
                                                      (global_batch, *np.shape(v)[1:]))
            for k, v in layout.apply(host).items()}


def jit_eval_step(model, mesh, state_sharding, batch_sharding, dpo_cfg=None):
    """The jitted eval step: (params, batch, fp8 state, DPO reference, LoRA base) -> token-mean loss
    and token count, or under DPO (a non-empty reference) the batch's DPO sums (step.eval_step)."""
    from maxtext_rocm.trainer.step import eval_step

    frozen_dpo = ml_collections.FrozenConfigDict(dpo_cfg) if dpo_cfg is not None else None
    return jax.jit(lambda params, batch, fp8_state, reference, frozen: eval_step(
                       params, batch, model=model, fp8_state=fp8_state, reference=reference, dpo_cfg=frozen_dpo,
                       frozen=frozen),
                   in_shardings=(state_sharding.params, batch_sharding, state_sharding.fp8, state_sharding.reference,
                                 frozen_base(state_sharding)),
                   out_shardings=sharding.replicated(mesh))
