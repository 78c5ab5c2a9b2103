"""Serving: a scheduler that batches requests as they come, and an OpenAI-compatible HTTP app over it."""
