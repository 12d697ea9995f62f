"""Hugging Face's attention settings <-> cfg.model: the rotary embedding (rope_theta, rope_scaling or
transformers 5's rope_parameters, per layer type where layers differ) and which layers attend
within a window (sliding_window, layer_types, Gemma's older sliding_window_pattern).

Published checkpoints say `rope_theta` + `rope_scaling` (Llama 3.1: `rope_type: "llama3"`; Gemma 3:
`"linear"` on its full layers, `rope_local_base_freq` on its sliding ones); files written by
transformers 5 say `rope_parameters`, per layer type for Gemma 3. Every spelling is read; export
writes the one the original used.
"""

from __future__ import annotations

from typing import Any, Mapping

from maxtext_rocm.errors import UserError

# Our rope_scaling keys -> Hugging Face's "llama3" rope keys.
ROPE_KEYS = {"factor": "factor", "low_freq_factor": "low_freq_factor",
             "high_freq_factor": "high_freq_factor", "original_max_position": "original_max_position_embeddings"}
# Our rope_yarn keys -> Hugging Face's "yarn" rope keys (transformers' defaults where a file leaves
# one out: beta_fast 32, beta_slow 1, truncate true, the attention factor from the factor).
YARN_KEYS = {"factor": "factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
             "original_max_position": "original_max_position_embeddings", "truncate": "truncate",
             "attention_factor": "attention_factor"}
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True, "attention_factor": None}
KINDS = {"full_attention": "full", "sliding_attention": "sliding"}


class ConvertError(UserError):
    """A Hugging Face folder or a checkpoint that cannot be converted."""


