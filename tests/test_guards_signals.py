"""Signals while a run stops: a repeated SIGTERM is one request (schedulers and torchrun both deliver it),
a Ctrl-C after the first signal stops at once."""

from __future__ import annotations

import os
import signal

import pytest

from grpo.training.guards import DeferredInterrupt, RankAgreedStop, sigterm_as_interrupt


def test_a_repeated_sigterm_is_one_request_and_ctrl_c_after_it_forces():
    with RankAgreedStop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the same request again: still a clean stop after the step
        assert stop.requested and not stop.forced
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert stop.forced


def test_held_interrupt_raises_once_at_the_end_after_two_sigterms():
    interrupt = DeferredInterrupt()
    with pytest.raises(KeyboardInterrupt):
        with interrupt.holding():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
    assert interrupt.received and not interrupt.forced


def test_sigterm_as_interrupt_raises_for_the_first_only():
    with sigterm_as_interrupt():
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # e.g. during the checkpoint the first one asked for: ignored
