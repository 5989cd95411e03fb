"""Log-probs of target tokens from a chunk of logits, and the gradient of those logits, in place.

The two memory-bound passes of the chunked language-model head (`treepack.train.losses.target_logprobs`):
``lse_and_logprob`` (forward: log-sum-exp of each row and the target's log-prob) and ``grad_logits_``
(backward: a block of vocabulary columns overwritten with d(sum_r g_r logp_r) / d logits). ``reference``
holds the pure-torch versions every backend is tested against; ``triton`` the CUDA kernels (one pass over
the logits each, at the memory bandwidth).
"""

from .reference import grad_logits_reference_, lse_and_logprob_reference
from .triton import grad_logits_triton_, lse_and_logprob_triton, triton_supported

__all__ = [
    "grad_logits_reference_",
    "grad_logits_triton_",
    "lse_and_logprob_reference",
    "lse_and_logprob_triton",
    "triton_supported",
]
