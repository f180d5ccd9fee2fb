"""Architecture rules that a test can hold: the planner never imports jax or numpy."""

import subprocess
import sys
import textwrap


def test_the_planner_imports_and_plans_with_jax_and_numpy_unavailable():
    code = textwrap.dedent(
        """
        import sys

        class Blocked:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("jax", "jaxlib", "numpy"):
                    raise ImportError(f"{name} is blocked in this test")
                return None

        sys.meta_path.insert(0, Blocked())
        import oocjax
        import oocjax.schedule
        from oocjax.schedule.cost import simulate_time
        from oocjax.schedule.synthetic import layered_training_step

        program = layered_training_step(4)
        budget = max(oocjax.schedule.required_bytes(program))
        schedule = oocjax.schedule.plan_window(program, budget)
        assert not oocjax.schedule.validate(program, schedule)
        simulate_time(program, schedule, "h100-pcie")
        assert not any(m.split(".")[0] in ("jax", "jaxlib", "numpy") for m in sys.modules)
        print("planned", len(schedule.moves), "moves")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("planned")
