"""Fixtures shared by the tensor tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """These tensors are tiny: one thread per op is fastest, and a second one
    only spin-waits when the cores are shared. Restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
