"""What proposes the tokens the target verifies: the choice, once per call (proposing.py), the proposers the loop
drives (proposer.py), and those with no draft model: prompt lookup (lookup.py, n-grams of the context) and the
recycled draft (recycle.py, the target's own top-8 after each token)."""
