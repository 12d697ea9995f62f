"""Precision policies: which dtype the parameters are kept in, which the math runs in, and
which dot_general the dense layers use.

Parameters always stay in fp32 (the optimizer's update is too small for bf16 to hold); the
policy decides the compute dtype. Dense layers take their dot from `Policy.dot_general_cls` so
that an fp8 quantize-dot-dequantize op slots in without touching the models.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from maxtext_rocm import fp8


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str
    compute_dtype: Any
    param_dtype: Any = jnp.float32
    # A Flax module class whose instances are called like lax.dot_general; None means
    # lax.dot_general itself.
    dot_general_cls: Callable[..., Any] | None = None
    fp8_format: str | None = None  # "ocp" or "fnuz" under the fp8 policy
    fp8_lm_head: bool = False  # whether the LM head's matmul goes to fp8 too


_COMPUTE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp8": jnp.bfloat16}


def policy_from_config(precision_cfg, device=None) -> Policy:
    """The policy named by `cfg.precision.policy` (validated by config.validate). For fp8,
    `precision.fp8_format="auto"` is resolved against `device` (default: the first device)."""
    name = precision_cfg.policy
    if name != "fp8":
        return Policy(name, _COMPUTE_DTYPES[name])
    fmt = fp8.resolve_format(precision_cfg.fp8_format, device or jax.devices()[0])
    op = functools.partial(fp8.Fp8DotGeneral, fmt=fmt, scaling=precision_cfg.fp8_scaling,
                           amax_history_len=precision_cfg.amax_history_len)
    return Policy(name, _COMPUTE_DTYPES[name], dot_general_cls=op, fp8_format=fmt,
                  fp8_lm_head=precision_cfg.fp8_lm_head)


def without_fp8(policy: Policy) -> Policy:
    """The same dtypes with a plain dot: for matmuls kept out of fp8 (LM head, router)."""
    return dataclasses.replace(policy, dot_general_cls=None)
