"""Measured device rates and the link as latency plus bandwidth (``benchmarks/rates.py``), the
pressure bound inside the timed simulation's lower bound (``oocjax.schedule.cost``), and fitting
the cost model to measured segment times."""

import math
import random
from dataclasses import replace
from itertools import pairwise

import jax
import jax.numpy as jnp
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from benchmarks import rates
from benchmarks.baselines import fixed_lookahead, swap_all_just_in_time
from benchmarks.rates import (
    LinkFit,
    calibrate_program_costs,
    default_profile,
    fit_step_costs,
    measure_profile,
    time_segments,
)
from oocjax.schedule import (
    PROFILES,
    Buffer,
    DeviceProfile,
    Offload,
    Prefetch,
    Program,
    Schedule,
    Step,
    keep_all,
    plan_window,
    required_bytes,
    simulate,
    simulate_time,
)
from oocjax.schedule.segments import cut_segments
from oocjax.transforms.trace import trace_step
from tests.support.programs import MiB, programs

# A device where time is easy to read: each step takes its flops in seconds, a MiB a second each way.
UNIT = DeviceProfile(
    name="unit",
    flops_per_s=1.0,
    hbm_bytes_per_s=1e30,
    h2d_bytes_per_s=MiB,
    d2h_bytes_per_s=MiB,
    op_overhead_s=0.0,
    copy_latency_s=0.0,
)


# measure_profile


def test_the_measured_profile_of_this_cpu_has_positive_finite_rates_in_sane_ranges():
    profile = measure_profile()
    rates = (profile.flops_per_s, profile.hbm_bytes_per_s, profile.h2d_bytes_per_s, profile.d2h_bytes_per_s)
    assert all(math.isfinite(rate) and rate > 0 for rate in rates)
    assert 1e9 <= profile.flops_per_s <= 1e13  # a few GFLOP/s to a few TFLOP/s for 1-64 x86 cores
    assert 1e8 <= profile.hbm_bytes_per_s <= 1e12
    assert 1e7 <= profile.h2d_bytes_per_s <= 1e12 and 1e7 <= profile.d2h_bytes_per_s <= 1e12
    assert 0 <= profile.h2d_latency_s < 0.1 and 0 <= profile.d2h_latency_s < 0.1
    assert profile.op_overhead_s == default_profile().op_overhead_s == PROFILES["cpu"].op_overhead_s
    assert profile.name == "measured cpu" and "measure_profile" in profile.source


def test_the_measured_profile_is_measured_once_per_device_kind(monkeypatch):
    first = measure_profile()

    def probe(*args, **kwargs):
        raise AssertionError("measure_profile measured the device again")

    for name in ("_link_fits", "_matmul_rate", "_memory_rate"):
        monkeypatch.setattr(rates, name, probe)
    assert measure_profile(jax.devices()[0]) is first  # a look-up, not a second measurement
    with pytest.raises(AssertionError, match="measured the device again"):
        measure_profile(refresh=True)  # the probes it would have measured with


class _Accelerator:
    """A device as ``ProbeSizes`` sees one: its platform and its allocator's limit."""

    platform, device_kind = "gpu", "NVIDIA H200"

    def memory_stats(self):
        return {"bytes_limit": 139 * 2**30}


@pytest.mark.parametrize("budget_gib", [None, 14, 4, 0.25])
def test_an_accelerators_probes_hold_at_most_an_eighth_of_the_budget_and_do_the_same_work(budget_gib):
    budget = None if budget_gib is None else int(budget_gib * 2**30)
    sizes = rates.ProbeSizes.for_device(_Accelerator(), budget)
    matmul_bytes = 3 * sizes.matmul_n**2 * 4  # the matrix, a product, the next product
    elementwise_bytes = 3 * sizes.elementwise_bytes  # the array, a result, the next result
    room = 139 * 2**30 // 8 if budget is None else budget // 8
    assert max(matmul_bytes, elementwise_bytes, sizes.copy_bytes[1]) <= room
    assert sizes.matmul_repeats * sizes.matmul_n**3 == 8192**3  # a product of two 8192 x 8192 matrices
    assert 2 * 2**30 <= sizes.elementwise_repeats * sizes.elementwise_bytes < 2 * 2**30 + sizes.elementwise_bytes
    assert sizes.copy_bytes[0] < sizes.copy_bytes[1]


