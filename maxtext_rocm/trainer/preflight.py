"""The checks before a run starts that need more than the config: the config's own (config.validate),
what the config names on disk (output_dir, checkpoints, chat template, data files, tokenizer), what
the model's kernels serve and what must divide over the mesh (the sharding rules).

`check_run` is what the trainer and the planner call; it sits in trainer/ because it reads
models/ and parallel/, which config/ must not import (config is below them in the import order).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from maxtext_rocm.config.checks import (_require, axis_sizes, built_in_template, dpo_batch_problem, global_batch_size,
                                        grpo_batch_problem, interleaved, pipeline_microbatches, validate)
from maxtext_rocm.errors import ConfigError
from maxtext_rocm.config.mesh_sizes import mesh_shape


def check_run(cfg, device_count: int | None = None, process_count: int = 1, inputs: bool = True) -> None:
    """Raises ConfigError (one sentence) for anything that would stop the run later: the config
    (config.validate), with `inputs` what it names on disk (check_inputs; the planner, which plans
    for a cluster's files, leaves them out), the attention kernel's head sizes, and with
    `device_count` the batch, sequence and parameters against the mesh."""
    validate(cfg, device_count, process_count)
    if inputs:
        check_inputs(cfg)
    m = cfg.model
    if m.attention == "pallas":  # its platform is checked by the resolve step (attention.implementation_for)
        from maxtext_rocm.models.pallas_attention import unsupported_head_dim

        reason = unsupported_head_dim(m.head_dim)
        _require(reason is None, f"model.attention='pallas' needs model.head_dim to be {reason}, got "
                 f"{m.head_dim}; use model.attention='blockwise' or 'xla' for this head size")
    if device_count is not None:
        _validate_against_mesh(cfg, mesh_shape(cfg.mesh, device_count, process_count), device_count, process_count)


def check_inputs(cfg) -> None:
    """What the config names on disk: output_dir can be written, the checkpoint paths are folders,
    the chat template file exists, and the data files and tokenizer read (data/files.py: they
    exist, are not empty, have the text field, and the tokenizer's ids fit the model)."""
    if cfg.output_dir:
        _check_output_dir(cfg.output_dir)
    c = cfg.checkpoint
    _require(c.resume in ("auto", "never") or c.resume.isdigit() or Path(c.resume).is_dir(),
             f"checkpoint.resume={c.resume!r} is not valid; use 'auto', 'never', a step number "
             "or the path of an existing checkpoint directory")
    _require(not c.load_params_from or Path(c.load_params_from).is_dir(),
             f"checkpoint.load_params_from={c.load_params_from!r} is not a directory")
    template = cfg.data.chat_template
    _require(built_in_template(template) or Path(template).expanduser().is_file(),
             f"data.chat_template={template!r} is neither a file nor a built-in template; use a Jinja file, "
             "'llama3', or '' for the tokenizer's own")
    if cfg.train.objective == "grpo":  # the prompts fit their rows, the rewards import
        _check_grpo_inputs(cfg)
    elif cfg.data.source == "files":
        from maxtext_rocm.data.files import check_inputs as check_data_files

        check_data_files(cfg.data, cfg.model.vocab_size, cfg.train.seq_len)  # files exist, read, fit the model
    elif cfg.data.tokenizer not in ("", "byte"):
        from maxtext_rocm.data.tokenizer import check_vocab, load_tokenizer

        check_vocab(load_tokenizer(cfg.data.tokenizer), cfg.model.vocab_size, cfg.data.tokenizer)


def _check_grpo_inputs(cfg) -> None:
    """GRPO's inputs: the tokenizer fits the model, every prompt fits train.seq_len less
    grpo.max_new_tokens (loaded once: the trainer takes what this read), every reward imports, and
    every record has the fields the built-in rewards read."""
    from maxtext_rocm.data.prompts import load_prompts
    from maxtext_rocm.data.tokenizer import check_vocab, load_tokenizer
    from maxtext_rocm.finetune.grpo.rewards import check_records, load_rewards

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    check_vocab(tokenizer, cfg.model.vocab_size, cfg.data.tokenizer or "byte")
    prompts = load_prompts(cfg.data, tokenizer, cfg.train.seq_len - cfg.grpo.max_new_tokens)
    load_rewards(cfg.grpo)
    check_records(cfg.grpo, prompts.prompts)


def _check_output_dir(output_dir: str) -> None:
    """output_dir is, or can become, a writable directory: checked before anything, so the first thing that
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




def _validate_against_mesh(cfg, shape, device_count: int, process_count: int = 1) -> None:
    from maxtext_rocm.parallel.sharding import check_param_divisibility, mesh_axes_of  # imports jax

    sizes = axis_sizes(shape)
    m, t = cfg.model, cfg.train
    batch = global_batch_size(cfg, device_count)
    batch_axes = mesh_axes_of("activation_batch")
    batch_shards = math.prod(sizes[a] for a in batch_axes)
    _require(batch % t.grad_accum == 0,
             f"the global batch of {batch} sequences (train.per_device_batch_size={t.per_device_batch_size} "
             f"x {device_count} devices) does not split into train.grad_accum={t.grad_accum} micro-batches")
    if t.objective == "grpo":
        problem = grpo_batch_problem(batch, cfg.grpo.group_size)
        _require(problem is None, problem or "")
    if t.objective == "dpo":  # processes that differ only in pipeline stage load the same rows
        problem = dpo_batch_problem(batch, t.grad_accum, max(1, process_count // cfg.mesh.dcn.stage))
        _require(problem is None, problem or "")
    micro = batch // t.grad_accum
    _require(micro % batch_shards == 0,
             f"each micro-batch of {micro} sequences does not divide over the {batch_shards} batch shards "
             f"(mesh axes {' x '.join(batch_axes)}); raise train.per_device_batch_size, lower train.grad_accum, "
             "or split each sequence over mesh.ici.sequence instead")
    if sizes["stage"] > 1:
        _validate_pipeline_against_mesh(cfg, sizes["stage"], micro, batch_shards)
    _require(t.seq_len % sizes["sequence"] == 0,
             f"train.seq_len={t.seq_len} does not divide over mesh sequence={sizes['sequence']}")
    if sizes["sequence"] > 1 and m.context_load_balance:
        chunks = 2 * sizes["sequence"]
        _require(t.seq_len % chunks == 0,
                 f"train.seq_len={t.seq_len} does not split into the 2 x sequence = {chunks} chunks that "
                 f"model.context_load_balance needs; use a multiple of {chunks}, or model.context_load_balance=false")
    _check_buckets_split(cfg, sizes["sequence"] * (2 if sizes["sequence"] > 1 and m.context_load_balance else 1))
    problem = check_param_divisibility(m, sizes)
    _require(problem is None, problem or "")


def _check_buckets_split(cfg, chunks: int) -> None:
    """Each of data.buckets' lengths splits over the mesh's sequence shards as train.seq_len does
    ('auto' keeps only the quarters that do: maxtext_rocm/resolve.py)."""
    from maxtext_rocm.data.buckets import row_buckets

    lengths = () if str(cfg.data.buckets).strip() == "auto" else row_buckets(cfg.data, cfg.train.seq_len) or ()
    odd = [n for n in lengths if n % chunks]
    _require(not odd, f"data.buckets={cfg.data.buckets!r} has row lengths {', '.join(map(str, odd))} that do not "
             f"split into the {chunks} sequence chunks of this mesh; use multiples of {chunks}, or data.buckets='auto'")


def _validate_pipeline_against_mesh(cfg, stages: int, micro_batch: int, batch_shards: int) -> None:
    """A pipeline over `stages` devices: its layers and its microbatches."""
    m, pipe = cfg.model, cfg.pipeline
    # A stack that does not divide is padded with empty slots (parallel/pipeline/layout.py); one
    # with fewer layers than virtual stages would leave some with nothing to run.
    virtual = stages * pipe.repeats
    _require(m.n_layers >= virtual,
             f"model.n_layers={m.n_layers} leaves some of mesh stage={stages} x pipeline.repeats={pipe.repeats} "
             f"= {virtual} virtual stages without a layer; choose stage x repeats <= {m.n_layers}")
    _require(m.scan_layers, "mesh stage > 1 pipelines the scanned layer stack; set model.scan_layers=True")
    micro = pipeline_microbatches(pipe, stages, max(1, micro_batch // batch_shards))
    _require(pipe.schedule != "circular" or micro >= stages,
             f"pipeline.microbatches={micro} is fewer than mesh stage={stages}: a circular schedule sends each "
             f"microbatch round again only once the first stage is free; use pipeline.microbatches >= {stages}")
    _require(not interleaved(pipe) or micro % stages == 0,
             f"pipeline.microbatches={micro} is not a multiple of mesh stage={stages}: interleaved 1F1B "
             f"(pipeline.repeats={pipe.repeats}) runs the microbatches in groups of the stages; use a multiple "
             f"of {stages}, or pipeline.repeats=1")
    _require(micro_batch % micro == 0 and (micro_batch // micro) % batch_shards == 0,
             f"pipeline.microbatches={micro} does not divide the step's {micro_batch} sequences (per "
             f"train.grad_accum micro-batch) into pieces that split over the {batch_shards} batch shards; "
             f"choose a count that divides {micro_batch // batch_shards}")
