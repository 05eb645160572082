"""transfer/transport package."""
