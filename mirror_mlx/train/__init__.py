"""Training: what makes the parts the runtime loads (exit adapters). Nothing under the engine, the draft host
or the server imports this package."""
