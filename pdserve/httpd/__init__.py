"""The HTTP server under every pdserve server (instances and the router): uvicorn with one
bootstrap (`bootstrap.serve_app`: signals, graceful shutdown) and one protocol (`protocol`:
a deadline on request headers, quiet health and load polls)."""
