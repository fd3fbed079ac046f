"""Shared test settings. Tests use tiny models: one thread per pytest worker is fastest (the
suite runs with -n 2 on 2 cores), and nothing may reach the network."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
