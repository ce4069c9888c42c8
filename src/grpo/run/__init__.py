"""The run folder on disk: its claim (``run_dir``), checkpoints (``checkpoint``, ``resume``), RNG states,
crash-safe writes (``durable``), metrics and trackers (``tracking``), plots and the progress bar."""
