"""Proposers of speculative decoding: each guesses a request's next tokens (its drafts), which
the next step verifies with the target model (shared/speculative.py)."""
