"""gla-ref."""
