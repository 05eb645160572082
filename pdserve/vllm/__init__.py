"""pdserve and vLLM: vLLM instances started by pdserve (`instance`, `serve`), and pdserve's
KV transfer core as a vLLM v1 KV connector (`connector`, loaded out of tree by vLLM)."""
