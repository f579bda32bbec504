"""What training minimizes, apart from the model: an objective turns the last stage's final
hidden states (through the model's logits and, where they run, its multi-token prediction
modules) into the losses of one micro-batch (objectives.interface). The step loop, the
pipeline's last stage and evaluation call it on MicroBatch objects (objectives.batch); the
objectives by name are in objectives.registry (next-token prediction; DPO, objectives.dpo)."""
