"""The order of pipeline.schedule="1f1b" (maxtext_rocm/parallel/pipeline/one_f_one_b_order.py), plain
and interleaved, checked by simulating its lockstep loop in numpy: every microbatch passes every
virtual stage forward and back exactly once, each pass's input is what the previous iteration
sent one step round the ring, and the residuals' slots never hand a backward another pass's."""

import numpy as np
import pytest

from maxtext_rocm.parallel.pipeline import bubble_fraction
from maxtext_rocm.parallel.pipeline.one_f_one_b_order import OneFOneBOrder

SHAPES = [(2, 1, 2), (4, 1, 3), (4, 1, 8), (2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 2, 12), (8, 2, 16),
          (8, 4, 32), (3, 3, 6)]


def _runs(order: OneFOneBOrder):
    """{(microbatch, virtual stage): iteration} of every real forward and backward pass."""
    S = order.stages
    forward, backward = {}, {}
    for t in range(order.n_iterations):
        for s in range(S):
            for runs, work in ((forward, order.forward(t, s)), (backward, order.backward(t, s))):
                if work.real:
                    key = (int(work.micro), int(work.repeat) * S + s)
                    assert key not in runs, f"{key} runs twice"
                    runs[key] = t
    return forward, backward


@pytest.mark.parametrize("stages, repeats, microbatches", SHAPES)
def test_every_pass_runs_once_after_the_one_it_depends_on(stages, repeats, microbatches):
    order = OneFOneBOrder(stages, repeats, microbatches)
    forward, backward = _runs(order)
    virtual = stages * repeats
    every = {(m, v) for m in range(microbatches) for v in range(virtual)}
    assert set(forward) == every and set(backward) == every
    for m in range(microbatches):
        # The input of virtual stage v is v - 1's output of the iteration before (one permute).
        assert all(forward[m, v] == forward[m, v - 1] + 1 for v in range(1, virtual))
        # The last virtual stage differentiates in the iteration its forward (and the tail) ran.
        assert backward[m, virtual - 1] == forward[m, virtual - 1]
        tail_runs, tail_micro = order.tail(forward[m, virtual - 1])
        assert tail_runs and tail_micro == m
        assert all(backward[m, v] == backward[m, v + 1] + 1 for v in range(virtual - 1))
    # The tail runs once per microbatch, nowhere else.
    assert sum(bool(order.tail(t)[0]) for t in range(order.n_iterations)) == microbatches
    assert max(forward.values()) == order.n_forward_iterations - 1
    assert max(backward.values()) == order.n_iterations - 1


@pytest.mark.parametrize("stages, repeats, microbatches", SHAPES)
def test_slots_hold_each_pass_until_its_backward(stages, repeats, microbatches):
    """Within an iteration the forward writes its slot before the backward reads its own."""
    order = OneFOneBOrder(stages, repeats, microbatches)
    buffers = np.full((stages, order.n_slots), -1)
    for t in range(order.n_iterations):
        for s in range(stages):
            work = order.forward(t, s)
            if work.real:
                buffers[s, order.slot(work.micro, work.repeat)] = work.micro * repeats + work.repeat
        for s in range(stages):
            work = order.backward(t, s)
            if work.real:
                assert buffers[s, order.slot(work.micro, work.repeat)] == work.micro * repeats + work.repeat
                assert work.forward_iteration == s + _forward_index(order, work.micro, work.repeat)


def _forward_index(order, micro, repeat):
    """The forward pass index of (micro, repeat), searched for, not computed."""
    for i in range(order.passes):
        work = order.forward(i, 0)
        if work.micro == micro and work.repeat == repeat:
            return i
    raise AssertionError


@pytest.mark.parametrize("stages, microbatches", [(2, 2), (4, 3), (4, 8), (8, 32)])
def test_one_repeat_is_plain_1f1b(stages, microbatches):
    """Stage s: forward of microbatch t - s, backward of t - (2S - 2 - s), min(2S - 1, M) slots,
    M + 2S - 2 iterations."""
    order = OneFOneBOrder(stages, 1, microbatches)
    assert order.n_slots == min(2 * stages - 1, microbatches)
    assert order.n_iterations == microbatches + 2 * stages - 2
    for t in range(order.n_iterations):
        for s in range(stages):
            forward, backward = order.forward(t, s), order.backward(t, s)
            assert bool(forward.real) == (0 <= t - s < microbatches)
            assert bool(backward.real) == (0 <= t - (2 * stages - 2 - s) < microbatches)
            if forward.real:
                assert forward.micro == t - s
            if backward.real:
                assert backward.micro == t - (2 * stages - 2 - s)


@pytest.mark.parametrize("stages, repeats, microbatches", [(4, 2, 8), (8, 2, 32), (8, 4, 32)])
def test_interleaving_shortens_the_bubble_and_holds_no_more_than_plain_1f1b(stages, repeats, microbatches):
    """Iterations with a forward or a backward, each 1/R of a stage's work: (R M + S - 1) of each,
    so the step is (M + (S-1)/R) (F + B), circular's bubble; the slots hold at most plain 1F1B's
    2S - 1 stages' worth of residuals."""
    order = OneFOneBOrder(stages, repeats, microbatches)
    assert order.n_forward_iterations == repeats * microbatches + stages - 1
    assert order.n_iterations - order.backward_offset == repeats * microbatches + stages - 1
    per_stage_time = order.n_forward_iterations / repeats  # in units of a stage's forward (and backward)
    busy = microbatches
    assert np.isclose(1 - busy / per_stage_time, bubble_fraction("1f1b", stages, microbatches, repeats))
    assert bubble_fraction("1f1b", stages, microbatches, repeats) < bubble_fraction("1f1b", stages, microbatches)
    assert order.n_slots / repeats <= 2 * stages - 1
    if (stages, repeats) == (4, 2):
        assert order.slots_per_repeat == (8, 4)  # 6 stages' worth against plain 1F1B's 7


def test_interleaving_needs_whole_groups_of_stages():
    with pytest.raises(ValueError, match="6 microbatches are not a multiple of them"):
        OneFOneBOrder(4, 2, 6)
