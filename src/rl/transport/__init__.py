"""How a batch crosses from the orchestrator to the trainer: the interface (interface.py), one
module per kind (files.py, zeromq.py), and the registry that picks one at start-up (registry.py)."""
