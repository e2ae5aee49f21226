"""`rl orchestrator`: rollouts, rewards, advantages and the async rule, batch by batch."""
