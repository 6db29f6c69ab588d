"""Shared fixtures. The real SmolLM2 target is loaded at most once per session, and only by
tests that ask for it; those, and every test that starts Ray, are marked ``slow`` here (`make test-fast`
leaves them out; `make test` runs them)."""

import pytest

SLOW_FIXTURES = ("smollm2", "smollm2_tokenizer", "ray_session")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in SLOW_FIXTURES):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm2():
    """The built-in SmolLM2-135M-Instruct target (bf16; dequantised once into the user cache)."""
    from adaptive_eagle.targets import load_target

    return load_target("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (starting Ray costs ~3 s and ~1 GiB here).
    Tests that need Ray take this fixture; none of them calls ray.init/shutdown itself."""
    import ray

    # workers at normal priority, as the stack starts them (Ray's default niceness 15 starves actors whenever
    # another job shares the machine, and the tests would measure that instead of what they check)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             _system_config={"worker_niceness": 0})
    yield ray
    ray.shutdown()


@pytest.fixture
def one_thread():
    """Tiny tensors: one intra-op thread (two spin against each other on a shared 2-core machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
