"""How a run is assembled and driven: setup from the config (``prepare``), the loop skeleton both modes share
(``loop``), the colocated loop, evaluation during training (``evaluator``), resume, and the guards against NaN
steps and badly timed Ctrl-C."""
