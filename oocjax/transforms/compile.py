"""Compiling a step's segments: one program per distinct segment, compiled in parallel threads.

Segments that run the same equations share a program (``segment.segment_key`` says which, read
off the equations without tracing), so that the programs to compile grow with the kinds of layers,
not with depth: on a CPU, XLA's compile time grows with the distinct programs, hardly with the
layers repeated inside one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from oocjax.schedule.segments import Segment, SegmentCost
from oocjax.transforms import compat as jc
from oocjax.transforms.flat import FlatProgram
from oocjax.transforms.segment import donated_inputs, segment_key, segment_specs
from oocjax.transforms.shardings import Layout


def compile_segments(
    flat: FlatProgram,
    segments: Sequence[Segment],
    functions: Sequence[Callable],
    cache: dict | None = None,
    layout: Layout | None = None,
    *,
    budget_bytes: int | None = None,
) -> tuple[list[Any], list[SegmentCost]]:
    """One compiled program per segment; segments with the same equations (``segment_key``),
    donation and (on a mesh, ``layout``) input and output shardings share one, also
    with the programs in ``cache`` (from an earlier plan of the same step), which gains the new
    ones. Only a new program's segment is traced. Distinct programs compile in parallel threads,
    each as soon as it is lowered (XLA releases the GIL while it compiles); random bits are
    lowered unrolled (``jc.unrolled_threefry``).

    With ``budget_bytes``, segments whose equations are alike but donate more of their inputs
    (the bottom layer, whose input nothing later reads) run the program of the alike segment that
    donates least, where it fits the budget there (``held_bytes`` plus what launching it
    allocates): one program to compile where donation made two. The executor still lets go of
    what the plan gave up after the launch."""
    cache = {} if cache is None else cache
    own = [(_equations_key(flat, segment, layout), donated_inputs(segment)) for segment in segments]
    donations: dict[tuple, set] = {}
    for equations, donated in own:
        donations.setdefault(equations, set()).add(donated)
    least = {equations: tuple(map(all, zip(*ways))) for equations, ways in donations.items()}
    shares = budget_bytes is not None
    keys = [(e, least[e]) if shares and least[e] in donations[e] else (e, d) for e, d in own]
    _compile_new(flat, segments, functions, cache, layout, keys)
    # Where the shared program does not fit the budget there, the segment compiles its own.
    keys = [
        key if key == mine or segment.held_bytes + _cost(cache[key]).launch_bytes <= budget_bytes else mine
        for key, mine, segment in zip(keys, own, segments, strict=True)
    ]
    _compile_new(flat, segments, functions, cache, layout, keys)
    programs = [cache[key] for key in keys]
    return programs, [_cost(program) for program in programs]


def _equations_key(flat: FlatProgram, segment: Segment, layout: Layout | None) -> tuple:
    key = segment_key(flat, segment)
    if layout is None:
        return key
    # The same equations on other layouts are another program.
    return key, tuple(layout.shardings[b] for b in (*segment.inputs, -1, *segment.outputs) if b >= 0)


def _compile_new(
    flat: FlatProgram,
    segments: Sequence[Segment],
    functions: Sequence[Callable],
    cache: dict,
    layout: Layout | None,
    keys: Sequence[tuple],
) -> None:
    """Compiles into ``cache`` the program of each key not there, from the first segment of that
    key whose donation is the key's."""
    compiling = {}
    with warnings.catch_warnings(), ThreadPoolExecutor() as pool, jc.unrolled_threefry():
        # A donated argument no output can reuse is still freed after the segment: not worth a warning.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        for segment, function, key in zip(segments, functions, keys, strict=True):
            if key in cache or key in compiling or key[1] != donated_inputs(segment):
                continue
            traced = function.trace(*segment_specs(flat, segment, layout))
            # Compiled while the next segments are keyed, traced and lowered (Python, holding the GIL).
            compiling[key] = pool.submit(traced.lower().compile)
        cache.update((key, future.result()) for key, future in compiling.items())


def _cost(compiled: Any) -> SegmentCost:
    stats = compiled.memory_analysis()
    return SegmentCost(
        temp_bytes=int(stats.temp_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
    )
