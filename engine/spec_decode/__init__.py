"""Speculative decoding: proposers (ngram, draft, layerskip), the verification
rule, adaptive draft length and metrics.  See decoder.py for how a step uses them."""
