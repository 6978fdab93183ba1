"""The contract between the engine core and a model runner.

The engine core schedules and hands each step to the runner as a SchedulerOutput; the
runner turns it into device work and gives back the sampled tokens. Everything the
runner does to its own state goes through these methods: nothing outside calls its
private ones. worker/runner.py is the implementation (its per-request and per-step
records are in worker/step_records.py); core/multihost/engine.py wraps it to broadcast
every call to the other hosts.
"""
from __future__ import annotations

from typing import Protocol

from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.worker.step_records import InflightStep, StepResult


class ModelRunner(Protocol):
    # programs traced so far (each compiles); flat after warm-up
    num_compiles: int

    def dispatch(self, scheduler_output: SchedulerOutput) -> InflightStep:
        """Take the step's diff, build its batch and launch it; returns the in-flight
        step without waiting for the device."""

    def collect(self, inflight: InflightStep) -> StepResult:
        """Wait for an in-flight step's tokens and append them to the request states;
        returns its StepResult. Steps are collected in dispatch order."""

    def execute(self, scheduler_output: SchedulerOutput) -> StepResult:
        """dispatch then collect."""

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Take a step's diff (finished, preempted, new requests, new blocks) without
        running it: an empty step still drops what finished."""

    def warmup(self, progress: bool = True) -> float:
        """Compile every step shape ahead of time; returns the seconds spent."""

    def count_compile(self) -> None:
        """Called by a program of this runner (its drafter's too) when it traces."""
