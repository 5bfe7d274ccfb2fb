"""Numerical building blocks of the merges; imports nothing above it.

``quadratic`` (the WUDI-type loss and its normal equation tau C = D), ``spectrum`` (the eigendecomposition
of C and the rank rules' view of it), ``filters`` and ``rank_rules`` (h(lambda), K), ``solve`` (the spectral
filtering estimator), ``optimize`` (gradient descent on the loss), ``topk`` (exact top-k by magnitude),
``lowrank`` (LoRA deltas, their cores and factors), ``precision`` (the compute dtype).
"""