def test_repeated_probes_measure_the_rates_of_one_large_probe_on_this_cpu():
    """The products and passes in a row are the work the rates count: on the CPU the matrix product
    repeated measures within a factor of two of the same product made once (a fused pass, alike)."""
    device = jax.devices()[0]
    once = rates._matmul_rate(device, 256, 1, 0.2)
    repeated = rates._matmul_rate(device, 256, 8, 0.2)
    assert 0.5 < repeated / once < 2


def test_a_link_fit_through_two_exact_copies_recovers_latency_and_bandwidth():
    fit = LinkFit.through((MiB, 2e-4 + MiB / 40e9), (64 * MiB, 2e-4 + 64 * MiB / 40e9))
    assert fit.bytes_per_s == pytest.approx(40e9) and fit.latency_s == pytest.approx(2e-4)


def test_a_link_fit_tilted_by_noise_keeps_a_nonnegative_latency_and_a_positive_bandwidth():
    slower_small = LinkFit.through((MiB, 1e-3), (16 * MiB, 1e-3))  # no slope: the large copy's rate
    assert slower_small.bytes_per_s == pytest.approx(16 * MiB / 1e-3) and slower_small.latency_s == 0
    steep = LinkFit.through((MiB, 1e-6), (2 * MiB, 1e-3))  # the line reaches zero time above zero bytes
    assert steep.bytes_per_s == pytest.approx(2 * MiB / 1e-3) and steep.latency_s == 0


# The link in the timed simulation


def test_each_copy_costs_its_own_directions_latency_plus_bytes_over_bandwidth():
    # f defines a (4 MiB); a leaves after f, comes back for k. Latency 1 s to host, 2 s to device.
    profile = replace(UNIT, h2d_latency_s=2.0, d2h_latency_s=1.0)
    program = Program.from_ops(
        [("f", [], ["a"]), ("g", [], ["b"]), ("k", ["a", "b"], ["c"])],
        {"a": 4 * MiB, "b": MiB, "c": MiB},
        flops={0: 1, 1: 1, 2: 1},
    )
    moves = (Offload(buffer=0, after_step=0, done_before_step=1), Prefetch(buffer=0, issue_step=2, use_step=2))
    result = simulate_time(program, Schedule(strategy="hand", budget_bytes=None, moves=moves), profile)
    # f 0-1; offload 1-6 (1 + 4); g waits for it: 6-7; prefetch 7-13 (2 + 4); k 13-14.
    assert result.d2h_spans == ((1, 6),) and result.h2d_spans == ((7, 13),)
    assert result.step_time_s == 14
    assert profile.h2d_seconds(4 * MiB) == 6 and profile.d2h_seconds(4 * MiB) == 5
    assert UNIT.h2d_seconds(MiB) == UNIT.d2h_seconds(MiB) == 1  # no per-direction figure: copy_latency_s


def test_published_profiles_keep_one_latency_for_both_directions_and_the_fitted_one_has_its_own_each_way():
    fitted = {name for name, profile in PROFILES.items() if profile.source.startswith("fitted")}
    assert fitted == {"h200"}
    for name, profile in PROFILES.items():
        if name in fitted:
            assert profile.h2d_seconds(0) == profile.h2d_latency_s != profile.d2h_latency_s == profile.d2h_seconds(0)
        else:
            assert profile.h2d_latency_s is None and profile.d2h_latency_s is None
            assert profile.h2d_seconds(0) == profile.d2h_seconds(0) == profile.copy_latency_s


# The pressure bound in the lower bound


def test_the_pressure_bound_makes_the_lower_bound_strictly_tighter_on_a_hand_worked_program():
    # In core: x (argument, 1 MiB) is held all step; a, b, c are 4 MiB; at h (step 2) x, a, b and c
    # are live: 13 MiB. At 9 MiB, 4 MiB must be off the device there: x (fetched before, free in
    # time) and 3 MiB of a, which k reads after h: out before h and back after it, 2 s per MiB on
    # the two directions that cannot overlap. So 6 s of link + h's 1 s >= 7 s; compute alone is 4 s.
    program = Program.from_ops(
        [("f", ["x"], ["a"]), ("g", ["a"], ["b"]), ("h", ["b"], ["c"]), ("k", ["a", "c"], ["y"])],
        {"x": MiB, "a": 4 * MiB, "b": 4 * MiB, "c": 4 * MiB, "y": MiB},
        inputs=["x"],
        outputs=["y"],
        flops={0: 1, 1: 1, 2: 1, 3: 1},
    )
    schedule = plan_window(program, 9 * MiB)
    result = simulate_time(program, schedule, UNIT)
    old = max(result.compute_time_s, result.h2d_bytes / MiB, result.d2h_bytes / MiB)
    assert (result.compute_time_s, result.h2d_bytes, result.d2h_bytes) == (4, 5 * MiB, 4 * MiB)
    assert old == 5
    assert result.lower_bound_s == 7 > old
    assert result.step_time_s >= result.lower_bound_s
    # Without a budget the schedule promises nothing about memory: no pressure term.
    assert simulate_time(program, replace(schedule, budget_bytes=None), UNIT).lower_bound_s == old


