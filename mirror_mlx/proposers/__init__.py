"""Proposers with no draft model: prompt lookup (lookup.py, n-grams of the context) and the recycled draft
(recycle.py, the target's own top-8 after each token). The target verifies their windows like a draft's."""
