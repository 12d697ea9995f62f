"""Precision policies: which dtype the parameters are kept in, which the math runs in, and
which dot_general the dense layers use.

Parameters always stay in fp32 (the optimizer's update is too small for bf16 to hold); the
policy decides the compute dtype. Dense layers take their dot from `Policy.dot_general_cls` so
that an fp8 quantize-dot-dequantize op slots in without touching the models.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str
    compute_dtype: Any
    param_dtype: Any = jnp.float32
    # A Flax module class whose instances are called like lax.dot_general; None means
    # lax.dot_general itself.
    dot_general_cls: Callable[..., Any] | None = None


_POLICIES = {
    "fp32": Policy("fp32", jnp.float32),
    "bf16": Policy("bf16", jnp.bfloat16),
}


def policy_from_config(precision_cfg) -> Policy:
    """The policy named by `cfg.precision.policy` (validated by config.validate)."""
    return _POLICIES[precision_cfg.policy]
