"""Which Hugging Face tensor fills which slice of which of our parameters, and how.

Our dense kernels are shaped `in_shape + out_shape` (q: [d_model, heads, head_dim], o: [heads,
head_dim, d_model]); a torch Linear weight is [out, in]. So every projection converts the same
way: flatten our input and output axes and transpose. No permutation of q/k is needed, because
our rotary embedding pairs dimension i with i + head_dim/2, as transformers' `rotate_half` does
(tests/test_convert.py proves it against transformers' logits).

Scanned stacks hold every layer in one array with a leading layers axis (`params["layers"]`);
unrolled ones hold `params["layers_{i}"]`. A mixture's experts are stacked on an expert axis
([n_experts, d_model, mlp]); on disk they are one tensor per expert (Mixtral's
`block_sparse_moe.experts.{e}.w1`: gate, `w3`: up, `w2`: down; Qwen3-MoE's
`mlp.experts.{e}.gate_proj`, `up_proj`, `down_proj`), or, as transformers 5 holds both in memory,
fused (`mlp.experts.gate_up_proj` [E, 2 x mlp, d_model] with gate first, `mlp.experts.down_proj`
[E, d_model, mlp]). Qwen2's q/k/v biases are [heads x head_dim] on disk, [heads, head_dim] here;
Qwen3's q/k norms are one [head_dim] scale each. gpt-oss publishes its experts stacked and laid out
as ours ([E, in, out], `mlp.experts.gate_up_proj`, `down_proj`, each with a bias), except that gate
and up share one tensor, interleaved along its last axis (gate in the even columns, up in the odd:
a Slot `interleaved_with` the up leaf); its published MXFP4 experts are dequantized on import
(mxfp4.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

import numpy as np

from maxtext_rocm.config.choices import feed_forward_dim


@dataclasses.dataclass(frozen=True)
class Slot:
    """One Hugging Face tensor (under its published name) and where it lives in our params."""

    hf_name: str
    path: tuple[str, ...]  # keys into our params tree
    index: tuple[int, ...]  # leading indices into that leaf: the layer if scanned, then the expert
    # a Dense kernel's number of input axes; None: same layout on both sides; 0: a bias, whose
    # output axes ([heads, head_dim]) are one axis on disk
    n_in: int | None
    # the leaf whose values fill the odd columns of the tensor's last axis, this slot's the even
    # ones (gpt-oss's gate_up_proj); None: the tensor is this slot's leaf alone
    interleaved_with: tuple[str, ...] | None = None

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        """The torch shape of this tensor, given the shape of our slice."""
        if self.interleaved_with is not None:
            return (*ours[:-1], 2 * ours[-1])
        if self.n_in is None:
            return tuple(ours)
        if self.n_in == 0:
            return (math.prod(ours),)
        return (math.prod(ours[self.n_in:]), math.prod(ours[:self.n_in]))

    def to_ours(self, array: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
        if self.n_in is None:
            return array
        return array.reshape(ours) if self.n_in == 0 else array.T.reshape(ours)

    def place(self, params, array: np.ndarray) -> None:
        """Writes the Hugging Face tensor `array` into its leaf (or leaves) of `params`."""
        target = leaf(params, self.path)
        if self.interleaved_with is None:
            target[self.index] = self.to_ours(np.asarray(array, dtype=target.dtype), target.shape[len(self.index):])
            return
        target[self.index] = array[..., 0::2]
        leaf(params, self.interleaved_with)[self.index] = array[..., 1::2]

    def read(self, params) -> np.ndarray:
        """The Hugging Face tensor of this slot, from `params`."""
        value = leaf(params, self.path)[self.index]
        if self.interleaved_with is None:
            return self.to_hf(value)
        out = np.empty((*value.shape[:-1], 2 * value.shape[-1]), value.dtype)
        out[..., 0::2], out[..., 1::2] = value, leaf(params, self.interleaved_with)[self.index]
        return out

    def to_hf(self, value: np.ndarray) -> np.ndarray:
        if self.n_in is None:
            return value
        if self.n_in == 0:
            return value.reshape(-1)
        return value.reshape(math.prod(value.shape[:self.n_in]), -1).T


# Per layer: Hugging Face suffix -> (our path inside the layer, input axes of the kernel).
ATTENTION = {
    "self_attn.q_proj.weight": (("attention", "q", "kernel"), 1),
    "self_attn.k_proj.weight": (("attention", "k", "kernel"), 1),
    "self_attn.v_proj.weight": (("attention", "v", "kernel"), 1),
    "self_attn.o_proj.weight": (("attention", "o", "kernel"), 2),
    "input_layernorm.weight": (("attention_norm", "scale"), None),
    "post_attention_layernorm.weight": (("mlp_norm", "scale"), None),
}
DENSE_MLP = {
    "mlp.gate_proj.weight": (("mlp", "gate", "kernel"), 1),
    "mlp.up_proj.weight": (("mlp", "up", "kernel"), 1),
    "mlp.down_proj.weight": (("mlp", "down", "kernel"), 1),
}
# Gemma 3's four norms: its post_attention_layernorm is the attention output's, not the MLP input's.
SANDWICH_NORMS = {
    "input_layernorm.weight": (("attention_norm", "scale"), None),
    "post_attention_layernorm.weight": (("post_attention_norm", "scale"), None),
    "pre_feedforward_layernorm.weight": (("mlp_norm", "scale"), None),
    "post_feedforward_layernorm.weight": (("post_mlp_norm", "scale"), None),
}
QKV_BIAS = {f"self_attn.{p}_proj.bias": (("attention", f"{p}_bias"), 0) for p in "qkv"}  # Qwen2
QK_NORM = {f"self_attn.{p}_norm.weight": (("attention", f"{p}_norm", "scale"), None) for p in "qk"}  # Qwen3
OUT_BIAS = {"self_attn.o_proj.bias": (("attention", "o_bias"), None)}  # gpt-oss
SINKS = {"self_attn.sinks": (("attention", "sinks"), None)}  # gpt-oss
# gpt-oss's mixture: the router with its bias, the experts stacked, gate and up interleaved in one
# tensor (suffix -> (our path, n_in, the path interleaved with it)).
STACKED_EXPERTS = {
    "mlp.router.weight": (("moe", "router", "kernel"), 1, None),
    "mlp.router.bias": (("moe", "router_bias"), None, None),
    "mlp.experts.gate_up_proj": (("moe", "gate"), None, ("moe", "up")),
    "mlp.experts.gate_up_proj_bias": (("moe", "gate_bias"), None, ("moe", "up_bias")),
    "mlp.experts.down_proj": (("moe", "down"), None, None),
    "mlp.experts.down_proj_bias": (("moe", "down_bias"), None, None),
}


@dataclasses.dataclass(frozen=True)
class Experts:
    """A mixture's published tensor names: its router's, and each expert's prefix and weights
    (published suffix -> our gate, up or down)."""

    router: str
    prefix: str
    weights: dict


EXPERTS = {
    "mixtral": Experts("block_sparse_moe.gate.weight", "block_sparse_moe.experts",
                       {"w1": ("moe", "gate"), "w3": ("moe", "up"), "w2": ("moe", "down")}),
    "qwen3_moe": Experts("mlp.gate.weight", "mlp.experts",
                         {"gate_proj": ("moe", "gate"), "up_proj": ("moe", "up"), "down_proj": ("moe", "down")}),
}
# Tensors some files carry that hold nothing to convert (old Llama checkpoints saved rotary tables).
IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def layer_path(m, i: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Where layer i's variables are: a slice of the scanned stack (whatever its layers' kinds:
    models/layer_kinds.py), or an unrolled layer's."""
    if not m.scan_layers:
        return (f"layers_{i}",), ()
    return ("layers",), (i,)


