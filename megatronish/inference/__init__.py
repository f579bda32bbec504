"""Inference from a checkpoint: its model in one process (model.load_model, the package's
`load_model`), validation loss and perplexity (evaluate, `megatronish eval`), and sampling with
a KV cache (generate, `megatronish generate`; its decoding steps: decode)."""
