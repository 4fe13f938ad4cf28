import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def pytest_collection_modifyitems(config, items):
    # TRITON_INTERPRET=1 changes how every Triton kernel runs: that invocation runs the interpreter
    # tests alone, and the normal invocation skips them.
    skip_interpret = pytest.mark.skip(
        reason="needs TRITON_INTERPRET=1 (run: TRITON_INTERPRET=1 pytest -m interpret)"
    )
    skip_normal = pytest.mark.skip(reason="TRITON_INTERPRET=1 runs only the interpreter tests")
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        is_interpret = "interpret" in item.keywords
        if is_interpret and not INTERPRET:
            item.add_marker(skip_interpret)
        elif INTERPRET and not is_interpret:
            item.add_marker(skip_normal)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
