"""The ``aloe`` command: build, evaluate, inspect, demo, export and serve."""

import os

if os.environ.get("RANK", "0") != "0":  # a distributed build's other processes: progress is rank 0's to show
    os.environ.setdefault("TQDM_DISABLE", "1")

from .main import build_parser, main

__all__ = ["build_parser", "main"]
