"""The step's tail interleaved with its backward pass (every update right after the gradients it
reads), or kept after it and grouped by layer, in an order that computes the same values."""

from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from oocjax.schedule.reorder import updates_by_layer, updates_early


def reads_before_use(order, reads, writes, inputs) -> bool:
    defined = set(inputs)
    for k in order:
        if not set(reads[k]) <= defined:
            return False
        defined |= set(writes[k])
    return True


def backward_then_updates(layers: int, *, global_norm: bool = False):
    """A forward and a backward pass over ``layers`` layers, then one update per layer; with
    ``global_norm``, every update also reads the norm of all gradients. Buffers: 0 the batch,
    100 + i layer i's parameter, 200 + i its moment; the rest numbered as made."""
    reads, writes, fresh = [], [], iter(range(1000, 10**6))
    x = 0
    activations = []
    for i in range(layers):
        y = next(fresh)
        reads.append([x, 100 + i]), writes.append([y])
        activations.append(x)
        x = y
    backward_start = len(reads)
    g, grads = x, {}
    for i in reversed(range(layers)):
        dg, dw = next(fresh), next(fresh)
        reads.append([g, activations[i], 100 + i]), writes.append([dg, dw])
        grads[i], g = dw, dg
    tail_start = len(reads)
    count = next(fresh)
    reads.append([2]), writes.append([count])  # the step count: reads no gradient
    norm = None
    if global_norm:
        norm = next(fresh)
        reads.append(list(grads.values())), writes.append([norm])
    for i in range(layers):
        decay, update = next(fresh), next(fresh)
        reads.append([100 + i]), writes.append([decay])  # weight decay: reads no gradient
        reads.append([grads[i], 200 + i, decay, count] + ([norm] if norm else [])), writes.append([update])
    return reads, writes, tail_start, backward_start


def test_each_layers_update_follows_its_gradient_and_what_reads_no_gradient_goes_right_before_its_user():
    reads, writes, tail, backward = backward_then_updates(3)
    order = updates_early(reads, writes, tail, backward)
    assert reads_before_use(order, reads, writes, [0, 2, 100, 101, 102, 200, 201, 202])
    # Forward (0-2); layer 2's backward (3), the step count (6), layer 2's decay and update (11, 12);
    # layer 1's backward (4), decay and update (9, 10); layer 0's (5, 7, 8).
    assert order == [0, 1, 2, 3, 6, 11, 12, 4, 9, 10, 5, 7, 8]


def test_with_a_global_norm_every_update_waits_for_the_last_gradient():
    reads, writes, tail, backward = backward_then_updates(3, global_norm=True)
    order = updates_early(reads, writes, tail, backward)
    assert order[:tail] == list(range(tail))  # nothing moves into the backward pass
    assert reads_before_use(order, reads, writes, [0, 2, 100, 101, 102, 200, 201, 202])


def test_grouped_by_layer_each_layers_decay_and_update_come_together_after_the_backward_pass():
    reads, writes, tail, backward = backward_then_updates(3)
    layers = [(3, 4), (4, 5), (5, 6)]  # the backward's layers: layer 2's, then 1's, then 0's
    order = updates_by_layer(reads, writes, tail, backward, layers)
    assert reads_before_use(order, reads, writes, [0, 2, 100, 101, 102, 200, 201, 202])
    # Nothing moves into the backward pass; then the step count (6, before its first user) with layer
    # 2's decay and update (11, 12), layer 1's (9, 10), layer 0's (7, 8).
    assert order == [0, 1, 2, 3, 4, 5, 6, 11, 12, 9, 10, 7, 8]


def test_grouped_by_layer_a_metric_of_the_old_parameters_comes_before_every_update():
    reads, writes, tail, backward = backward_then_updates(3)
    reads.append([100, 101, 102]), writes.append([998])  # the parameters' squares summed,
    reads.append([998]), writes.append([999])  # and their square root: a norm, returned as a metric
    order = updates_by_layer(reads, writes, tail, backward, [(3, 4), (4, 5), (5, 6)])
    assert order == [0, 1, 2, 3, 4, 5, 13, 14, 6, 11, 12, 9, 10, 7, 8]


def test_grouped_by_layer_with_a_global_norm_the_updates_stay_together_and_in_order():
    reads, writes, tail, backward = backward_then_updates(3, global_norm=True)
    order = updates_by_layer(reads, writes, tail, backward, [(3, 4), (4, 5), (5, 6)])
    assert order == list(range(len(reads)))  # every update reads the norm of the last gradient


@st.composite
def programs(draw):
    n = draw(st.integers(2, 30))
    reads, writes = [], []
    defined = [0, 1]
    for k in range(n):
        reads.append(draw(st.lists(st.sampled_from(defined), max_size=3)))
        writes.append([100 + k])
        defined.append(100 + k)
    tail = draw(st.integers(0, n))
    return reads, writes, tail, draw(st.integers(0, tail))


@settings(max_examples=300, deadline=None)
@given(programs())
def test_any_program_keeps_every_read_after_its_definition_and_the_rest_in_order(case):
    reads, writes, tail, backward = case
    order = updates_early(reads, writes, tail, backward)
    assert sorted(order) == list(range(len(reads)))
    assert reads_before_use(order, reads, writes, [0, 1])
    assert [k for k in order if k < tail] == list(range(tail))


@settings(max_examples=300, deadline=None)
@given(programs(), st.data())
def test_any_program_grouped_by_any_layers_keeps_every_read_after_its_definition(case, data):
    reads, writes, tail, backward = case
    cuts = sorted(data.draw(st.sets(st.integers(backward, tail), max_size=4)))
    layers = [(a, y) for a, y in pairwise(cuts) if a < y]
    order = updates_by_layer(reads, writes, tail, backward, layers)
    assert sorted(order) == list(range(len(reads)))
    assert reads_before_use(order, reads, writes, [0, 1])
    assert order[:tail] == list(range(tail))
