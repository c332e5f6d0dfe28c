"""Sampling: a request's settings (``SamplingParams``), its sampler (``Sampler``: the
steps from a row of logits to a token), and the log-probabilities of what it picked. Pure
but for the llama.cpp chain it is handed (engine/llama/chain.py)."""

from .sampler import Chain, Sampler
from .sampling_params import SamplingParams
from .token_logprobs import MAX_TOP_LOGPROBS, TokenLogprobs, log_softmax, token_logprobs

__all__ = [
    "MAX_TOP_LOGPROBS",
    "Chain",
    "Sampler",
    "SamplingParams",
    "TokenLogprobs",
    "log_softmax",
    "token_logprobs",
]
