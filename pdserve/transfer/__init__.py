"""transfer package."""
