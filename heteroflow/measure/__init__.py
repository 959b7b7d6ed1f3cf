"""measure: this machine's profile for the cost model (`heteroflow profile`); imports torch lazily.

`stagemap` prices plans from a `Profile` and never measures anything: the timing code, which runs torch
and heteroflow's own decoder block, lives here, above stagemap and models.

Public API:
- `measure_profile(*, quick=False, ...) -> Profile` (`machine`): devices, links, disk and one CPU thread
- `measure_cpu_thread(*, quick=False) -> ThreadProfile` (`thread`): what an emulated rank runs at
- `profile_command(...)` (`command`): `heteroflow profile`
"""

from heteroflow.measure.command import profile_command
from heteroflow.measure.machine import measure_profile
from heteroflow.measure.thread import measure_cpu_thread

__all__ = ["measure_cpu_thread", "measure_profile", "profile_command"]
