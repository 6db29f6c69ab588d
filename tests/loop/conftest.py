"""The loop's tests start real serving stacks: they share serving's tiny-target fixture."""

from tests.serving.conftest import stack  # noqa: F401  (a fixture, found by pytest through this import)
