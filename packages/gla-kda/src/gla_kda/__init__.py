"""gla-kda."""
