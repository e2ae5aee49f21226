"""The `rl` command line (main.py) and what only it uses: the one-machine launcher, slurm job
rendering, plots, the eval follower and the config's documentation."""
