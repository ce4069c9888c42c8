"""The ``decoupled`` section of the config tree (``grpo.config.schema``): how ``train.mode: decoupled`` runs its
processes (trainer ranks, samplers, the reference server), the links between them and how weights reach the
samplers."""

from __future__ import annotations

from dataclasses import dataclass

from grpo.config.fields import opt


@dataclass
class DecoupledConfig:
    address: str = opt("tcp://127.0.0.1:5555", "ZeroMQ address the trainer's rank 0 binds and samplers connect to; "
                                               "with host 0.0.0.0 samplers read the trainer's address from the run "
                                               "folder (decoupled/trainer_address.json).")
    advertise_host: str | None = opt(None, "Host samplers on other machines reach trainer rank 0 at, published in the "
                                           "run folder (null: this host's name, if it resolves beyond loopback).")
    trainer_ranks: int = opt(1, "Trainer processes (data-parallel ranks) the launcher starts with torchrun.", ge=1)
    num_samplers: int = opt(1, "Sampler processes the launcher starts (each its own data shard and seed).", ge=1)
    sampler_index: int = opt(0, "This sampler's index (set by the launcher for each sampler process).", ge=0)
    sampler_device: str = opt("auto", "Device of the samplers (auto, cpu, cuda:N).")
    ref_server: bool = opt(
        False, "Start a reference log-prob server; samplers query it instead of loading the reference.")
    ref_server_url: str | None = opt(
        None, "URL of a running reference server (set by the launcher when it starts one).")
    ref_server_port: int = opt(
        8431, "Port of the reference server (on decoupled.ref_server_host).", ge=1, le=65535)
    ref_server_device: str = opt("auto", "Device of the reference server.")
    ref_server_host: str = opt("127.0.0.1", "Address `grpo ref-server` binds; another host's samplers need a "
                                            "reachable one (e.g. 0.0.0.0), which needs decoupled.token_env.")
    ref_server_retry_s: float = opt(
        60.0, "A sampler keeps retrying an unreachable reference server this long (a restart) before it exits.",
        ge=0)
    token_env: str | None = opt(None, "Environment variable holding the shared token for ZeroMQ and the ref server.")
    encrypt: bool = opt(False, "Encrypt the ZeroMQ link with CURVE (the batches hold prompts and completions); "
                               "every role must agree. The token still says who may send.")
    curve_dir: str | None = opt(None, "Folder of the trainer's CURVE key pair (server.key, server.key_secret), "
                                      "seen by every role; null = decoupled/curve in train.output_dir.")
    queue_size: int = opt(4, "Rollout batches the trainer holds before samplers are told to wait (backpressure).", ge=1)
    peer_timeout_s: float = opt(600.0, "Give up (with a clear error) after waiting this long for a peer.", gt=0)
    max_message_mb: int = opt(1024, "Largest accepted message (MiB); larger ones are rejected.", ge=1)
    weights_keep: int = opt(3, "Published weight versions kept on disk.", ge=1)
    weight_sync: str = opt(
        "files", "How samplers get new weights: files (the weight store in the run folder) or broadcast (full "
                 "fine-tuning only: a gloo group of trainer rank 0 and the samplers; files after a failure).",
        choices=("files", "broadcast"))
    weight_sync_port: int = opt(29600, "Port of trainer rank 0's TCPStore for decoupled.weight_sync: broadcast "
                                       "(samplers reach it at the trainer's host: the one decoupled.address names "
                                       "or, with a wildcard address, the one rank 0 publishes in "
                                       "decoupled/trainer_address.json of the run folder; the group's keys derive "
                                       "from decoupled.token_env's token, and without one the store listens on "
                                       "127.0.0.1 only).",
                                ge=1, le=65535)
    restart_samplers: bool = opt(True, "The launcher restarts a sampler that dies.")
    weight_update: str = opt(
        "per_chunk", "When a sampler loads newer weights: per_chunk (before each chunk; a chunk is made by one "
                     "version) or in_flight (also while generating: every decoupled.inflight_check_tokens tokens it "
                     "loads the newest published version in place and continues the open sequences, KV caches kept "
                     "(vLLM with LoRA re-admits them under the new adapter); each token records its version and "
                     "log-prob). in_flight needs rollout.engine hf, hf-static or vllm (full weights or LoRA; vllm "
                     "with top_p/top_k only under loss.sampler_is_correction), single-turn rollouts, min_p 0.",
        choices=("per_chunk", "in_flight"))
    inflight_check_tokens: int = opt(
        16, "decoupled.weight_update in_flight: a sampler looks for newer weights every this many generated tokens.",
        ge=1)
    partial_rollouts: bool = opt(
        False, "Partial rollouts: a sampler sends a chunk after decoupled.partial_token_budget tokens of generation "
               "(more only while no group has finished or more than a chunk's prompts would stay behind) with the "
               "prompt groups whose G completions all ended; a group with a completion still running is carried "
               "over and finished in the sampler's next chunk. Each token keeps the version and log-prob of the "
               "weights that drew it; a carried group with a token older than train.max_staleness allows starts "
               "over. Several trainer ranks split a step's groups as evenly as whole groups allow, each rank's "
               "loss scaled to its share (under DeepSpeed a rank with fewer micro-batches runs zero-gradient ones "
               "to match). Needs train.max_staleness >= 1 (about num_samplers + 1 for carried groups to survive), "
               "rollout.engine hf, hf-static or vllm (as for in_flight), single-turn rollouts, rollout.min_p 0, "
               "no dynamic sampling.")
    partial_token_budget: int = opt(
        32, "decoupled.partial_rollouts: tokens each running completion gets per chunk before the chunk is sent "
            "(below rollout.max_completion_length).", ge=1)
