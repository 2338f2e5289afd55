"""Which adapters may run together: the scheduler's LoRA admission (enable_lora).

Each rank holds `max_loras` adapter slots and keeps at most `max_cpu_loras` adapters loaded,
pinned ones never evicted. A step's adapters must all be loaded at once, so the running
requests' distinct adapters A (the base model counts for none) must satisfy

    |A| <= max_loras        and        |A ∪ pinned| <= max_cpu_loras

A waiting request whose adapter would break either waits (passed over, keeping its place)
until a running adapter's last request finishes. Each step schedules a subset of the running
requests, so no step breaks them either. A request whose adapter cannot fit even alone (the
pinned adapters fill max_cpu_loras) would wait for ever: it is ended instead, saying why; and
a pin that would break the rule for the requests running now is refused.
"""

from __future__ import annotations

from collections.abc import Iterable

from shardserve.config.lora import LoRAConfig
from shardserve.engine.request import Request


class LoRAAdmission:
    def __init__(self, lora_config: LoRAConfig | None) -> None:
        self.enabled = lora_config is not None
        self.max_loras = lora_config.max_loras if lora_config is not None else 0
        self.cpu_loras = lora_config.cpu_loras if lora_config is not None else 0
        self.pinned: set[int] = set()
        self._step: set[int] = set()  # the running adapters, with this step's admissions

    def start(self, running: Iterable[Request]) -> None:
        """Before admitting this step's waiting requests."""
        self._step = {r.lora_int_id for r in running if r.lora_int_id} if self.enabled else set()

    def fits(self, request: Request) -> bool:
        """Whether `request` may be admitted now, beside the running adapters."""
        lora = request.lora_int_id
        if not (lora and self.enabled) or lora in self._step:
            return True
        return self._allowed(self._step | {lora})

    def admitted(self, request: Request) -> None:
        if request.lora_int_id and self.enabled:
            self._step.add(request.lora_int_id)

    def never_fits(self, request: Request) -> str | None:
        """Why the request's adapter can never be loaded beside the pinned ones (else None)."""
        lora = request.lora_int_id
        if not (lora and self.enabled) or self._allowed({lora}):
            return None
        return (f"adapter {request.lora_request.lora_name!r} (lora_int_id={lora}) cannot be "
                f"loaded: the pinned adapters {sorted(self.pinned)} fill max_cpu_loras="
                f"{self.cpu_loras}; remove one (remove_lora) or raise max_cpu_loras")

    def check_pin(self, lora_int_id: int, running: Iterable[Request]) -> None:
        """ValueError when pinning the adapter would leave the running requests' adapters no
        room to be loaded together."""
        active = {r.lora_int_id for r in running if r.lora_int_id}
        pinned = self.pinned | {lora_int_id}
        if len(active | pinned) > self.cpu_loras:
            raise ValueError(
                f"pinning lora_int_id={lora_int_id} leaves no room: running adapters "
                f"{sorted(active)} and pinned {sorted(pinned)} exceed max_cpu_loras="
                f"{self.cpu_loras}; raise max_cpu_loras or pin once they finish")

    def _allowed(self, loras: set[int]) -> bool:
        return len(loras) <= self.max_loras and len(loras | self.pinned) <= self.cpu_loras
