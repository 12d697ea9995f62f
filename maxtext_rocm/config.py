"""Configuration: every default in nested groups, preset loading and overrides (validation: config_checks.py).

A run is described by one `ml_collections.ConfigDict` with one group per part of the trainer
(`model`, `mesh`, `precision`, `optimizer`, `data`, `checkpoint`-to-come, `train`, `log`). Each part
reads only its own group. Presets live in `configs/NAME.py` and define `get_config(variant="")`,
starting from `defaults()`.

Every user mistake surfaces as a `ConfigError` whose message is one sentence naming the key and
what would be valid; the command line turns it into exit status 2.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import linecache
import re
import traceback
from pathlib import Path
from typing import Any, Iterable, Mapping

import ml_collections

# Re-exported: the valid values and the error types live at the bottom of the import graph, so
# config_checks.py, data/ and sharding.py import them without importing this module.
from maxtext_rocm.config_choices import (  # noqa: F401
    ATTENTION_IMPLEMENTATIONS, CONTEXT_PARALLEL_MODES, DATA_SOURCES, FP8_FORMATS, FP8_SCALINGS, MESH_AXES,
    MODEL_FAMILIES, MOE_IMPLEMENTATIONS, NONFINITE_ACTIONS, PIPELINE_SCHEDULES, PRECISION_POLICIES,
    PRECISION_VARIANTS, REMAT_POLICIES, SCHEDULES)
from maxtext_rocm.errors import CheckpointError, ConfigError, UserError  # noqa: F401
# Validation lives in config_checks.py; its entry points are part of this module's interface.
from maxtext_rocm.config_checks import axis_sizes, global_batch_size, mesh_shape, validate  # noqa: F401


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
        # (maxtext_rocm/cross_entropy.py), so full [tokens, vocab] fp32 logits never exist; 0: unchunked.
        loss_chunk_len=64,
        attention="auto",  # "xla", "cudnn", "blockwise", "auto" (by device; models/attention.py)
        embed_init_std=0.02,
        # Attention to at most this many tokens back, the query included; None or 0: off.
        sliding_window=0,
        # q/k/v and gate/up each as one dot over their kernels side by side, so that tensor
        # parallelism reduces x's gradient once per group (5 all-reduces per layer, not 8). The
        # parameters are the same either way. "auto": on when mesh tensor > 1; on one device the
        # separate dots ran 5-20% faster (bf16, 2-core CPU). fp8 always keeps one dot per weight.
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
        # each microbatch goes round the stages `repeats` times, bubble (S-1)/(R M+S-1).
        schedule="gpipe",
        repeats=1,  # virtual stages per device (circular; gpipe takes 1)
    )
    cfg.precision = dict(
        policy="bf16",  # "fp32", "bf16", or "fp8" (bf16 with fp8 matmuls; see maxtext_rocm/fp8.py)
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
        add_bos=True, add_eos=True,  # around each document, where the tokenizer has them
        packing=True,  # several documents per row (segment ids); off: one per row, truncated/padded
        epochs=0,  # passes over data.paths before the run stops with an error; 0: no limit
        prefetch=4,  # batches a background thread builds ahead of the step
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
        # compiled programs instead of compiling them again (maxtext_rocm/compilation.py):
        # "auto": $JAX_COMPILATION_CACHE_DIR if set, else output_dir/compilation_cache; "off"; or a directory.
        compilation_cache="auto",
        # The hang watchdog (maxtext_rocm/watchdog.py): no step finished for this many seconds ->
        # every thread's Python stack to stderr and output_dir/hang-*.txt, exit status 4, so a
        # scheduler restarts the run from its last checkpoint; 0 = off. It must exceed the longest
        # pause between two steps (an evaluation, the blocking part of a checkpoint save).
        hang_timeout_s=0.0,
        # The watchdog's limit from launch to the end of the first step (restore and compilation
        # included, which take far longer than a step); 0: 10 x hang_timeout_s.
        startup_timeout_s=0.0,
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
    # Multi-process start-up (maxtext_rocm/distributed.py). Unset keys are found from the
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


def apply_variant(cfg: ml_collections.ConfigDict, variant: str) -> ml_collections.ConfigDict:
    """The variants every preset understands: precision policies (`:bf16`, `:fp32`, `:fp8`)."""
    if variant not in PRECISION_VARIANTS:
        raise ConfigError(
            f"unknown variant {variant!r}; valid variants are "
            + ", ".join(repr(v) for v in PRECISION_VARIANTS if v)
        )
    if variant:
        cfg.precision.policy = variant
    return cfg


def _configs_dirs() -> list[Path]:
    return [Path.cwd() / "configs", Path(__file__).resolve().parent.parent / "configs"]


def _resolve_preset(path: str) -> Path:
    candidate = Path(path)
    if candidate.suffix != ".py":  # a bare preset name such as "tiny_llama"
        for folder in _configs_dirs():
            if (folder / f"{path}.py").is_file():
                return folder / f"{path}.py"
    if candidate.is_file():
        return candidate
    known = sorted({p.stem for d in _configs_dirs() if d.is_dir() for p in d.glob("*.py")})
    raise ConfigError(
        f"config file {path!r} does not exist; give a path such as configs/tiny_llama.py "
        f"or a preset name ({', '.join(known) or 'none found'})"
    )


# Every preset file loaded so far: an error inside one is reported at its own line, the innermost
# preset's (presets build on each other), not at the loader's.
_PRESET_FILES: set[str] = set()


def load_preset(spec: str) -> ml_collections.ConfigDict:
    """The config that `PATH.py[:VARIANT]` (or a preset name) defines, before overrides.

    Presets may build on each other: `configs/llama3_1_8b.py` starts from `load_preset("llama3_8b")`.
    A preset that does not import, or whose get_config raises (an unknown key included), is a
    ConfigError naming the file and the line.
    """
    path, _, variant = spec.partition(":")
    preset = _resolve_preset(path)
    _PRESET_FILES.add(str(preset.resolve()))
    module_spec = importlib.util.spec_from_file_location(f"maxtext_rocm_preset_{preset.stem}", preset)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise ConfigError(f"config file {str(preset)!r} does not define get_config(variant='')")
        cfg = module.get_config(variant)
    except ConfigError:
        raise
    except SyntaxError as error:  # the file itself: its line is in the error, not in a frame
        raise ConfigError(f"config file {error.filename or str(preset)!r} line {error.lineno} is not valid "
                          f"Python ({error.msg}); fix it or pass another preset") from None
    except Exception as error:  # noqa: BLE001 - a preset is user code and may raise anything
        raise _preset_error(preset, error) from None
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise ConfigError(f"get_config in {str(preset)!r} returned a {type(cfg).__name__}, not the "
                          "ConfigDict that config.defaults() starts")
    cfg.lock()  # a preset that built its own ConfigDict is held to its keys from here on too
    return cfg


def _preset_error(preset: Path, error: Exception) -> ConfigError:
    """One sentence for an exception raised while a preset ran: the file and line it came from (the
    innermost preset frame), and for a locked-config error the unknown key with the close name."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if str(Path(f.filename).resolve()) in _PRESET_FILES]
    where_file, line = (frames[-1].filename, frames[-1].lineno) if frames else (str(preset), None)
    at = f"config file {where_file!r}" + (f" line {line}" if line else "")
    text = str(error.args[0]) if error.args else ""
    unknown = re.search(r'Key "([^"]+)" does not exist and cannot be added since the config is locked', text)
    if unknown:
        close = re.search(r'Did you mean "([^"]+)"', text)
        source = linecache.getline(where_file, line).strip() if line else ""
        return ConfigError(
            f"{at} sets the unknown config key {unknown.group(1)!r}" + (f" ({source})" if source else "")
            + (f"; did you mean {close.group(1)!r}?" if close else "; see config.defaults() for the keys"))
    first = (text.strip().splitlines() or [""])[0][:300]
    return ConfigError(f"{at} raised {type(error).__name__}" + (f": {first}" if first else "")
                       + "; fix the preset or pass another one")


