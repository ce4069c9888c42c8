"""One GRPO step, shared by the colocated loop and the decoupled roles, in the order it runs:

- ``records``: the typed records between the stages (``Generation``, ``RolloutBatch``, ``SftBatch``);
- ``experience``: prompts -> group of completions -> rewards -> advantages -> old/ref log-probs;
- ``dynamic_sampling``: DAPO's rounds that drop zero-spread groups and sample more;
- ``batching``: joining and slicing rollout batches (ranks, rounds);
- ``logprobs``: the log-prob passes over completions (shared prompt pass, skipped padding columns);
- ``policy_update``: the clipped-surrogate update over a batch in micro-batches;
- ``ptx``: the PTX micro-batch's SFT loss beside it;
- ``ref_sync``: TR-DPO's move of the reference toward the updated policy, every N steps;
- ``metrics``: what the step reports (reward, accuracy, lengths, signal) and its sample records.
"""
