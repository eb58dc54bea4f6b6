"""The attention pool: vLLM engines that own requests and the KV cache."""
