"""Configuration: every default in nested groups, preset loading, overrides and validation.

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
import math
from pathlib import Path
from typing import Any, Iterable, Mapping

import ml_collections

MESH_AXES = ("data", "fsdp", "expert", "sequence", "tensor")
REMAT_POLICIES = ("none", "full", "minimal", "save_dots")
ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn")
PRECISION_POLICIES = ("fp32", "bf16", "fp8")
FP8_FORMATS = ("auto", "ocp", "fnuz")
FP8_SCALINGS = ("delayed", "current")
SCHEDULES = ("cosine", "constant")
DATA_SOURCES = ("synthetic", "embedded", "files")
MODEL_FAMILIES = ("llama", "mixtral")
MOE_IMPLEMENTATIONS = ("auto", "dropless", "capacity", "dense")
PRECISION_VARIANTS = ("", "bf16", "fp32", "fp8")
NONFINITE_ACTIONS = ("skip", "stop")


class UserError(ValueError):
    """A mistake in what the user asked for; the command line prints it and exits with status 2."""


class ConfigError(UserError):
    """A config key is unknown, mistyped or inconsistent with the others."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used: missing, unreadable, or of another model's shapes."""


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
        attention="xla",
        embed_init_std=0.02,
        # Attention to at most this many tokens back, the query included; None or 0: off.
        sliding_window=0,
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
        eval_every=0,  # steps between evaluations on the eval split (data.eval_paths for files); 0: off
        eval_steps=10,  # batches per evaluation
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
        tensorboard=True,
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


def load_preset(spec: str) -> ml_collections.ConfigDict:
    """The config that `PATH.py[:VARIANT]` (or a preset name) defines, before overrides.

    Presets may build on each other: `configs/llama3_1_8b.py` starts from `load_preset("llama3_8b")`.
    """
    path, _, variant = spec.partition(":")
    preset = _resolve_preset(path)
    module_spec = importlib.util.spec_from_file_location(f"maxtext_rocm_preset_{preset.stem}", preset)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {str(preset)!r} does not define get_config(variant='')")
    return module.get_config(variant)


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
        parent[leaf] = value


def _coerce(key: str, current: Any, value: Any) -> Any:
    kind = type(current)
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


# ----------------------------------------------------------------------------------------------
# Validation


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _one_of(key: str, value: Any, valid: Iterable[Any]) -> None:
    valid = tuple(valid)
    _require(value in valid, f"{key}={value!r} is not valid; choose one of {', '.join(map(repr, valid))}")


def _positive(cfg, *keys: str) -> None:
    for key in keys:
        parent, leaf = _lookup(cfg, key)
        _require(parent[leaf] > 0, f"{key} must be positive, got {parent[leaf]!r}")


def validate(cfg: ml_collections.ConfigDict, device_count: int | None = None,
             process_count: int = 1) -> None:
    """Checks every key and every combination the trainer relies on.

    Mesh and batch checks that need the device count run when `device_count` is given (the
    trainer calls this again once it knows its devices).
    """
    m = cfg.model
    _one_of("model.family", m.family, MODEL_FAMILIES)
    _positive(cfg, "model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads",
              "model.n_kv_heads", "model.head_dim", "model.mlp_dim", "model.rope_theta",
              "model.norm_eps")
    _require(m.n_heads % m.n_kv_heads == 0,
             f"model.n_heads={m.n_heads} must be a multiple of model.n_kv_heads={m.n_kv_heads} "
             "(grouped-query attention shares each kv head among n_heads/n_kv_heads query heads)")
    _require(m.head_dim % 2 == 0, f"model.head_dim={m.head_dim} must be even for rotary embeddings")
    _one_of("model.remat", m.remat, REMAT_POLICIES)
    _one_of("model.attention", m.attention, ATTENTION_IMPLEMENTATIONS)
    _require(m.loss_chunk_len >= 0, f"model.loss_chunk_len must be >= 0 (0: unchunked), got {m.loss_chunk_len}")
    if m.rope_scaling is not None:
        _validate_rope_scaling(m.rope_scaling)
    _validate_moe(m)

    p = cfg.precision
    _one_of("precision.policy", p.policy, PRECISION_POLICIES)
    _one_of("precision.fp8_format", p.fp8_format, FP8_FORMATS)
    _one_of("precision.fp8_scaling", p.fp8_scaling, FP8_SCALINGS)
    _positive(cfg, "precision.amax_history_len")

    o = cfg.optimizer
    _one_of("optimizer.schedule", o.schedule, SCHEDULES)
    for key in ("lr", "warmup_steps", "weight_decay", "clip_norm", "min_lr_ratio", "eps"):
        _require(o[key] >= 0, f"optimizer.{key} must be >= 0, got {o[key]!r}")
    _require(0 <= o.b1 < 1 and 0 <= o.b2 < 1, f"optimizer.b1 and optimizer.b2 must lie in [0, 1), got {o.b1}, {o.b2}")

    t = cfg.train
    _positive(cfg, "train.steps", "train.per_device_batch_size", "train.seq_len", "train.grad_accum")
    _require(t.z_loss_weight >= 0, f"train.z_loss_weight must be >= 0, got {t.z_loss_weight}")

    _one_of("train.on_nonfinite", t.on_nonfinite, NONFINITE_ACTIONS)

    c = cfg.checkpoint
    _require(c.every >= 0, f"checkpoint.every must be >= 0, got {c.every}")
    _require(c.keep >= 1, f"checkpoint.keep must be >= 1, got {c.keep}")
    _require(c.keep_period >= 0, f"checkpoint.keep_period must be >= 0, got {c.keep_period}")
    _require(c.resume in ("auto", "never") or c.resume.isdigit() or Path(c.resume).is_dir(),
             f"checkpoint.resume={c.resume!r} is not valid; use 'auto', 'never', a step number "
             "or the path of an existing checkpoint directory")
    _require(not c.load_params_from or Path(c.load_params_from).is_dir(),
             f"checkpoint.load_params_from={c.load_params_from!r} is not a directory")

    _one_of("data.source", cfg.data.source, DATA_SOURCES)
    _require(t.eval_every >= 0, f"train.eval_every must be >= 0 (0: no evaluation), got {t.eval_every}")
    _require(t.eval_steps >= 1, f"train.eval_steps must be >= 1, got {t.eval_steps}")
    if cfg.data.source == "files":
        _require(bool(cfg.data.paths), "data.source='files' needs data.paths: files or globs of .jsonl, "
                 ".parquet, .txt or .arrayrecord, comma-separated")
        _require(not t.eval_every or bool(cfg.data.eval_paths),
                 f"train.eval_every={t.eval_every} with data.source='files' needs data.eval_paths "
                 "(held-out files); or set train.eval_every=0")
        from maxtext_rocm.data.files import check_inputs

        check_inputs(cfg.data, m.vocab_size)  # files exist, are not empty, have the text field
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
    _require(cfg.log.peak_tflops >= 0, f"log.peak_tflops must be >= 0, got {cfg.log.peak_tflops}")
    profile = tuple(cfg.log.profile_steps)
    _require(len(profile) == 2 and all(isinstance(s, int) for s in profile)
             and (profile == (0, 0) or 0 <= profile[0] < profile[1]),
             f"log.profile_steps must be (start, end) with 0 <= start < end, or (0, 0) for off; got {profile}")

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
        shape = mesh_shape(cfg.mesh, device_count, process_count)
        _validate_against_mesh(cfg, shape, device_count)


