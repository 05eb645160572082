"""pdserve and vLLM: vLLM instances started by pdserve (`instance`, `serve`), and pdserve's
KV transfer core as a vLLM v1 KV connector (`connector`), loaded out of tree:

    --kv-transfer-config '{"kv_connector": "PdserveConnector",
                           "kv_connector_module_path": "pdserve.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"mode": "push"}}'

Only `connector` imports vLLM; the rest of the package (config, params, layout, the
worker's glue on the transfer core, the instance's command line) imports vLLM nowhere.
See docs/vllm.md.
"""
