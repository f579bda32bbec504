"""Checkpoints: sharded, atomic saves; exact resume; re-sharding to any tp. (Hugging Face
export and import are megatronish.hf; eval, generate and load_model megatronish.inference.)

On disk, a checkpoint directory (checkpoint.dir) holds one directory per saved step and a
pointer to the newest complete one:

    <dir>/latest                      "step_000020\\n", replaced atomically after each save
    <dir>/step_000020/
        metadata.json                 format, step, layout (tp, dp, pp, cp, zero), every
                                      tensor's full shape, split dim, dtype and valid_rows,
                                      the files with their sizes and CRC-32C
                                      checksums, the train loader's position, the tokenizer
        config.yaml                   the resolved config of the run
        model_tp00.safetensors        tp rank 0's parameter shards (replicated ones only here)
        optim_tp00_dp000.safetensors  the optimizer state of the parameters whose state dp rank
                                      0 of tp rank 0 holds (all, without ZeRO): AdamW's
                                      exp_avg / exp_avg_sq / step, Muon's matrices'
                                      momentum_buffer
        rng_rank00000.safetensors     global rank 0's CPU / CUDA / RNG-tracker states
        tokenizer.json                the dataset's tokenizer (BPE and file tokenizers)
    <dir>/step_000030.tmp-1234/       a save in progress (or interrupted): always ignored

Everything is safetensors or JSON/YAML: nothing is unpickled. The submodules import torch;
this package's __init__ does not.
"""