def plan(m) -> list[Slot]:
    """Every tensor of a Hugging Face checkpoint of `cfg.model`, in the order files list them."""
    slots = [Slot("model.embed_tokens.weight", ("embed", "embedding"), (), None)]
    attention = {k: v for k, v in ATTENTION.items() if not k.endswith("layernorm.weight")} if m.post_norms else ATTENTION
    per_layer = {**attention, **(SANDWICH_NORMS if m.post_norms else {}), **(QKV_BIAS if m.qkv_bias else {}),
                 **(QK_NORM if m.qk_norm else {}), **(OUT_BIAS if m.out_bias else {}),
                 **(SINKS if m.attention_sinks else {})}
    for i in range(m.n_layers):
        base, index = layer_path(m, i)
        prefix = f"model.layers.{i}."
        for suffix, (path, n_in) in per_layer.items():
            slots.append(Slot(prefix + suffix, base + path, index, n_in))
        if m.family == "gpt_oss":
            for suffix, (path, n_in, partner) in STACKED_EXPERTS.items():
                slots.append(Slot(prefix + suffix, base + path, index, n_in, partner and base + partner))
        elif m.family in EXPERTS:
            experts = EXPERTS[m.family]
            slots.append(Slot(prefix + experts.router, base + ("moe", "router", "kernel"), index, 1))
            for e in range(m.n_experts):
                for w, path in experts.weights.items():
                    slots.append(Slot(f"{prefix}{experts.prefix}.{e}.{w}.weight", base + path, index + (e,), 1))
        else:
            for suffix, (path, n_in) in DENSE_MLP.items():
                slots.append(Slot(prefix + suffix, base + path, index, n_in))
    slots.append(Slot("model.norm.weight", ("final_norm", "scale"), (), None))
    if not m.tie_embeddings:
        slots.append(Slot("lm_head.weight", ("lm_head", "kernel"), (), 1))
    return slots


Extract = Callable[[np.ndarray], np.ndarray]


def aliases(m) -> dict[str, tuple[tuple[int, ...], list[tuple[str, Extract]]]]:
    """Other names for the same tensors: transformers 5's in-memory layout of a mixture's experts
    (Mixtral's and Qwen3-MoE's alike).

    alias -> (its torch shape, [(published name, the published tensor cut out of it)]).
    """
    if m.family not in EXPERTS:
        return {}
    experts = EXPERTS[m.family]
    gate, up, down = experts.weights  # the published suffixes, in that order
    f, d, n = feed_forward_dim(m), m.d_model, m.n_experts
    table = {}
    for i in range(m.n_layers):
        prefix = f"model.layers.{i}."
        if experts.router != "mlp.gate.weight":
            table[prefix + "mlp.gate.weight"] = ((n, d), [(prefix + experts.router, lambda a: a)])
        published = f"{prefix}{experts.prefix}."
        table[prefix + "mlp.experts.gate_up_proj"] = ((n, 2 * f, d), [
            (f"{published}{e}.{w}.weight", (lambda a, e=e, lo=lo: a[e, lo:lo + f]))
            for e in range(n) for w, lo in ((gate, 0), (up, f))])
        table[prefix + "mlp.experts.down_proj"] = ((n, d, f), [
            (f"{published}{e}.{down}.weight", (lambda a, e=e: a[e])) for e in range(n)])
    return table


def leaf(params, path: tuple[str, ...]):
    for key in path:
        params = params[key]
    return params