def load(spec: str, overrides: Mapping[str, Any] | Iterable[str] | None = None):
    """Loads `PATH.py[:VARIANT]` (or a preset name), applies overrides and validates the result.

    `overrides` is either a mapping `{"train.steps": 100}` of typed values or command-line
    strings `["--config.train.steps=100"]`.
    """
    cfg = load_preset(spec)
    if isinstance(overrides, Mapping):
        for key, value in overrides.items():
            set_key(cfg, key, value)
    elif overrides is not None:
        apply_cli_overrides(cfg, list(overrides))
    if not cfg.output_dir:
        cfg.output_dir = f"runs/{cfg.name}"
    validate(cfg)
    return cfg


def _lookup(cfg: ml_collections.ConfigDict, key: str):
    """Returns (parent, leaf name) for a dotted key, or raises a ConfigError naming the nearest."""
    parts = key.split(".")
    node = cfg
    for depth, part in enumerate(parts):
        here = ".".join(parts[: depth + 1])
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            siblings = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
            close = difflib.get_close_matches(part, siblings, n=1)
            hint = f"did you mean {'.'.join(parts[:depth] + close)!r}? " if close else ""
            scope = ".".join(parts[:depth]) or "the config"
            raise ConfigError(
                f"unknown config key {here!r}; {hint}keys in {scope} are: {', '.join(siblings)}"
            )
        if depth < len(parts) - 1:
            node = node[part]
    return node, parts[-1]


