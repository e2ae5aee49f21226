"""asyncrl's shared package: the CLI, the config, and the contracts between the three programs
(run directory, batch format, admin client, the async rule). Importing it loads no torch or vLLM."""
