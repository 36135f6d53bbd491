"""Boundary repair: which reused tokens to recompute so the prompt's KV stays near a full prefill's."""
