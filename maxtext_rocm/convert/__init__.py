"""Hugging Face <-> maxtext_rocm checkpoints, for the architectures of convert/families.py (Llama,
Mistral, Qwen2/2.5, Qwen3, Gemma 3, Mixtral, Qwen3-MoE, gpt-oss; gpt-oss's published MXFP4
experts are dequantized on import, mxfp4.py, and written back in the precision trained in).

    python -m maxtext_rocm.convert from-hf HF_DIR OUT_DIR [--config.GROUP.KEY=VALUE ...]
    python -m maxtext_rocm.convert to-hf CHECKPOINT_DIR OUT_DIR [--dtype bfloat16] [--max-shard-size 5GB] [--adapter]

`from-hf` writes a params export (`OUT_DIR/params` through orbax, `OUT_DIR/config.json`) that
`checkpoint.load_params_from` starts a run from, plus `OUT_DIR/preset.py`, a preset that does so:
`python -m maxtext_rocm.train OUT_DIR/preset.py`. `to-hf` takes an export, a run directory or one of
its checkpoints and writes safetensors shards, config.json and generation_config.json that
transformers loads; of a LoRA run, the merged model, or with `--adapter` a PEFT adapter for its base
(lora_export.py). Whatever the run, the original's config keys (token ids, context length) and
generation config are kept, found through the export it started from (origin.py).

From Python:

    cfg, params = maxtext_rocm.convert.from_hf("Meta-Llama-3.1-8B", {"precision.policy": "fp32"})
    logits = maxtext_rocm.forward(cfg, params, tokens)
    maxtext_rocm.convert.to_hf(cfg, params, "out_hf")

Memory: the parameters are held once (in fp32, the trainer's parameter dtype) plus one tensor
being read or one shard being written. Nothing is written to OUT_DIR until everything has been
read and checked; the folder appears by a rename at the end, so a failure leaves no half of it
(output.py).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from maxtext_rocm import config as config_lib
from maxtext_rocm.convert import files as files_lib
from maxtext_rocm.convert.families import multimodal_of, text_config
from maxtext_rocm.convert.hf_config import ConvertError, hf_config, model_updates
from maxtext_rocm.convert.mapping import IGNORED, aliases, leaf, plan
from maxtext_rocm.convert.mxfp4 import dequantize, quantized_name
from maxtext_rocm.convert.origin import find_origin, find_record, generation_config, read_generation_config
from maxtext_rocm.convert.output import check_output_dir, written_atomically
from maxtext_rocm.convert.preset import finetune_keys, preset_source, tokenizer_files, validate_without_data

__all__ = ["ConvertError", "from_hf", "hf_to_export", "checkpoint_to_hf", "to_hf"]

DEFAULT_SHARD_SIZE = "5GB"


# ----------------------------------------------------------------------------------------------
# Hugging Face -> ours


def read_hf_config(hf_dir) -> dict[str, Any]:
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ConvertError(f"{hf_dir} is not a directory; give a Hugging Face model folder (config.json + *.safetensors)")
    path = hf_dir / "config.json"
    if not path.is_file():
        raise ConvertError(f"{hf_dir} has no config.json; give a Hugging Face model folder")
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        raise ConvertError(f"{path} is not valid JSON ({error})") from None


def config_from_hf(hf: Mapping[str, Any], where: str, name: str = "converted",
                   overrides: Mapping[str, Any] | Iterable[str] | None = None, hf_dir: Path | None = None):
    """The full run config for a Hugging Face config.json: defaults, its model keys, the keys for
    fine-tuning from `hf_dir` (its tokenizer, its context length, your files: convert/preset.py),
    then overrides. Validated as a run is, except that data.paths may wait for the training command."""
    cfg = config_lib.defaults()
    cfg.name = name
    for key, value in model_updates(hf, where).items():
        config_lib.set_key(cfg, f"model.{key}", value)
    for key, value in (finetune_keys(hf_dir, hf) if hf_dir is not None else {}).items():
        config_lib.set_key(cfg, key, value)
    if isinstance(overrides, Mapping):
        for key, value in overrides.items():
            config_lib.set_key(cfg, key, value)
    elif overrides is not None:
        config_lib.apply_cli_overrides(cfg, list(overrides))
    validate_without_data(cfg)
    return cfg


def _empty_params(cfg) -> dict:
    """Our params tree for cfg, as uninitialised numpy arrays in the parameter dtype."""
    import jax
    from flax import linen as nn

    from maxtext_rocm.models import abstract_params
    from maxtext_rocm.resolve import resolve_here

    shapes = nn.meta.unbox(abstract_params(resolve_here(cfg)))
    return jax.tree_util.tree_map(lambda x: np.empty(x.shape, x.dtype), shapes)


def from_hf(hf_dir, overrides: Mapping[str, Any] | Iterable[str] | None = None, name: str | None = None):
    """(config, params) of a Hugging Face folder of one of families.py's architectures.

    `overrides` ({"model.scan_layers": False, "precision.policy": "fp32"} or command-line strings)
    apply to the config before the weights are read; the params tree follows model.scan_layers.
    """
    hf_dir = Path(hf_dir)
    original = read_hf_config(hf_dir)
    multimodal, hf = multimodal_of(original), text_config(original)
    weight_files = files_lib.weight_files(hf_dir)  # pickles are refused before anything else
    where = str(hf_dir / "config.json")
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", name or hf_dir.resolve().name) or "converted"
    cfg = config_from_hf(hf, where, name, overrides, hf_dir)
    params = _empty_params(cfg)
    m = cfg.model
    slots = {slot.hf_name: slot for slot in plan(m)}
    alias_table = aliases(m)
    filled: set[str] = set()

    def place(name: str, array: np.ndarray, origin: str) -> None:
        slot = slots[name]
        target = leaf(params, slot.path)
        ours = target.shape[len(slot.index):]
        want = slot.hf_shape(ours)
        if tuple(array.shape) != want:
            raise ConvertError(f"tensor {origin} has shape {tuple(array.shape)}, but {where} implies {want}")
        slot.place(params, array)
        filled.add(name)

    quantized: dict[str, dict[str, np.ndarray]] = {}  # MXFP4 tensor -> its blocks and scales read so far

    for name, path, shape, dtype, load in files_lib.tensors(weight_files):
        origin = f"{name} in {path.name}"
        if multimodal is not None:  # the text model's tensors under their text-only names
            if name.startswith(multimodal.skipped):
                continue
            name = name.removeprefix(multimodal.prefix)
        if IGNORED.match(name) or (name == "lm_head.weight" and m.tie_embeddings):
            continue
        part = quantized_name(name)
        if part is not None and part[0] in slots:  # one half of an MXFP4 tensor: placed once both are read
            if dtype != "U8":
                raise ConvertError(f"tensor {origin} is stored as {dtype}; MXFP4 {part[1][1:]} are uint8")
            halves = quantized.setdefault(part[0], {})
            halves[part[1]] = load()
            if len(halves) == 2:
                try:
                    array = dequantize(halves["_blocks"], halves["_scales"])
                except ValueError as error:
                    raise ConvertError(f"tensor {origin}: {error}") from None
                place(part[0], array, f"{part[0]} (MXFP4) in {path.name}")
                del quantized[part[0]]
            continue
        if name not in slots and name not in alias_table:
            raise ConvertError(f"tensor {origin} has no place in a {m.family} model as {where} describes it "
                               f"({m.n_layers} layers{f', {m.n_experts} experts' if m.n_experts > 1 else ''}"
                               f"{', tied embeddings' if m.tie_embeddings else ''})")
        if dtype not in files_lib.FLOAT_DTYPES:
            raise ConvertError(f"tensor {origin} is stored as {dtype}; only float32, float16 and bfloat16 "
                               "weights can be converted (dequantize the checkpoint first)")
        if name in slots:
            slot = slots[name]
            want = slot.hf_shape(leaf(params, slot.path).shape[len(slot.index):])
            if shape != want:  # refused before the tensor is read
                raise ConvertError(f"tensor {origin} has shape {shape}, but {where} implies {want}")
            place(name, load(), origin)
            continue
        want, parts = alias_table[name]
        if shape != want:
            raise ConvertError(f"tensor {origin} has shape {shape}, but {where} implies {want}")
        array = load()
        for published, cut in parts:
            place(published, cut(array), origin)
        del array

    if quantized:
        name, halves = next(iter(quantized.items()))
        other = "_scales" if "_blocks" in halves else "_blocks"
        raise ConvertError(f"tensor {name}{other} is missing from {hf_dir}; its MXFP4 "
                           f"{next(iter(halves))[1:]} are there, and need it")
    missing = [name for name in slots if name not in filled]
    if missing:
        raise ConvertError(f"tensor {missing[0]} is missing from {hf_dir}"
                           + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                           + f"; {where} describes a {m.family} model that needs it")
    return cfg, params


def _quantized(hf: Mapping[str, Any]) -> str | None:
    """The quantization a config.json declares (gpt-oss: "mxfp4"), or None."""
    method = (hf.get("quantization_config") or {}).get("quant_method")
    return str(method) if method else None


def import_note(hf_dir) -> str | None:
    """The line `from-hf` says of a checkpoint whose other towers it leaves out, or whose weights
    it dequantized; None for one imported as it is."""
    hf = read_hf_config(hf_dir)
    multimodal = multimodal_of(hf)
    if multimodal is not None:
        return (f"note: {hf_dir} holds a {hf['architectures'][0]}; its text model was imported (as a "
                f"{multimodal.text_architecture}), not its {' or '.join(p.rstrip('.') for p in multimodal.skipped)}")
    method = _quantized(hf)
    if method:
        return (f"note: {hf_dir}'s {method} weights were dequantized to float32, the precision training keeps; "
                f"to-hf writes them unquantized")
    return None


def export_note(checkpoint_dir, dtype: str | None = None) -> str | None:
    """The line `to-hf` says where the original was quantized: the export holds what was trained,
    in `dtype` (default the original's), not the original's quantized format."""
    record, _ = find_record(Path(checkpoint_dir).absolute())
    original = find_origin(record).hf_config or {}
    method = _quantized(original)
    if not method:
        return None
    dtype = dtype or str(original.get("dtype") or original.get("torch_dtype") or "float32")
    return (f"note: the original's weights were {method}; this export writes them unquantized, as {dtype} "
            f"(training kept them in float32)")


def hf_to_export(hf_dir, out_dir, overrides=None) -> Path:
    """`from-hf`: a params export + config.json + preset.py in out_dir."""
    from maxtext_rocm.checkpoint.params import write_params

    hf_dir, out_dir = Path(hf_dir), Path(out_dir).absolute()
    check_output_dir(out_dir)  # before the (long) read too
    cfg, params = from_hf(hf_dir, overrides, name=out_dir.name)  # its runs go to runs/<OUT_DIR's name>
    with written_atomically(out_dir) as tmp:
        write_params(tmp, params)  # params/ + checksums.json, verified by every reader
        # The original, for `to-hf` of this export and of every run started from it (origin.py).
        record = {"config": cfg.to_dict(), "hf_config": text_config(read_hf_config(hf_dir)),
                  "converted_from": str(hf_dir.resolve()),
                  "generation_config": read_generation_config(hf_dir)}
        (tmp / "config.json").write_text(json.dumps(record, indent=2) + "\n")
        (tmp / "preset.py").write_text(preset_source(cfg, hf_dir.resolve()))
    return out_dir


# ----------------------------------------------------------------------------------------------
# Ours -> Hugging Face


def to_hf(cfg, params, out_dir, *, dtype: str = "float32", max_shard_size: str | int = DEFAULT_SHARD_SIZE,
          hf_base: Mapping[str, Any] | None = None, generation: Mapping[str, Any] | None = None) -> Path:
    """Writes `params` of `cfg` as a Hugging Face folder: safetensors shards (+ index), config.json
    and the tokenizer files beside cfg.data.tokenizer (convert/preset.py), so AutoTokenizer loads it.

    `hf_base` is the original config.json of an imported model, whose other keys (token ids,
    max_position_embeddings, ...) are kept; `generation`, where given, is written as
    generation_config.json (origin.generation_config). Each tensor is cast to `dtype` once, from
    the precision `params` hold.
    """
    from safetensors.numpy import save_file

    import jax

    out_dir = Path(out_dir).absolute()
    np_dtype = files_lib.numpy_dtype(dtype)
    limit = files_lib.parse_size(max_shard_size)
    # First: a model its family's class cannot hold is refused before its tensors are looked at.
    config = hf_config(cfg.model, hf_base, dtype, max_position=cfg.train.seq_len)
    slots = plan(cfg.model)
    params = jax.tree_util.tree_map(np.asarray, params)
    for slot in slots:  # every tensor must be there before anything is written
        try:
            leaf(params, slot.path)[slot.index]
        except (KeyError, IndexError, TypeError):
            raise ConvertError(f"the parameters have no {'.'.join(slot.path)}{list(slot.index) or ''} for "
                               f"{slot.hf_name}; they do not match the config's model") from None
    shapes = [slot.hf_shape(leaf(params, slot.path).shape[len(slot.index):]) for slot in slots]
    shard_of = files_lib.plan_shards([files_lib.nbytes(s, np_dtype) for s in shapes], limit)
    names = files_lib.shard_names(shard_of[-1] + 1)
    with written_atomically(out_dir) as tmp:
        total = 0
        for shard, filename in enumerate(names):
            tensors = {}
            for slot, where in zip(slots, shard_of):
                if where == shard:
                    value = slot.read(params)
                    tensors[slot.hf_name] = np.ascontiguousarray(value.astype(np_dtype))
            total += sum(t.nbytes for t in tensors.values())
            save_file(tensors, str(tmp / filename), metadata={"format": "pt"})
            del tensors
        if len(names) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {slot.hf_name: names[where] for slot, where in zip(slots, shard_of)}}
            (tmp / files_lib.INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if generation:
            (tmp / "generation_config.json").write_text(json.dumps(dict(generation), indent=2) + "\n")
        for path in tokenizer_files(cfg.data.get("tokenizer", "") if "data" in cfg else ""):
            shutil.copyfile(path, tmp / path.name)
    return out_dir


def checkpoint_to_hf(checkpoint_dir, out_dir, *, dtype: str | None = None,
                     max_shard_size: str | int = DEFAULT_SHARD_SIZE, adapter: bool = False) -> Path:
    """`to-hf`: an export, run directory or checkpoint -> a Hugging Face folder. A LoRA run gives
    its merged model, or with `adapter` a PEFT adapter for its base (convert/lora_export.py).

    Full and LoRA runs alike carry the original's config keys and generation config, and dtype
    defaults to the original's, found through the export the run started from (origin.py); a
    model with no Hugging Face origin is written in float32.
    """
    import ml_collections

    from maxtext_rocm.checkpoint import restore_params_to_host
    from maxtext_rocm.convert import lora_export
    from maxtext_rocm.finetune import lora_base

    checkpoint_dir, out_dir = Path(checkpoint_dir).absolute(), Path(out_dir).absolute()
    if not checkpoint_dir.is_dir():
        raise ConvertError(f"{checkpoint_dir} is not a directory; give an export, a run directory or a checkpoint")
    check_output_dir(out_dir)  # before the (long) restore too
    record, _ = find_record(checkpoint_dir)
    cfg = ml_collections.ConfigDict(record["config"])
    origin = find_origin(record)
    is_lora = lora_base.is_lora_run(cfg)
    if adapter and not is_lora:
        raise ConvertError(f"--adapter exports a LoRA run's adapters, and {checkpoint_dir} is not from a LoRA run "
                           "(its lora.rank is 0); leave --adapter out to export its model")
    if dtype is None:
        original = origin.hf_config or {}
        dtype = str(original.get("dtype") or original.get("torch_dtype") or "float32")
    files_lib.numpy_dtype(dtype)  # a bad --dtype fails before the restore
    if adapter:  # PEFT loads the base by the name it records: the original Hugging Face folder, where known
        base_name = str(origin.hf_dir) if origin.hf_dir is not None else lora_base.base_pointer(cfg)
        return lora_export.write_adapter(checkpoint_dir, cfg, out_dir, dtype, base_name)
    generation = generation_config(origin, cfg)
    params = lora_export.merged_params(checkpoint_dir, cfg) if is_lora else restore_params_to_host(checkpoint_dir, cfg)
    return to_hf(cfg, params, out_dir, dtype=dtype, max_shard_size=max_shard_size, hf_base=origin.hf_config,
                 generation=generation)
