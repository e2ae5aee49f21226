"""`rl trainer`: FSDP2 policy-gradient training on the orchestrator's batches."""
