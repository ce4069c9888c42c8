"""How a run is driven: setup from the config, the loop skeleton both modes share, the colocated loop,
the learner (torch/DDP or DeepSpeed), ranks, and the guards against NaN steps and badly timed Ctrl-C."""
