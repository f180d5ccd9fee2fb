import os

from hypothesis import HealthCheck, settings

# Deterministic property runs: the same examples on every machine, a few hundred per property.
settings.register_profile(
    "ci", max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
