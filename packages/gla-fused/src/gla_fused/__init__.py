"""gla-fused."""
