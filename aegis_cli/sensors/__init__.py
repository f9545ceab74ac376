"""In-training sensors (docs/sensors.md): a training loop's own GEMMs checked on its real tensors,
suspicions verified off the critical path, confirmed ones saved as vTasks for ``aegis replay``.

    from aegis_cli.sensors import Action, SensorConfig, instrument, uninstrument

    handle = instrument(model, SensorConfig(bundle_dir="vtasks/"))
    for batch in loader:
        loss = model(batch).loss
        loss.backward()
        if handle.step() is Action.STOP:   # verify at the step boundary, before the update
            break                          # corruption confirmed: keep handle.last_clean_step
        optimizer.step()
    uninstrument(model)

Importing this package imports torch, never click, rich, CuPy or NVML.
"""

from aegis_cli.sensors.config import SensorConfig
from aegis_cli.sensors.events import Action, SensorEvent, SensorStats
from aegis_cli.sensors.handle import SensorHandle, checkpoint, instrument, uninstrument

__all__ = ["Action", "SensorConfig", "SensorEvent", "SensorHandle", "SensorStats", "checkpoint", "instrument", "uninstrument"]