LATENT = replace(PROFILES["h100-pcie"], name="latent", h2d_latency_s=2e-4, d2h_latency_s=1e-4)
# The random programs' steps take milliseconds on a GPU profile, which hides their megabytes of
# traffic; on a slow link with fast compute the pressure term is the largest more often.
SLOW_LINK = replace(LATENT, name="slow link", flops_per_s=1e15, h2d_bytes_per_s=1e9, d2h_bytes_per_s=2e9)


@given(programs(), st.sampled_from([0.75, 0.5, 0.3]))
def test_the_lower_bound_with_the_pressure_bound_never_exceeds_the_simulated_step_time(program, fraction):
    peak = simulate(program, keep_all(program)).peak_bytes
    budget = max(1, int(peak * fraction))
    schedules = [replace(s, budget_bytes=simulate(program, s).peak_bytes) for s in _baselines(program)]
    if budget >= max(required_bytes(program), default=0):
        schedules.append(plan_window(program, budget))
    assume(schedules)
    for schedule in schedules:
        for profile in (LATENT, SLOW_LINK, PROFILES["cpu"]):
            result = simulate_time(program, schedule, profile)
            assert result.step_time_s >= result.lower_bound_s - 1e-12
            assert result.lower_bound_s >= result.compute_time_s


def _baselines(program: Program) -> list[Schedule]:
    """The fixed strategies, which take no budget: each is given its own simulated peak."""
    return [swap_all_just_in_time(program), fixed_lookahead(program, 2)]


# Fitting the cost model to segment times


TRUE = replace(PROFILES["cpu"], flops_per_s=2e11, hbm_bytes_per_s=3e10, op_overhead_s=3e-6)
TRUE_LAUNCH_S = 5e-5


def synthetic_program(seed: int, steps: int = 60) -> Program:
    """A chain of matmul-like steps (100-300 flops per byte), element-wise ones (1/4) and, between
    them, steps whose bound differs between ``PROFILES['cpu']`` (flops/byte ratio 5) and ``TRUE``
    (6.67): 6 flops per byte, arithmetic-bound under the first and memory-bound under the second."""
    rng = random.Random(seed)
    chain = []
    for k in range(steps):
        flops, per_byte = [
            (rng.randint(10**7, 10**9), rng.choice([100, 300])),
            (rng.randint(10**6, 10**8), 1 / 4),
            (rng.randint(10**6, 10**7), 6),
        ][k % 3]
        chain.append(Step(reads=(k,), writes=(k + 1,), flops=flops, bytes_accessed=int(flops / per_byte)))
    buffers = (Buffer(nbytes=4096, kind="input"), *(Buffer(nbytes=4096) for _ in range(steps)))
    return Program(steps=tuple(chain), buffers=buffers)


