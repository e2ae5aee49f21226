"""asyncrl's foundation: what two or more programs share. The config schema (config*), the
contracts between programs (run directory, batch format, transport/, weights/, the admin client
inference_api) and start-up (startup, preflight, heartbeat, placement). Importing it loads no torch
or vLLM; it imports no program and not the command line (src/asyncrl/)."""
