"""Hugging Face interop: checkpoints to and from directories (config.json + model.safetensors)
that transformers loads with no custom code.

One module per model family (gpt2, llama, mixtral) holds its config.json translation and its
parameter-name mapping as a `Family`; the registry finds a directory's family by config.json's
`architectures` (`model_type` when none of them is known). The rest is the machinery every
family shares: files (config.json and safetensors weights, one file or a sharded index, never
pickle), tokenizer (the one that travels with the model), exporter and importer (the output
layer, the checks, the atomic write). Adding a family is one module and one registry entry.
"""
