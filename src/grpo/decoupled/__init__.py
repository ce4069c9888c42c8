"""Decoupled mode: sampler processes stream rollout batches to trainer ranks over ZeroMQ; the
trainer's rank 0 publishes weights through the filesystem; an optional reference server.

Roles: ``sampler`` (one module each), ``trainer``, ``launcher`` (starts and supervises them all).
"""
