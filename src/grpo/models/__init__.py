"""Models: loading the policy, reference and tokenizer (``loading``), where a checkpoint comes from
(``source``), state-dict checks (``state_dicts``), the tiny test model (``tiny``) and wrapper helpers
(``wrappers``)."""
