import os

from hypothesis import HealthCheck, settings

# The tests check values and memory, not speed: XLA:CPU compiles their programs with fewer LLVM
# optimizations, which took 19% off three of the slowest test files on this project's 2-core CPU
# (benchmarks measure at XLA's defaults). Not level 0: there four tests lost bitwise equality with
# jax.jit's program. Set before jax starts its backend; subprocesses inherit it.
FAST_COMPILE = "--xla_backend_optimization_level=1 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

# Deterministic property runs: the same examples on every machine, a few hundred per property.
settings.register_profile(
    "ci", max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
