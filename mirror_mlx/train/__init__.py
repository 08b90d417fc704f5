"""Training: what makes the parts the runtime loads: exit adapters (exit_adapter.py), the distilled draft
(distill.py, its data distill_data.py, its measurement distill_cost.py) and the Speculative-Streaming draft
(ss_draft.py). Nothing under the engine, the drafts, the proposers or the server imports this package."""