def set_key(cfg: ml_collections.ConfigDict, key: str, value: Any) -> None:
    """Sets a dotted key, keeping the type of the default (ints may widen to floats)."""
    parent, leaf = _lookup(cfg, key)
    current = parent[leaf]
    if isinstance(current, ml_collections.ConfigDict) and not isinstance(value, Mapping):
        raise ConfigError(f"config key {key!r} is a group; set one of its keys ({', '.join(current.keys())})")
    if current is not None and not isinstance(current, ml_collections.ConfigDict):
        value = _coerce(key, current, value)
    if isinstance(value, Mapping):
        value = ml_collections.ConfigDict(dict(value))
    with parent.unlocked():
        if key in FRACTIONAL_KEYS and isinstance(value, float) and isinstance(current, int):
            del parent[leaf]  # the field was typed int by its default; a fraction retypes it
        parent[leaf] = value


# Integer keys that also take a fraction (MaxText's convention): a per-device batch of 0.125 on 8
# devices is one sequence split by mesh `sequence` (config_checks.global_batch_size checks it).
FRACTIONAL_KEYS = ("train.per_device_batch_size",)


def _fractional(key: str, value: Any) -> Any:
    """A fraction for a FRACTIONAL_KEYS key; whole numbers stay ints, as the default is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _coerce(key: str, current: Any, value: Any) -> Any:
    kind = type(current)
    if key in FRACTIONAL_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool):
        return _fractional(key, value)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is tuple and isinstance(value, list):
        return tuple(value)
    raise ConfigError(
        f"config key {key!r} takes a {kind.__name__} (default {current!r}), not {value!r}"
    )


def _parse_cli_value(key: str, current: Any, text: str) -> Any:
    """Reads a command-line value by the type of the key's default, as ml_collections does."""
    if isinstance(current, bool):
        lowered = text.lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ConfigError(f"config key {key!r} takes true or false, not {text!r}")
    if key in FRACTIONAL_KEYS:
        try:
            return _fractional(key, float(text))
        except ValueError:
            raise ConfigError(f"config key {key!r} takes a number (a fraction of a sequence per device is "
                              f"allowed), not {text!r}") from None
    if isinstance(current, (int, float)):
        try:
            number = float(text) if isinstance(current, float) else int(text)
        except ValueError:
            raise ConfigError(
                f"config key {key!r} takes a{'n int' if isinstance(current, int) else ' float'}, not {text!r}"
            ) from None
        return number
    if isinstance(current, str):
        return text
    # None-valued keys (e.g. model.rope_scaling) and tuples take Python literals.
    if text.lower() == "none":
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(f"config key {key!r} takes a Python literal (a dict, tuple or None), not {text!r}") from None


def apply_cli_overrides(cfg: ml_collections.ConfigDict, args: list[str]) -> None:
    """Applies `--config.GROUP.KEY=VALUE` (or `--config.GROUP.KEY VALUE`) arguments in order."""
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--config."):
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --config.train.steps=100")
        body = arg[len("--config."):]
        if "=" in body:
            key, text = body.split("=", 1)
        elif i + 1 < len(args):
            key, text = body, args[i + 1]
            i += 1
        else:
            raise ConfigError(f"override {arg!r} has no value; write it as {arg}=VALUE")
        parent, leaf = _lookup(cfg, key)
        set_key(cfg, key, _parse_cli_value(key, parent[leaf], text))
        i += 1
