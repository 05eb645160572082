"""Suite-wide test settings.

Hypothesis: no per-example deadline and no "too slow" health check. Both are wall-clock
limits (200 ms per example, about a second to generate data) that a loaded CI machine (2
cores shared with several server processes) misses now and then, which fails a property
test that found no counterexample. A hang is still caught by pytest-timeout. Tests that
set their own `@settings` keep every other default; this profile only changes these two.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile("pdserve", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("pdserve")
