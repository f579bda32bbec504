"""Hugging Face interop: checkpoints to and from directories (config.json + model.safetensors)
that transformers loads with no custom code.

One module per model family (gpt2, llama, mixtral, mistral, qwen2, qwen3, qwen3_moe) holds its
config.json translation and its parameter-name mapping as a `Family`; every family but gpt2 is
llama's block mapping with its components. The registry finds a directory's family by
config.json's `architectures` (`model_type` when none of them is known), and an export's by
model.arch and the model's components. The rest is the machinery every family shares: files
(config.json and safetensors weights, one file or a sharded index, never pickle), tokenizer (the
one that travels with the model), exporter and importer (the output layer, the checks, the
atomic write). Adding a family is one module and one registry entry.
"""
