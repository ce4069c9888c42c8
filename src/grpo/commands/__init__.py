"""Commands beside training: ``grpo eval`` (``eval_command``), ``grpo chat``, ``grpo export`` and ``grpo memory``
(the memory planner, ``memory/``)."""
