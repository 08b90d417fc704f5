"""The Speculative-Streaming draft: its model (model.py) and the draft the host runs (draft.py)."""
