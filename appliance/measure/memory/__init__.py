"""What a model costs on a card, as vLLM counts it: its shape from config.json (shape), its
quantized weights (quant), the budget vLLM's worker leaves for the cache (budget), and how the
cache is laid out in it (paging)."""
