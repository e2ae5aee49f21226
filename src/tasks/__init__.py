"""Built-in tasks: a seeded prompt generator and a reward function each, named in the config."""