def segments_of(program: Program, seed: int, noise: float = 0.0, count: int = 12) -> list[tuple[range, float]]:
    """``count`` random consecutive segments and the times ``TRUE`` gives them, each off by up to
    ``noise``."""
    rng, n = random.Random(seed), len(program.steps)
    cuts = sorted({0, n, *rng.sample(range(1, n), count - 1)})
    return [
        (
            range(a, y),
            (TRUE_LAUNCH_S + sum(TRUE.compute_seconds(program.steps[k]) for k in range(a, y)))
            * (1 + rng.uniform(-noise, noise)),
        )
        for a, y in pairwise(cuts)
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_least_squares_calibration_recovers_known_coefficients(seed):
    program = synthetic_program(seed)
    fit = calibrate_program_costs(program, segments_of(program, seed), prior="cpu")
    assert fit.profile.flops_per_s == pytest.approx(TRUE.flops_per_s, rel=1e-6)
    assert fit.profile.hbm_bytes_per_s == pytest.approx(TRUE.hbm_bytes_per_s, rel=1e-6)
    assert fit.profile.op_overhead_s == pytest.approx(TRUE.op_overhead_s, rel=1e-4)
    assert fit.launch_s == pytest.approx(TRUE_LAUNCH_S, rel=1e-4)
    assert fit.relative_rms < 1e-9
    assert fit.rounds >= 2  # the 6-flops-per-byte steps change bound after the first fit
    assert fit.profile.h2d_bytes_per_s == PROFILES["cpu"].h2d_bytes_per_s  # the link is not refitted
    assert "fitted to 12 measured segment times" in fit.profile.source


@pytest.mark.parametrize("seed", [7, 8])
def test_the_calibration_stays_close_under_timing_noise_and_matches_the_total(seed):
    # Per-step overhead and flops grow together over long segments, so noise trades one for the
    # other a little; the total, which a fit with a launch term matches exactly, does not move.
    program = synthetic_program(seed, steps=300)
    fit = calibrate_program_costs(program, segments_of(program, seed, noise=0.01, count=30), prior="cpu")
    assert fit.profile.flops_per_s == pytest.approx(TRUE.flops_per_s, rel=0.1)
    assert fit.profile.hbm_bytes_per_s == pytest.approx(TRUE.hbm_bytes_per_s, rel=0.1)
    assert fit.total_ratio == pytest.approx(1, abs=1e-3)


def test_a_rate_no_segment_can_see_keeps_the_priors_value():
    # Only arithmetic-bound steps: nothing says how fast memory is.
    program = Program.from_ops(
        [("dot", [], ["a"]), ("dot", ["a"], ["b"]), ("dot", ["b"], ["c"])],
        {"a": 8, "b": 8, "c": 8},
        flops={0: 10**9, 1: 2 * 10**9, 2: 4 * 10**9},
    )
    fit = calibrate_program_costs(program, [([0], 0.01), ([1], 0.02), ([2], 0.04), ([0, 1, 2], 0.07)], prior="cpu")
    assert fit.profile.flops_per_s == pytest.approx(1e11)
    assert fit.profile.hbm_bytes_per_s == PROFILES["cpu"].hbm_bytes_per_s
    assert fit.predict_s(program.steps) == pytest.approx(0.07)


def test_groups_from_several_programs_fit_one_profile():
    programs_ = [synthetic_program(seed) for seed in (3, 4)]
    groups = [([p.steps[k] for k in r], t) for p, seed in zip(programs_, (3, 4)) for r, t in segments_of(p, seed)]
    fit = fit_step_costs(groups, prior="cpu")
    assert fit.profile.flops_per_s == pytest.approx(TRUE.flops_per_s, rel=1e-6)
    assert len(fit.measured_s) == len(fit.predicted_s) == 24


@pytest.mark.parametrize(
    ("segments", "message"),
    [
        ([([], 0.01)], "a segment must cover steps of the program"),
        ([([5], 0.01)], r"a segment must cover steps of the program \(0 .. 2\): \[5\]"),
        ([([0], 0.0)], "measured times must be positive and finite"),
        ([([0], math.nan)], "measured times must be positive and finite"),
    ],
)
def test_segments_that_cannot_be_fitted_are_refused(segments, message):
    program = Program.from_ops([("f", [], ["a"]), ("g", ["a"], ["b"]), ("h", ["b"], ["c"])], {"a": 1, "b": 1, "c": 1})
    with pytest.raises(ValueError, match=message):
        calibrate_program_costs(program, segments)


# Timing real segments


def test_timed_segments_of_a_real_step_cover_it_and_fit_the_cost_model():
    def step(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = jnp.tanh(h @ w)
            return jnp.mean(h**2)

        value, grads = jax.value_and_grad(loss)(ws)
        return [w - 0.1 * g for w, g in zip(ws, grads)], value

    ws = [jnp.full((64, 64), 0.01 * (i + 1)) for i in range(4)]
    x = jnp.ones((32, 64))
    traced = trace_step(step, ws, x)
    program = traced.program
    segments = cut_segments(program, keep_all(program), budget_bytes=2**40, min_segments=6)
    timings = time_segments(traced, jax.tree.leaves((ws, x)), segments, repeats=3)
    assert [(r.start, r.stop) for r, _ in timings] == [(s.start, s.stop) for s in segments]
    assert timings[-1][0].stop == len(program.steps) and all(t > 0 for _, t in timings)
    fit = calibrate_program_costs(program, timings, prior=measure_profile())
    assert math.isfinite(fit.relative_rms) and fit.profile.flops_per_s > 0
    with pytest.raises(ValueError, match="the traced step takes 5 flat arguments, got 1"):
        time_segments(traced, [x], segments)
