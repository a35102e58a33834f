"""Engine tests run tiny models: one torch thread is fastest, and on a shared
machine extra threads only wait for each other. Restored after each test."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
