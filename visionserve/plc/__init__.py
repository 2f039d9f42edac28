"""Results to the PLC: an OPC UA server after OPC 40100 (Machine Vision) and a Modbus TCP server
with a fail-safe handshake, both fed by one result bus (docs/plc.md).

- :mod:`.bus`: every answered frame, published once by the engine, never blocking it.
- :mod:`.watchdog`: is the engine making progress? (the heartbeat stops when it is not)
- :mod:`.handshake`: one station's result buffer and acknowledge handshake (no I/O).
- :mod:`.modbus`, :mod:`.opcua`: the two servers; :mod:`.service` runs them in their own thread.
- :mod:`.slots`: which connection gives its slot to a new one, and idle ones closed.
- :mod:`.sim`: ``visionserve plc-sim``, a PLC for tests, demos and the latency benchmark.

asyncua and pymodbus come with the ``plc`` extra; nothing here imports them until a PLC server
is configured.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import ConfigError


def require(module: str) -> ModuleType:
    """Import a PLC protocol library, or say which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and exc.name.partition(".")[0] != module.partition(".")[0]:
            raise  # the library is there but broken: show that
        raise ConfigError(f"the PLC servers need {module}, which this install does not have: "
                          "pip install 'visionserve[plc]' -c requirements/constraints.txt"
                          ) from None
