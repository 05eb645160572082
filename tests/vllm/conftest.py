"""tests/vllm: PdserveConnector inside real vLLM servers. Needs the .venv-vllm interpreter.

Run with `make test` (it builds .venv-vllm when missing) or
`.venv-vllm/bin/python -m pytest -o addopts= tests/vllm`. Under an interpreter without vLLM
every test here is skipped with that reason (`harness.VLLM_MARKS`, on every module).
"""
