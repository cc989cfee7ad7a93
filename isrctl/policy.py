"""State-transfer policies, named as in the ISR papers, placed on the ISR timeline.

The timeline (Kozuch et al., *Efficient State Transfer for Internet Suspend/Resume*, Fig. 3)::

    site 1: |---- t1: working ----| suspend
                                   |-- t2: dirty state to the server --|
    site 2:                                                            |-- t3: proactive warming --| resume
                                                                                                   |- t4 -|-- t5: working --
                                                                                                  resume latency   (slowdown)

`resume --policy` picks what happens at site 2 (and, for eager writeback, during t1 at site 1):

- ``baseline``: everything (disk and memory) is transferred during t4, before QEMU starts: the longest
  resume latency, no slowdown, and the session can then run disconnected.
- ``proactive`` (fully proactive): everything was transferred during t3 by an earlier ``isr hoard``;
  resume only launches the VM. Anything the hoard did not get is fetched on demand, and resume says how much.
- ``demand`` (demand-fetch): only the device state and the keyrings are fetched in t4; every chunk arrives
  on first touch during t5. Unlike the papers' pure demand-fetch, the link does not idle while the guest
  computes: whenever no guest read has waited for a moment, vulpes streams the recorded working set, then
  the rest of the disk, so that later misses are fewer (vulpes's idle priority, doc/vulpes.md).
- ``lazy-ws`` (lazy working set): as demand, and vulpes hoards the working set recorded at the last
  suspend in the background during t5, at idle priority (only while no guest read waits), but not the rest
  of the disk after it.
- ``eager-ws`` (eager working set): ``isr hoard --working-set`` fetched the recorded working set during t3;
  resume as demand.
- ``eager-writeback``: as demand at resume, and dirty chunks are trickled to the server during t5 (this
  session's t1), so the next suspend's t2 is short. ``--writeback`` adds this to any other policy.

Disconnected operation (``resume --disconnected``) is orthogonal: after a full hoard with the lock held
(``isr checkout`` + ``isr hoard``), the session never talks to the server; the changes are checked in later.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import IsrError


@dataclass(frozen=True)
class Policy:
    """What a resume does about chunk transfer."""

    name: str
    summary: str
    #: Hoard everything before QEMU starts (t4).
    hoard_all_first: bool = False
    #: Hoard the stored working set in the background once the VM runs (t5).
    hoard_working_set_lazily: bool = False
    #: What an earlier `isr hoard` should have fetched (t3): "all", "working-set" or None.
    expects_hoard: str | None = None
    #: Trickle dirty chunks to the server while the VM runs.
    writeback: bool = False
    #: Stream the working set, then the rest of the disk, while no guest read waits (t5).
    stream_when_idle: bool = False


POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy("baseline", "transfer everything before the VM starts", hoard_all_first=True),
    Policy("proactive", "everything was hoarded ahead of time (isr hoard); demand-fetch what is missing",
           expects_hoard="all"),
    Policy("demand", "start at once; fetch chunks when the guest first touches them, and the rest while it does not "
                     "wait", stream_when_idle=True),
    Policy("lazy-ws", "start at once; hoard the last working set in the background", hoard_working_set_lazily=True),
    Policy("eager-ws", "the working set was hoarded ahead of time (isr hoard --working-set)",
           expects_hoard="working-set"),
    Policy("eager-writeback", "start at once; trickle dirty chunks to the server while the VM runs",
           writeback=True, stream_when_idle=True),
)}

DEFAULT = "demand"

#: The default trickle-writeback rate in bytes per second (0 = unlimited).
DEFAULT_WRITEBACK_RATE = 4 << 20


def get(name: str) -> Policy:
    """The policy called ``name``. Raises IsrError listing the valid names."""
    try:
        return POLICIES[name]
    except KeyError:
        raise IsrError(f"unknown policy {name!r}: use one of {', '.join(POLICIES)}") from None


def parse_rate(text: str) -> int:
    """'4M' -> 4194304 bytes per second; plain numbers are bytes; K, M, G are powers of 1024; 0 = unlimited.
    Raises IsrError for anything else."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    value = text.strip().upper().removesuffix("B/S").removesuffix("/S").removesuffix("B").removesuffix("I")
    unit = value[-1:] if value[-1:] in "KMG" else ""
    number = value[:-1] if unit else value
    try:
        rate = float(number) * units[unit]
    except ValueError:
        raise IsrError(f"not a rate: {text!r} (examples: 500K, 4M, 0 for unlimited)") from None
    if rate < 0:
        raise IsrError(f"a rate cannot be negative: {text!r}")
    return int(rate)
