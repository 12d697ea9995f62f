"""Reading and writing safetensors folders the way Hugging Face lays them out.

Only safetensors are read: a PyTorch pickle (`*.bin`, `*.pt`) can run arbitrary code when
loaded, so such folders are refused. Tensors are read one at a time from memory-mapped files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator

import numpy as np

from maxtext_rocm.convert.hf_config import ConvertError

INDEX = "model.safetensors.index.json"
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64}


def weight_files(hf_dir: Path) -> list[Path]:
    """The safetensors files of a model folder: those its index names, or every *.safetensors."""
    index = hf_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise ConvertError(f"{index} is not a safetensors index (a JSON object with a 'weight_map')") from None
        files = [hf_dir / name for name in dict.fromkeys(weight_map.values())]
        for path in files:
            if not path.is_file():
                raise ConvertError(f"{index} lists {path.name}, which is not in {hf_dir}")
        return files
    files = sorted(hf_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for pattern in PICKLES for p in hf_dir.glob(pattern))
    if pickles:
        raise ConvertError(
            f"{hf_dir} holds PyTorch pickles ({', '.join(pickles[:3])}) but no safetensors; weights load only "
            "from safetensors, because unpickling a file can run arbitrary code (re-save the model with "
            "transformers' save_pretrained, which writes safetensors)")
    raise ConvertError(f"{hf_dir} holds no *.safetensors weight files")


def tensors(files: list[Path]) -> Iterator[tuple[str, Path, tuple[int, ...], str, callable]]:
    """(name, file, shape, dtype, load) for every tensor, one file open at a time; `load()` reads
    that one tensor (as numpy; bfloat16 through ml_dtypes)."""
    from safetensors import safe_open

    seen: dict[str, Path] = {}
    for path in files:
        try:
            handle = safe_open(str(path), framework="np")
        except Exception as error:  # noqa: BLE001 - safetensors raises its own error types
            raise ConvertError(f"{path} is not a readable safetensors file ({error})") from None
        with handle:
            for name in handle.keys():
                if name in seen:
                    raise ConvertError(f"tensor {name} appears in both {seen[name].name} and {path.name}")
                seen[name] = path
                view = handle.get_slice(name)
                yield name, path, tuple(view.get_shape()), view.get_dtype(), (lambda n=name: handle.get_tensor(n))


def plan_shards(sizes: list[int], max_bytes: int) -> list[int]:
    """The shard number of each tensor: consecutive tensors fill a shard up to max_bytes."""
    shard, used, out = 0, 0, []
    for size in sizes:
        if used and used + size > max_bytes:
            shard, used = shard + 1, 0
        out.append(shard)
        used += size
    return out


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def numpy_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    if name not in NUMPY_DTYPES:
        raise ConvertError(f"dtype {name!r} is not one of bfloat16, float16, float32")
    return NUMPY_DTYPES[name]


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '20KB' or a number of bytes."""
    if isinstance(text, int):
        return text
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    upper = text.strip().upper()
    for unit, scale in sorted(units.items(), key=lambda u: -len(u[0])):
        if upper.endswith(unit):
            try:
                return int(float(upper[:-len(unit)]) * scale)
            except ValueError:
                break
    if upper.isdigit():
        return int(upper)
    raise ConvertError(f"shard size {text!r} is not a size such as 5GB, 500MB or 20KB")


def nbytes(shape, dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize
