"""Shared fixtures. The real SmolLM2 target is loaded at most once per session, and only by
tests that ask for it (those are marked ``slow``)."""

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The built-in SmolLM2-135M-Instruct target (bf16; dequantised once into the user cache)."""
    from adaptive_eagle.targets import load_target

    return load_target("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    return smollm2.tokenizer
