"""Infrastructure below the loop: ranks and their collectives (``distributed``), the learner that steps the
policy (torch/DDP or DeepSpeed, ``learners``), optimizer and schedule (``optim``), the policy with what updates
it (``trainable``), and one rank's failure stopping the others (``rank_failure``)."""
