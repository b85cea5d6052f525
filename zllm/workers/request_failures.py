"""Per-request failure isolation on a worker: a request the worker cannot take fails alone.

Admitting a new request (building its state and its sampling row) runs under `RequestFailures.admit`:
an exception there leaves no trace of that request on the worker, is remembered with its reason,
and goes back to the engine core with the step's output (StepOutput.failed_requests), which ends
that request with finish_reason "error". The rest of the batch runs as if it had never come.

NOTE: at tp > 1 every rank must fail the same requests, or the ranks would run different batches
and their collectives would not match; a failure that depends on the request's content (as the
test hook below does) is the same on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from zllm import envs
from zllm.ipc.messages import NewRequestData, StepInput

logger = logging.getLogger(__name__)


class InjectedFaultError(RuntimeError):
    """The failure ZLLM_TEST_FAIL_PROMPT_TOKEN asked for."""


class RequestFailures:
    """Requests this worker failed since the last step output, with the reason."""

    def __init__(self) -> None:
        self.failed: dict[str, str] = {}
        # Failed here and not yet dropped by the core (finished_ids): under async scheduling the
        # core may schedule a request once more before it hears of the failure.
        self._dropped: set[str] = set()
        # TEST ONLY: a request whose prompt holds this token id fails when admitted, as a bug in one
        # request's set-up would; the failure-isolation tests use it. Read once, when a worker starts;
        # without it (always, outside tests) nothing is injected.
        self._poison_token: int | None = envs.ZLLM_TEST_FAIL_PROMPT_TOKEN

    def is_dropped(self, request_id: str) -> bool:
        return request_id in self._dropped

    def forget(self, request_id: str) -> None:
        """The core dropped the request (finished or preempted ids)."""
        self._dropped.discard(request_id)

    def admit(self, new: NewRequestData, add: Callable[[NewRequestData], None], discard: Callable[[str], None]) -> None:
        """add(new); if it raises, discard(new.request_id) whatever it left, and record why."""
        try:
            add(new)
            self._inject_fault(new)
        except Exception as error:  # noqa: BLE001 - any failure of one request is that request's alone
            discard(new.request_id)
            self._dropped.add(new.request_id)
            reason = self.failed[new.request_id] = f"{type(error).__name__}: {error}"
            logger.error("request %s failed on this worker and was dropped: %s", new.request_id, reason)

    def drop_failed(self, step: StepInput) -> None:
        """Take the failed requests out of the step's schedule (in place)."""
        if not self._dropped:
            return
        kept = [(i, n) for i, n in zip(step.scheduled_ids, step.num_scheduled_tokens) if i not in self._dropped]
        step.scheduled_ids = [i for i, _ in kept]
        step.num_scheduled_tokens = [n for _, n in kept]

    def take(self) -> dict[str, str]:
        """The failures to report with this step's output; forgotten here."""
        failed, self.failed = self.failed, {}
        return failed

    def _inject_fault(self, new: NewRequestData) -> None:
        if self._poison_token is not None and self._poison_token in new.token_ids[: new.prompt_len]:
            raise InjectedFaultError(f"ZLLM_TEST_FAIL_PROMPT_TOKEN: the prompt holds token {self._poison_token}")
