"""What the trainer and the servers share about weight versions: the NCCL/gloo broadcast protocol
(broadcast.py) and the delta format (delta.py)."""
