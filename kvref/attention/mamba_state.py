"""Mamba state blocks on tensors: a recurrence whose state lives in kvref's blocks.

No single vLLM counterpart: this is the contract between ``MambaManager``
(``vllm/v1/core/single_type_kv_cache_manager.py``) and the Mamba layers and
their metadata (``vllm/v1/attention/backends/mamba_attn.py``,
``vllm/v1/worker/mamba_utils.py``), reduced to a linear recurrence a reader can
check by hand::

    h_t = decay * h_{t-1} + x_t          (elementwise, h_{-1} = 0)      y_t = h_t

A Mamba layer keeps no per-token keys: one block holds one whole state
``[state_size]``. Where the states of a step are read and written, for a
request with ``context_len`` tokens done and ``query_len`` new ones
(``table`` = its block ids in the Mamba group, block size ``B``):

- read: the state after token ``context_len`` is in
  ``table[(context_len - 1) // B]`` (zeros when ``context_len == 0``);
- write, mode ``"all"``: the state after each block boundary ``(j + 1) * B``
  crossed in this step goes to ``table[j]`` (that is the block a later prefix
  hit on ``(j + 1) * B`` tokens returns), and the state after the last token
  to ``table[(seq_len - 1) // B]``;
- write, mode ``"align"``: only the state after the last token, into
  ``table[(seq_len - 1) // B]``. When that is a new block, the old one keeps
  the state it had, which is the state at a block boundary as long as steps
  end on block boundaries (vLLM's scheduler cuts prefill chunks so in this
  mode; the last chunk of a prompt and decodes may end anywhere, but then the
  next step writes into the same block again).

    table (B = 4), 10 tokens in one step, mode "all":   [5, 9, 2]
    state after token 4 -> block 5, after 8 -> block 9, after 10 -> block 2

``MambaManager`` replaces blocks left of ``table[(context_len - 1) // B]`` by the
null block; the tests fill those (and every unwritten block) with NaN.

    >>> cache = make_state_cache(4, 1)
    >>> y = mamba_step(torch.ones(3, 1), cache, decay=torch.tensor([0.5]),
    ...                query_start_loc=[0, 3], seq_lens=[3],
    ...                block_table=torch.tensor([[3]]), block_size=4, mamba_cache_mode="all")
    >>> y.flatten().tolist(), cache[3].tolist()          # 1, 1.5, 1.75
    ([1.0, 1.5, 1.75], [1.75])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvref.attention.paged_attention import as_ints

MAMBA_MODES = ("all", "align")


def make_state_cache(num_blocks: int, state_size: int, dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu", fill: float = 0.0) -> torch.Tensor:
    """One state per block: ``[num_blocks, state_size]``."""
    return torch.full((num_blocks, state_size), fill, dtype=dtype, device=device)


def mamba_step(x: torch.Tensor, state_cache: torch.Tensor, *, decay: torch.Tensor,
               query_start_loc: torch.Tensor | Sequence[int],
               seq_lens: torch.Tensor | Sequence[int], block_table: torch.Tensor,
               block_size: int, mamba_cache_mode: str) -> torch.Tensor:
    """Run the recurrence over a packed batch, states read from and written to blocks.

    Args:
        x: ``[num_tokens, state_size]`` inputs, requests back to back.
        state_cache: ``[num_blocks, state_size]``, read and written in place.
        decay: ``[state_size]``.
        query_start_loc, seq_lens: as in ``paged_attention``.
        block_table: ``[num_reqs, max_blocks]``, the Mamba group's rows.
        block_size: the Mamba group's block size (tokens per state block).
        mamba_cache_mode: ``"all"`` or ``"align"`` (see the module docstring).

    Returns ``y``: ``[num_tokens, state_size]``. O(num_tokens * state_size).
    """
    if mamba_cache_mode not in MAMBA_MODES:
        raise ValueError(f"mamba_cache_mode must be one of {MAMBA_MODES}, "
                         f"got {mamba_cache_mode!r}")
    if x.dim() != 2 or state_cache.dim() != 2 or x.shape[1] != state_cache.shape[1] \
            or decay.shape != (x.shape[1],):
        raise ValueError(f"x {tuple(x.shape)}, state_cache {tuple(state_cache.shape)} and decay "
                         f"{tuple(decay.shape)} must be [num_tokens, S], [num_blocks, S], [S]")
    starts, lens = as_ints(query_start_loc), as_ints(seq_lens)
    if len(starts) != len(lens) + 1:
        raise ValueError(f"query_start_loc has {len(starts)} entries for {len(lens)} requests")
    y = torch.zeros_like(x)
    for r, seq_len in enumerate(lens):
        q_start, q_end = starts[r], starts[r + 1]
        if q_start == q_end:
            continue
        context_len = seq_len - (q_end - q_start)
        table = block_table[r].tolist()
        if context_len == 0:
            h = torch.zeros_like(state_cache[0])
        else:
            h = state_cache[table[(context_len - 1) // block_size]].clone()
        for i in range(q_start, q_end):
            h = decay * h + x[i]
            y[i] = h
            num_done = context_len + (i - q_start) + 1
            if mamba_cache_mode == "all" and num_done % block_size == 0:
                state_cache[table[num_done // block_size - 1]] = h
        state_cache[table[(seq_len - 1) // block_size]] = h
    return y


def recurrence_reference(x: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """The whole sequence from a zero state, no blocks: ``[n, S] -> [n, S]``."""
    h = torch.zeros_like(x[0])
    out = []
    for x_t in x:
        h = decay * h + x_t
        out.append(h)
    return torch.stack(out)
