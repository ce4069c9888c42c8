"""Tasks: a problem family's generator, its prompt and answer text, its file reader and its rule reward.

- ``knights_knaves``: Knights-and-Knaves logic puzzles (the K&K benchmark of Xie et al., used by Logic-RL).
"""