def rope_keys(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """rope_theta, rope_scaling (Llama 3.1's) or rope_linear_factor, and rope_local_theta."""
    params = hf.get("rope_parameters")
    per_type = isinstance(params, Mapping) and "full_attention" in params
    full = params["full_attention"] if per_type else params
    scaling = dict(full) if isinstance(full, Mapping) else dict(hf.get("rope_scaling") or {})
    keys = {"rope_theta": float(scaling.get("rope_theta", hf.get("rope_theta", 10000.0))), "rope_scaling": None,
            "rope_linear_factor": 1.0, "rope_yarn": None}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        keys["rope_linear_factor"] = float(scaling["factor"])
    elif kind == "llama3":
        missing = [k for k in ROPE_KEYS.values() if k not in scaling]
        if missing:
            raise ConvertError(f"{where} has llama3 rope scaling without {', '.join(missing)}")
        keys["rope_scaling"] = {ours: float(scaling[theirs]) if ours != "original_max_position" else
                                int(scaling[theirs]) for ours, theirs in ROPE_KEYS.items()}
    elif kind == "yarn":
        keys["rope_yarn"] = _yarn(scaling, where)
    elif kind != "default":
        raise ConvertError(f"{where} asks for rope_type {kind!r}; only 'default', 'linear', Llama 3.1's "
                           "'llama3' and 'yarn' frequency scaling are supported")
    local = params.get("sliding_attention") if per_type else None
    if isinstance(local, Mapping) and local.get("rope_type", "default") != "default":
        raise ConvertError(f"{where} asks for rope_type {local['rope_type']!r} on its sliding layers; only "
                           "'default' is supported there")
    theta = local.get("rope_theta") if isinstance(local, Mapping) else hf.get("rope_local_base_freq")
    keys["rope_local_theta"] = None if theta is None else float(theta)
    return keys


def _yarn(scaling: Mapping[str, Any], where: str) -> dict[str, Any]:
    """model.rope_yarn from Hugging Face's yarn rope keys; DeepSeek's mscale variant is refused."""
    for key in ("mscale", "mscale_all_dim"):
        if scaling.get(key):
            raise ConvertError(f"{where} sets yarn's {key}={scaling[key]!r}, which is not supported; only the "
                               "attention factor (given, or 0.1 ln(factor) + 1) is")
    missing = [theirs for theirs in ("factor", "original_max_position_embeddings") if scaling.get(theirs) is None]
    if missing:
        raise ConvertError(f"{where} has yarn rope scaling without {', '.join(missing)}")
    yarn = {ours: scaling.get(theirs, YARN_DEFAULTS.get(ours)) for ours, theirs in YARN_KEYS.items()}
    yarn.update(factor=float(yarn["factor"]), beta_fast=float(yarn["beta_fast"] or 32.0),
                beta_slow=float(yarn["beta_slow"] or 1.0), original_max_position=int(yarn["original_max_position"]),
                truncate=bool(yarn["truncate"]))
    if yarn["attention_factor"] is not None:
        yarn["attention_factor"] = float(yarn["attention_factor"])
    return yarn


def _their_yarn(yarn) -> dict[str, Any]:
    out = {"rope_type": "yarn", **{theirs: yarn[ours] for ours, theirs in YARN_KEYS.items()}}
    if out["attention_factor"] is None:
        del out["attention_factor"]
    return out


def write_rope(m, out: dict) -> None:
    """The rope settings of `m` into config.json `out`, in the spelling `out` (the original) uses."""
    if m.rope_scaling is not None:
        scaling = {"rope_type": "llama3", **{theirs: m.rope_scaling[ours] for ours, theirs in ROPE_KEYS.items()}}
    elif m.rope_yarn is not None:
        scaling = _their_yarn(m.rope_yarn)
    elif m.rope_linear_factor != 1:
        scaling = {"rope_type": "linear", "factor": m.rope_linear_factor}
    else:
        scaling = None
    local = m.rope_local_theta
    if "rope_parameters" in out:  # transformers 5's spelling, per layer type where the original had it
        full = {"rope_theta": m.rope_theta, **(scaling or {"rope_type": "default"})}
        per_type = isinstance(out["rope_parameters"], Mapping) and "full_attention" in out["rope_parameters"]
        if per_type or local is not None:
            out["rope_parameters"] = {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": m.rope_theta if local is None else local}}
        else:
            out["rope_parameters"] = full
        for stale in ("rope_scaling", "rope_theta", "rope_local_base_freq"):
            out.pop(stale, None)
    else:  # the published spelling, which transformers 4 and 5 both read
        out.update(rope_theta=m.rope_theta, rope_scaling=scaling)
        if local is not None:
            out["rope_local_base_freq"] = local


def window_keys(hf: Mapping[str, Any], n_layers: int, windowed: bool, layered: bool,
                where: str) -> dict[str, Any]:
    """sliding_window and attention_kinds: one window on every layer (Mistral), a repeating
    pattern of kinds where the family has one (Gemma 3's layer_types, or its older
    sliding_window_pattern), or none. A window on some layers only is refused elsewhere."""
    if hf.get("use_sliding_window"):
        raise ConvertError(f"{where} sets use_sliding_window=true (a window on the layers from max_window_layers "
                           "on), which is not supported yet")
    types = hf.get("layer_types")
    if types is None and layered and hf.get("sliding_window_pattern"):
        every = int(hf["sliding_window_pattern"])
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
    unknown = sorted(set(types or []) - set(KINDS))
    if unknown:
        raise ConvertError(f"{where} has layer_types {unknown}; only {', '.join(KINDS)} are supported")
    kinds = [KINDS[t] for t in types or []]
    if len(set(kinds)) > 1 and not layered:
        raise ConvertError(f"{where} mixes layer_types {sorted(set(types))}; layers of different attention kinds "
                           "are not supported yet")
    window = int(hf.get("sliding_window") or 0) if windowed else 0
    if len(set(kinds)) <= 1:  # every layer alike
        full = kinds[:1] == ["full"]
        return {"sliding_window": 0 if full else window, "attention_kinds": ()}
    unit = next(kinds[:p] for p in range(1, n_layers + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))
    return {"sliding_window": window, "attention_kinds": tuple(unit)}


def write_windows(m, out: dict, windowed: bool) -> None:
    """sliding_window and layer_types of `m` into config.json `out`."""
    from maxtext_rocm.models.layer_kinds import layer_kinds

    if not windowed:
        if "layer_types" in out:
            out["layer_types"] = ["full_attention"] * m.n_layers
        return
    out["sliding_window"] = m.sliding_window or None
    if "layer_types" in out or m.attention_kinds:
        out["layer_types"] = [f"{kind}_attention" for kind in layer_kinds(m)]
        out.pop("sliding_window_pattern", None)
