"""Commands beside training: ``grpo eval`` (evaluate), ``grpo chat``, ``grpo export`` and ``grpo memory``
(the memory planner, ``memory/``)."""
