"""The Llama 3 / 3.1 block and the decoder stack that every model family shares.

The stack (embedding, scanned or unrolled blocks with rematerialisation, final norm, LM head)
knows nothing of the block inside it; Mixtral supplies a block whose MLP is a mixture of experts.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from maxtext_rocm.models.activations import gated
from maxtext_rocm.models.attention import CACHE, Attention
from maxtext_rocm.models.layer_kinds import kinds_differ, layer_kinds
from maxtext_rocm.models.layers import ADAPTERS, EMBED_TABLE_AXES, HEAD_AXES, Dense, Embed, Kernel, RMSNorm, fused_projections
from maxtext_rocm.models.moe import AUX_LOSSES
from maxtext_rocm.numerics.fp8 import FP8_COLLECTION
from maxtext_rocm.numerics.precision import DOT_WITH_BATCH_AXES, DOT_WITHOUT_BATCH_AXES, Policy, without_fp8

Array = jax.Array

# model.remat -> what the backward pass may keep from the forward pass of a block. The CPU's bf16
# matmuls are custom-VJP calls (precision.f32_accumulating_dot_general), kept by their names.
_policies = jax.checkpoint_policies
REMAT_POLICIES = {
    "full": _policies.nothing_saveable,  # keep only the block's input
    # keep projection outputs (dots without batch dimensions), recompute attention scores
    "minimal": _policies.save_from_both_policies(
        _policies.dots_with_no_batch_dims_saveable, _policies.save_only_these_names(DOT_WITHOUT_BATCH_AXES)),
    "save_dots": _policies.save_from_both_policies(  # keep every matmul output
        _policies.dots_saveable, _policies.save_only_these_names(DOT_WITHOUT_BATCH_AXES, DOT_WITH_BATCH_AXES)),
}

BLOCK_OUTPUT_AXES = ("activation_batch", "activation_length", "activation_embed")


class MLP(nn.Module):
    """A gated MLP, down(act(gate(x), up(x))): SwiGLU, GeGLU under activation="gelu_tanh", gpt-oss's
    clamped SwiGLU under "clamped_silu" (models/activations.py)."""

    d_model: int
    mlp_dim: int
    policy: Policy
    fuse: str = "off"  # model.fuse_projections: "on" = gate and up as one dot
    activation: str = "silu"

    @nn.compact
    def __call__(self, x: Array) -> Array:
        shapes = ((self.d_model,), (self.mlp_dim,), ("embed", "mlp"), self.policy)
        if self.policy.dot_general_cls or self.fuse != "on":  # fp8: each weight its own dot and scales
            gate, up = (Dense(*shapes, name=name)(x) for name in ("gate", "up"))
        else:  # one dot, [.., 2, mlp]: one tensor-parallel reduction of x's gradient, not two
            gate_up = fused_projections(x, [Kernel(*shapes, name=n)()[:, None] for n in ("gate", "up")], 0, self.policy)
            gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
        hidden = gated(self.activation, gate, up)
        hidden = nn.with_logical_constraint(hidden, ("activation_batch", "activation_length", "activation_mlp"))
        return Dense((self.mlp_dim,), (self.d_model,), ("mlp", "embed"), self.policy, name="down")(hidden)


class LlamaBlock(nn.Module):
    """Pre-norm attention and a gated MLP, each added to the residual stream; with model.post_norms
    (Gemma 3) each output normed again before its add."""

    cfg: "ml_collections.FrozenConfigDict"  # noqa: F821 - cfg.model
    policy: Policy
    decode: bool = False  # attention keeps a KV cache (generate.py)
    expert_exchange: Callable | None = None  # a Mixtral block's MoE across devices (models/moe.py)
    context_attention: Callable | None = None  # attention over a sequence-split batch (models/attention.py)
    attention_kind: str = ""  # "full" or "sliding" (models/layer_kinds.py); "": model.sliding_window's

    @nn.compact
    def __call__(self, x: Array, positions: Array, segment_ids: Array | None, layer: Array | None = None):
        """`layer`: the block's index where the stack's kinds differ (scanned with the weights;
        it decides the attention's kind); None: `attention_kind`."""
        m = self.cfg
        attention = Attention(m, self.policy, self.decode, self.context_attention, self.attention_kind,
                              name="attention")
        attended = attention(self.norm("attention_norm", x), positions, segment_ids, layer)
        x = x + self.normed("post_attention_norm", attended)
        x = x + self.normed("post_mlp_norm", self.feed_forward()(self.norm("mlp_norm", x)))
        # (carry, per-layer output): the signature nn.scan expects.
        return nn.with_logical_constraint(x, BLOCK_OUTPUT_AXES), None

    def norm(self, name: str, x: Array) -> Array:
        return RMSNorm(self.cfg.norm_eps, self.policy, self.cfg.norm_unit_offset, name=name)(x)

    def normed(self, name: str, out: Array) -> Array:
        """A sublayer's output, normed again under model.post_norms."""
        return self.norm(name, out) if self.cfg.post_norms else out

    def feed_forward(self) -> nn.Module:
        """The block's feed-forward layer: the one thing a Mixtral block changes."""
        m = self.cfg
        return MLP(m.d_model, m.mlp_dim, self.policy, m.fuse_projections, m.mlp_activation, name="mlp")


def scanned_over_layers(module: type[nn.Module], length: int, indexed: bool = False) -> type[nn.Module]:
    """`module` (a block) scanned `length` times: its variables, router losses, fp8 state, KV
    cache and adapters stacked on a leading "layers" axis, each repeat drawing its own
    initialisation and dropout, positions and segments the same for all. `indexed`: each repeat
    also takes its own layer index (a scanned [length] input; kinds_differ)."""
    return nn.scan(module, variable_axes={"params": 0, AUX_LOSSES: 0, FP8_COLLECTION: 0, CACHE: 0, ADAPTERS: 0},
                   split_rngs={"params": True, "dropout": True},
                   in_axes=(nn.broadcast, nn.broadcast) + ((0,) if indexed else ()),
                   length=length, metadata_params={nn.PARTITION_NAME: "layers"})


class TokenEmbedding(NamedTuple):
    """The embedding as a pure function of its table, for a `layer_stack` that looks the tokens up
    itself, where its first layers run: lookup(variables, tokens) -> [.., d_model] embeddings."""

    variables: dict  # the Embed module's own ({"params": {"embedding": [vocab, d_model]}})
    lookup: Callable


class StackLoss(NamedTuple):
    """The step's objective on the final norm's output, for a Decoder whose `layer_stack` runs it
    per microbatch (its `runs_the_loss`: pipeline.schedule="1f1b"). of_rows(head_weight,
    vocab_axis, hidden [b, seq, d], rows) -> (the objective summed over the rows' tokens, {name:
    sums}); `rows` {name: [B, ...]} (targets, weights); of_sown(aux collections) -> the objective's
    share from what the layers sowed, linear in it (the router losses)."""

    rows: dict
    of_rows: Callable
    of_sown: Callable


class Tail(NamedTuple):
    """What follows the stack, as a pure function for a `layer_stack` that runs it per microbatch:
    apply(variables, hidden [b, seq, d], rows) -> (objective, sums), the final norm and a
    StackLoss's of_rows through the LM head; `rows` and `of_sown` are the StackLoss's."""

    variables: dict  # {"final_norm": its params, "head": the head's weight (the table, if tied)}
    rows: dict
    apply: Callable
    of_sown: Callable
    axes: dict  # the logical axes of each of `variables`' leaves


class Decoder(nn.Module):
    """Embedding -> n_layers blocks -> final norm -> LM head. Returns logits [batch, seq, vocab],
    or with `return_hidden` the final norm's output [batch, seq, d_model] for
    maxtext_rocm/numerics/cross_entropy.py, which applies the head itself (see lm_head_weight),
    or with `loss` (a StackLoss, for a layer_stack that runs the loss) (objective, sums)."""

    cfg: "ml_collections.FrozenConfigDict"  # noqa: F821 - cfg.model
    policy: Policy
    block: type[nn.Module] = LlamaBlock
    decode: bool = False  # KV-cache decoding (generate.py): no remat, a "cache" collection per layer
    expert_exchange: Callable | None = None  # handed to the blocks (models/moe.py); None for dense
    # Runs the embedding and the scanned stack across devices (maxtext_rocm/parallel/pipeline/)
    # as layer_stack(stack, scanned, embedding, tokens, positions, segment_ids) -> (x, sown), with
    # `embedding` a TokenEmbedding; None: in order, here. Parameters are created by the embedding
    # and the stack themselves either way, so their tree never depends on it.
    layer_stack: Callable | None = None
    context_attention: Callable | None = None  # handed to the blocks' attention; None: its own

    @nn.compact
    def __call__(self, tokens: Array, positions: Array | None = None,
                 segment_ids: Array | None = None, return_hidden: bool = False, loss: StackLoss | None = None):
        m = self.cfg
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        embed = Embed(m.vocab_size, m.d_model, m.embed_init_std, self.policy, m.scale_embeddings, name="embed")
        stacked_elsewhere = (m.scan_layers and self.layer_stack is not None and not self.decode
                             and not self.is_initializing())
        runs_the_loss = stacked_elsewhere and getattr(self.layer_stack, "runs_the_loss", False)
        if runs_the_loss != (loss is not None):
            raise ValueError("Decoder(loss=...) goes with a layer_stack that runs the loss per microbatch "
                             f"(pipeline.schedule='1f1b'), and only with one; loss given: {loss is not None}")
        if not stacked_elsewhere:
            x = _embedded(embed, tokens)

        block = self.block
        if m.remat != "none" and not self.decode:
            # Under scan the loop boundary already stops XLA from merging recomputation with the
            # forward pass; unrolled layers need prevent_cse.
            block = nn.remat(block, policy=REMAT_POLICIES[m.remat], prevent_cse=not m.scan_layers)
        if m.scan_layers:
            # Router losses sown by MoE layers, fp8 scaling state and a dot strategy's adapters stack
            # over layers like the parameters; each layer draws its own dropout. `length` None: one
            # layer, unscanned, whose variables are one layer's slice of the stack's (a pipeline
            # runs a stack with empty slots a layer at a time: parallel/pipeline/, run_chunk).
            # Where the layers' kinds differ each takes its index too (models/layer_kinds.py): one
            # structure for every layer, so the stack scans, pipelines and converts as Llama's.
            indexed = kinds_differ(m)

            def scanned(length: int | None, **kwargs) -> nn.Module:
                if length is None:
                    return block(m, self.policy, self.decode, self.expert_exchange, self.context_attention, **kwargs)
                return scanned_over_layers(block, length, indexed)(m, self.policy, self.decode, self.expert_exchange,
                                                                   self.context_attention, **kwargs)

            if not stacked_elsewhere:
                index = (jnp.arange(m.n_layers, dtype=jnp.int32),) if indexed else ()
                x, _ = scanned(m.n_layers, name="layers", attention_kind=layer_kinds(m)[0])(
                    x, positions, segment_ids, *index)
            else:
                stack = scanned(m.n_layers, name="layers", attention_kind=layer_kinds(m)[0])
                # The strategy runs the stack's own variables through `scanned` stacks of its
                # choosing (unbound: scanned(length, parent=None)); what their layers sowed comes
                # back as {collection: tree}, kept here beside the stack's (unused) own. The tokens
                # go in unembedded: a strategy that splits the stack over devices looks them up
                # where the first layers run, through the table's variables (a pure function: a
                # bound module cannot be called inside the strategy's jax transforms).
                unbound = Embed(m.vocab_size, m.d_model, m.embed_init_std, self.policy, m.scale_embeddings, parent=None)
                embedding = TokenEmbedding(embed.variables, functools.partial(_looked_up, unbound))
                tail = {} if loss is None else {"tail": self._tail(loss)}
                x, sown = self.layer_stack(stack, scanned, embedding, tokens, positions, segment_ids, **tail)
                for collection, tree in sown.items():
                    if self.is_mutable_collection(collection):
                        self.put_variable(collection, "layers_pipelined", tree)
                if loss is not None:
                    return x  # (objective, sums): the stack ran the final norm, the head and the loss
        else:
            x = self._unrolled(block, range(m.n_layers), x, positions, segment_ids)

        x = RMSNorm(m.norm_eps, self.policy, m.norm_unit_offset, name="final_norm")(x)
        if return_hidden:
            return x
        if m.tie_embeddings:
            logits = embed.attend(x)
        else:
            head_policy = self.policy if self.policy.fp8_lm_head else without_fp8(self.policy)
            logits = Dense((m.d_model,), (m.vocab_size,), HEAD_AXES, head_policy, name="lm_head")(x)
        return nn.with_logical_constraint(logits, ("activation_batch", "activation_length", "activation_vocab"))

    def _unrolled(self, block, layers, x: Array, positions: Array, segment_ids: Array | None) -> Array:
        kinds = layer_kinds(self.cfg)
        for i in layers:
            x, _ = block(self.cfg, self.policy, self.decode, self.expert_exchange, self.context_attention,
                         attention_kind=kinds[i], name=f"layers_{i}")(x, positions, segment_ids)
        return x

    def _tail(self, loss: StackLoss) -> Tail:
        """The final norm, the head and `loss` as one pure function of their variables (read from
        this module's, which apply() was given)."""
        params = self.variables["params"]
        head, vocab_axis = lm_head_weight(params, self.cfg)
        norm = RMSNorm(self.cfg.norm_eps, self.policy, self.cfg.norm_unit_offset, parent=None)

        def apply(variables, hidden, rows):
            normed = norm.apply({"params": variables["final_norm"]}, hidden)
            return loss.of_rows(variables["head"], vocab_axis, normed, rows)
        axes = {"final_norm": {"scale": ("norm",)}, "head": EMBED_TABLE_AXES if vocab_axis == 0 else HEAD_AXES}
        return Tail({"final_norm": params["final_norm"], "head": head}, loss.rows, apply, loss.of_sown, axes)


def _embedded(embed: Embed, tokens: Array) -> Array:
    return nn.with_logical_constraint(embed(tokens), BLOCK_OUTPUT_AXES)


def _looked_up(embed: Embed, variables, tokens: Array) -> Array:
    """A TokenEmbedding's lookup: the unbound `embed` applied through `variables` (the strategy
    decides the table's layout around it)."""
    return _embedded(embed.bind(variables), tokens)


def lm_head_weight(params, cfg) -> tuple[Array, int]:
    """The LM head's weight in `params` and which of its axes is the vocabulary: the tied
    embedding [vocab, d_model] or the head's kernel [d_model, vocab]."""
    if cfg.tie_embeddings:
        return params["embed"]["embedding"], 0
    return params["lm_head"]["kernel"], 1
