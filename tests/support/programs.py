"""Programs shared by the planner tests: hand-built ones and a Hypothesis strategy for random ones."""

from __future__ import annotations

from hypothesis import strategies as st

from oocjax.schedule import Buffer, Program, Step

MiB = 2**20


def mlp_chain() -> Program:
    """A 3-layer MLP's forward and backward pass; sizes in MiB. Parameters and the batch are inputs,
    the three weight gradients are outputs.

        f1: x, w1 -> a1      b3: a3, a2, w3 -> g3, dw3
        f2: a1, w2 -> a2     b2: g3, a1, w2 -> g2, dw2
        f3: a2, w3 -> a3     b1: g2, x, w1  -> g1, dw1
    """
    sizes = {name: MiB for name in ("x", "w1", "w2", "w3")}
    sizes |= {name: 4 * MiB for name in ("a1", "a2", "a3", "g3", "g2", "g1")}
    sizes |= {name: MiB for name in ("dw3", "dw2", "dw1")}
    ops = [
        ("f1", ["x", "w1"], ["a1"]),
        ("f2", ["a1", "w2"], ["a2"]),
        ("f3", ["a2", "w3"], ["a3"]),
        ("b3", ["a3", "a2", "w3"], ["g3", "dw3"]),
        ("b2", ["g3", "a1", "w2"], ["g2", "dw2"]),
        ("b1", ["g2", "x", "w1"], ["g1", "dw1"]),
    ]
    return Program.from_ops(ops, sizes, inputs=["x", "w1", "w2", "w3"], outputs=["dw1", "dw2", "dw3"])


SIZES = st.sampled_from([0, 4096, MiB // 2, MiB, 2 * MiB, 3 * MiB, 8 * MiB])


@st.composite
def programs(draw) -> Program:
    """Random SSA programs: inputs (some donated), a constant or not, steps reading up to three
    earlier values and defining one or two, some scratch, outputs, and outputs aliased to donated
    inputs. Sizes straddle the 1 MiB offload threshold."""
    specs: list[dict] = []
    for i in range(draw(st.integers(0, 4))):
        specs.append(dict(nbytes=draw(SIZES), kind="input", donated=draw(st.booleans()), label=f"in{i}"))
    for i in range(draw(st.integers(0, 1))):
        specs.append(dict(nbytes=draw(SIZES), kind="constant", label=f"const{i}"))
    steps = []
    for k in range(draw(st.integers(1, 25))):
        reads = draw(st.lists(st.integers(0, len(specs) - 1), max_size=3, unique=True)) if specs else []
        writes = []
        for _ in range(draw(st.integers(1, 2))):
            specs.append(dict(nbytes=draw(SIZES), kind="computed", label=f"v{len(specs)}"))
            writes.append(len(specs) - 1)
        transient = draw(st.sampled_from([0, 0, 0, MiB // 2, 2 * MiB]))
        steps.append(
            Step(
                reads=tuple(reads),
                writes=tuple(writes),
                transient_bytes=transient,
                flops=10**9,
                bytes_accessed=10**6,
                name=f"op{k}",
            )
        )
    outputs = draw(st.sets(st.integers(0, len(specs) - 1), max_size=4))
    donated = [i for i, spec in enumerate(specs) if spec.get("donated")]
    for b in sorted(outputs):
        specs[b]["is_output"] = True
        if donated and specs[b]["kind"] == "computed" and draw(st.booleans()):
            specs[b]["aliased_input"] = donated.pop()
    return Program(steps=tuple(steps), buffers=tuple(Buffer(**spec) for spec in specs))


def an_offloaded_output_of_a_host_input() -> Program:
    """y replaces the donated input x, which lives on host at a 1 MiB budget. y is made at step 0,
    offloaded while nine empty steps and a small one run, and fetched back for use_y; the window
    then reaches y's return, so the pass would return it on the device, where x does not live."""
    ops = [("make_y", [], ["y"])] + [(f"pad{i}", [], [f"p{i}"]) for i in range(9)]
    ops += [("small", [], ["s"]), ("use_y", ["y"], ["z"])]
    sizes = {"x": MiB, "y": MiB, **{f"p{i}": 0 for i in range(9)}, "s": 4096, "z": 0}
    return Program.from_ops(ops, sizes, inputs=["x"], donated=["x"], outputs=["y"], aliases={"y": "x"})