def _validate_moe(m) -> None:
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
    _require(m.moe_capacity_factor > 0,
             f"model.moe_capacity_factor must be positive, got {m.moe_capacity_factor}")
    for key in ("moe_aux_loss_weight", "moe_router_z_loss_weight"):
        _require(m[key] >= 0, f"model.{key} must be >= 0, got {m[key]}")


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
    _require(scaling["factor"] >= 1, f"model.rope_scaling.factor must be >= 1, got {scaling['factor']}")
    _require(0 < scaling["low_freq_factor"] < scaling["high_freq_factor"],
             "model.rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
             f"{scaling['low_freq_factor']} and {scaling['high_freq_factor']}")
    _require(scaling["original_max_position"] > 0, "model.rope_scaling.original_max_position must be positive")


def mesh_shape(mesh_cfg, device_count: int, process_count: int = 1) -> dict[str, dict[str, int]]:
    """Resolves -1 entries: ICI axes cover the devices of one host, DCN axes the hosts."""
    _require(device_count % process_count == 0,
             f"{device_count} devices do not split evenly over {process_count} processes")
    resolved = {}
    for group, total in (("ici", device_count // process_count), ("dcn", process_count)):
        sizes = dict(mesh_cfg[group])
        known = math.prod(s for s in sizes.values() if s != -1)
        fill = [a for a, s in sizes.items() if s == -1]
        if fill:
            _require(total % known == 0,
                     f"mesh.{group} sizes multiply to {known}, which does not divide the {total} "
                     f"{'devices per host' if group == 'ici' else 'hosts'}, so mesh.{group}.{fill[0]}=-1 cannot fill it")
            sizes[fill[0]] = total // known
        product = math.prod(sizes.values())
        _require(product == total,
                 f"mesh.{group} sizes ({', '.join(f'{a}={s}' for a, s in sizes.items() if s != 1) or 'all 1'}) "
                 f"multiply to {product} but there are {total} "
                 f"{'devices per host' if group == 'ici' else 'hosts (processes)'}; "
                 f"make the product {total} or set one axis to -1")
        resolved[group] = sizes
    return resolved


def axis_sizes(shape: dict[str, dict[str, int]]) -> dict[str, int]:
    """The size of each mesh axis, ICI and DCN together."""
    return {a: shape["ici"][a] * shape["dcn"][a] for a in MESH_AXES}


def global_batch_size(cfg, device_count: int) -> int:
    return cfg.train.per_device_batch_size * device_count


def _validate_against_mesh(cfg, shape, device_count: int) -> None:
    from maxtext_rocm.sharding import check_param_divisibility, mesh_axes_of  # imports jax

    sizes = axis_sizes(shape)
    m, t = cfg.model, cfg.train
    batch = global_batch_size(cfg, device_count)
    batch_axes = mesh_axes_of("activation_batch")
    batch_shards = math.prod(sizes[a] for a in batch_axes)
    _require(batch % t.grad_accum == 0,
             f"the global batch of {batch} sequences (train.per_device_batch_size={t.per_device_batch_size} "
             f"x {device_count} devices) does not split into train.grad_accum={t.grad_accum} micro-batches")
    micro = batch // t.grad_accum
    _require(micro % batch_shards == 0,
             f"each micro-batch of {micro} sequences does not divide over the {batch_shards} batch shards "
             f"(mesh axes {' x '.join(batch_axes)}); raise train.per_device_batch_size or lower train.grad_accum")
    _require(t.seq_len % sizes["sequence"] == 0,
             f"train.seq_len={t.seq_len} does not divide over mesh sequence={sizes['sequence']}")
    problem = check_param_divisibility(m, sizes)
    _require(problem is None, problem or "")
