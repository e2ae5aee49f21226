"""The `rl` command line (main.py; `python -m asyncrl` is the same) and what only it uses: the
one-machine launcher, slurm job rendering, plots, the eval follower and the config's --help.
The top of the house: nothing imports it, and `torchrun -m trainer` does not go through it."""
