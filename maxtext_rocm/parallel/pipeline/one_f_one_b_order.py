"""The order of pipeline.schedule="1f1b" (parallel/pipeline/one_f_one_b.py) with R = pipeline.repeats
chunks of layers per device: which microbatch and which chunk each stage runs forward and
backward in each iteration of its lockstep loop, and which buffer slot holds a microbatch's
residuals between the two. R = 1 is plain 1F1B; R > 1 interleaved 1F1B. Index arithmetic alone,
on numpy integers (the tests, the planner) or jax ones (the loop's iteration counter), so the
loop and its checks read the same formulas.

Legend (__init__.py's): S stages, R repeats, M microbatches, t the iteration; chunk r of device s
is virtual stage v = r S + s, and a microbatch passes v = 0, 1, ..., S R - 1 in turn.

Forward. Stage s runs its forward pass i = t - s (0 <= i < R M). The passes go in groups of S
microbatches: pass i is microbatch g S + (i mod S) of group g = i // (R S), on chunk
r = (i mod R S) // S. So stage 0 runs a group's S microbatches on chunk 0, then the same S on
chunk 1, and so on: the last stage finishes microbatch m's chunk r in the iteration just before
stage 0 starts its chunk r + 1, and the activations go round the ring (S - 1 -> 0) with no
buffer. This is why M must be a multiple of S when R > 1 (Megatron-LM's interleaved schedule
asks the same); circular's order (microbatch-major, schedules.py) would hold each one M - S
iterations in a buffer and its backward as long.

Backward. The mirror image, R S - 1 iterations behind: stage s runs backward pass
j = t - (R S - 1) - (S - 1 - s), microbatch g S + (j mod S) of group g = j // (R S) on chunk
R - 1 - (j mod R S) // S, and the cotangents go round the ring the other way (0 -> S - 1). The
offset R S - 1 is the least that lets the last virtual stage differentiate microbatch m in the
iteration it finishes its forward (the tail runs between the two), as plain 1F1B does.

Time: forwards in iterations [0, R M + S - 1), backwards in [R S - 1, R M + R S + S - 2), each
1/R of a stage's work, so a step is (M + (S - 1)/R) (F + B): circular's bubble, (S-1)/(R M+S-1).
Memory: microbatch m's chunk r on stage s lives from its forward to its backward,
2 (R - r) S - 2 - 2 s iterations; one buffer per chunk, slot m mod N_r, N_r the least count under
which no two microbatches sharing a slot are live at once (`slots_per_repeat`, brute force over
the order). S = 4, R = 2: N = (8, 4), 12 chunk slots = 6 stages' worth against plain 1F1B's 2S - 1
= 7; about S (1 + 1/R) stages' worth in general.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Work(NamedTuple):
    """One stage's part of an iteration, per stage: the microbatch and chunk (clamped into range
    where there is none, in the bubble), the forward iteration of that (microbatch, chunk) on this
    stage (its residuals' slot and its sown values are indexed by it), and whether it is real."""
    micro: object
    repeat: object
    forward_iteration: object
    real: object


class OneFOneBOrder:
    """The order for `stages` S, `repeats` R, `microbatches` M (module docstring)."""

    def __init__(self, stages: int, repeats: int, microbatches: int):
        if repeats > 1 and microbatches % stages:
            raise ValueError(f"interleaved 1F1B runs microbatches in groups of the {stages} stages; "
                             f"{microbatches} microbatches are not a multiple of them")
        self.stages, self.repeats, self.microbatches = stages, repeats, microbatches
        self.passes = repeats * microbatches
        self.backward_offset = repeats * stages - 1
        self.n_forward_iterations = self.passes + stages - 1
        self.n_iterations = self.passes + self.backward_offset + stages - 1
        self.slots_per_repeat = tuple(self._slots_needed(r) for r in range(repeats))
        self.slot_offsets = tuple(int(o) for o in np.cumsum((0,) + self.slots_per_repeat[:-1]))
        self.n_slots = sum(self.slots_per_repeat)

    # Passes of one stage

    def _unpack(self, index, stage, backward: bool):
        """(microbatch, chunk, forward pass index, real) of forward or backward pass `index`."""
        S, R = self.stages, self.repeats
        real = (index >= 0) & (index < self.passes)
        index = _clip(index, 0, self.passes - 1)
        group, within = index // (R * S), index % (R * S)
        micro = group * S + within % S
        repeat = (R - 1 - within // S) if backward else within // S
        forward_index = group * R * S + repeat * S + within % S
        return micro, repeat, forward_index + stage, real

    def forward(self, t, stage) -> Work:
        """Each stage's forward in iteration `t` (`stage`: the stage ids, broadcast against t)."""
        return Work(*self._unpack(t - stage, stage, backward=False))

    def backward(self, t, stage) -> Work:
        """Each stage's backward in iteration `t`."""
        return Work(*self._unpack(t - self.backward_offset - (self.stages - 1 - stage), stage, backward=True))

    def tail(self, t):
        """(whether the last stage finishes a microbatch's last chunk in iteration `t`, and which):
        the tail runs on it then, and its cotangent starts that microbatch's backward at once."""
        last = self.forward(t, self.stages - 1)
        return last.real & (last.repeat == self.repeats - 1), last.micro

    def slot(self, micro, repeat):
        """The residuals' slot of `micro`'s chunk `repeat`: N_r slots per chunk, one after another."""
        offsets, sizes = (jnp.asarray(a) if isinstance(micro, jax.Array) else np.asarray(a)
                          for a in (self.slot_offsets, self.slots_per_repeat))
        return offsets[repeat] + micro % sizes[repeat]

    # Tables (numpy), for the loop's bookkeeping and the checks

    def forward_table(self) -> Work:
        """[R M + S - 1, S] per field: each forward iteration's work, stage by stage."""
        t, s = np.meshgrid(np.arange(self.n_forward_iterations), np.arange(self.stages), indexing="ij")
        return self.forward(t, s)

    def lifetimes(self, repeat: int, stage: int) -> tuple[np.ndarray, np.ndarray]:
        """(forward iteration, backward iteration) of each microbatch's chunk `repeat` on `stage`."""
        S, R = self.stages, self.repeats
        m = np.arange(self.microbatches)
        group, position = m // S, m % S
        forward = group * R * S + repeat * S + position + stage
        backward = self.backward_offset + group * R * S + (R - 1 - repeat) * S + position + S - 1 - stage
        return forward, backward

    def _slots_needed(self, repeat: int) -> int:
        """N_r: the least slot count under which microbatches m < m' sharing slot m mod N_r never
        overlap on any stage. In an iteration the forward writes its slot before the backward reads
        its own, so m' written in the iteration m is read clashes too."""
        most = 0
        for stage in range(self.stages):
            forward, backward = self.lifetimes(repeat, stage)
            # forward grows with m: every m' > m written by the time m is read clashes with it.
            clashing = np.searchsorted(forward, backward, side="right") - 1  # the last m' with forward <= backward[m]
            most = max(most, int(np.max(clashing - np.arange(self.microbatches))))
        return min(self.microbatches, most + 1)


def _clip(x, lo: int, hi: int):
    return jnp.clip(x, lo, hi) if isinstance(x, jax.Array) else np.clip(x, lo, hi)
