"""gla-simple."""
