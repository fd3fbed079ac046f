"""Shared test settings. Tests use tiny models: one thread per pytest worker is fastest (the
suite runs with -n 2 on 2 cores), and nothing may reach the network."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TFORMER_PLANS", "rules")      # decoding plans by rule, not by timing: the same on every machine

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread():
    """Keep one thread after every test: the peer engines (CTranslate2, ONNX Runtime) set the
    OpenMP thread count they share with torch, and a later test would run with theirs."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
