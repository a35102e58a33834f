"""Speculative decoding: the n-gram proposer.

Mirrors ``vllm/v1/spec_decode/`` (``ngram_proposer.py``). No torch.
"""
